"""Task refuses data that would fail deep inside a bucket (issue 20, item 5): clear messages, at load."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from chorus_tune import Task, reference


def _linear(config: dict) -> nn.Module:
    return nn.Linear(4, 3)


def _task(train, val, **kwargs) -> Task:
    return Task(model=_linear, data=(train, val), batch_size=4, **kwargs)


def _split(rows: int, y_dtype=torch.int64):
    x = torch.randn(rows, 4)
    y = torch.randint(0, 3, (rows,)).to(y_dtype)
    return x, y


def test_an_empty_validation_split_is_refused_by_name():
    task = _task(_split(16), _split(0))
    with pytest.raises(ValueError, match="val split is empty"):
        task.load_data()


def test_an_empty_train_split_is_refused_by_name():
    task = _task(_split(0), _split(8))
    with pytest.raises(ValueError, match="train split is empty"):
        task.load_data()


def test_an_empty_dataset_split_is_refused_too():
    class Empty(Dataset):
        def __len__(self):
            return 0

        def __getitem__(self, i):
            raise IndexError(i)

    with pytest.raises(ValueError, match="val split is empty"):
        _task(_split(16), Empty()).load_data()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_cross_entropy_refuses_targets_that_are_not_class_indices(dtype):
    task = _task(_split(16, dtype), _split(8))
    with pytest.raises(TypeError, match=r"train split's targets are torch\.(float32|bool).*y\.long\(\)"):
        task.load_data()


def test_soft_labels_and_regression_targets_still_load():
    x = torch.randn(16, 4)
    soft = torch.softmax(torch.randn(16, 3), dim=1)  # class probabilities: cross_entropy takes them
    _task((x, soft), (x[:8], soft[:8])).load_data()
    _task(_split(16, torch.float32), _split(8, torch.float32), loss="mse").load_data()
    _task(_split(16, torch.int64), _split(8, torch.int64), loss="mse").load_data()  # mse casts


def test_the_refusal_comes_before_training_not_from_inside_evaluation():
    # Before: reference.train (and a bucket) failed in evaluation with
    # "TypeError: unsupported operand type(s) for /: 'NoneType' and 'int'".
    task = _task(_split(16), _split(0))
    with pytest.raises(ValueError, match="val split is empty"):
        reference.train(task, {}, seed=0, iterations=1)


def test_the_input_row_is_a_copy_of_the_first_training_row_and_the_data_is_not_kept():
    calls = []

    def data():
        calls.append(1)
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        return (x, torch.zeros(4, dtype=torch.long)), (x, torch.zeros(4, dtype=torch.long))

    task = Task(lambda c: nn.Linear(3, 2), data)
    row = task.input_row()
    assert torch.equal(row, torch.tensor([0.0, 1.0, 2.0]))
    assert row.untyped_storage().nbytes() == 3 * 4  # its own storage, not a view of the split
    assert task.input_row() is row and calls == [1]
    assert task._loaded is None  # loaded to read one row, not kept
