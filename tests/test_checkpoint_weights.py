"""A checkpoint's weights load without running code (Ray-free: the file format, issue 40 item 4).

A ChorusTrainable checkpoint holds the member's own weights in ``weights.pt``:
a ``state_dict`` for ``torch.load(weights_only=True)``. Its bytes are made in
the bucket (``state_io.dumps``) and taken out by the trial with ``zipfile``
alone: a trial process never imports torch (docs/design.md D3).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

import chorus_tune as ct
from chorus_tune.tune.trial.checkpoint import WEIGHTS_FILE, load_model, load_weights, write_weights
from chorus_tune.tune.values import state_io

from models import tiny_mlp as mlp
from models import tiny_task as _task


@pytest.fixture(scope="module")
def trained():
    """A member state of slot 1 of a bucket of 3 (so its rows sit inside stacked tensors)."""
    bucket = ct.Bucket(_task(), capacity=3, route="vmap")
    slots = [bucket.add(dict(lr=lr, momentum=0.9, seed=s)) for s, lr in enumerate((0.05, 0.1, 0.2))]
    bucket.run_iteration()
    return bucket.member_state(slots[1])


@pytest.fixture()
def checkpoint_dir(tmp_path, trained):
    """A checkpoint directory as ChorusTrainable.save_checkpoint writes it (the weights file part)."""
    write_weights(str(tmp_path), state_io.dumps(trained))
    return str(tmp_path)


def test_the_member_state_round_trips_through_its_bytes(trained):
    back = state_io.loads(state_io.dumps(trained))
    assert back.keys() == trained.keys()
    for name, tensor in trained["model"].items():
        torch.testing.assert_close(back["model"][name], tensor, rtol=0, atol=0)
    assert back["optimizer"].keys() == trained["optimizer"].keys() and back["seed"] == trained["seed"]


def test_member_states_saved_before_the_weights_file_still_load(trained):
    import io

    buffer = io.BytesIO()
    torch.save(trained, buffer)  # the bytes of checkpoint format 1
    old = buffer.getvalue()
    assert state_io.weights_bytes(old) is None
    back = state_io.loads(old)
    torch.testing.assert_close(back["model"]["0.weight"], trained["model"]["0.weight"], rtol=0, atol=0)


def test_the_pytorch_tutorials_own_loading_code_reads_the_weights(checkpoint_dir, trained):
    state_dict = torch.load(os.path.join(checkpoint_dir, "weights.pt"), weights_only=True)
    model = mlp({})
    model.load_state_dict(state_dict)
    for name, tensor in trained["model"].items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)


def test_the_weights_file_holds_the_members_own_rows_only(checkpoint_dir, trained):
    weights = load_weights(checkpoint_dir)
    assert weights.keys() == mlp({}).state_dict().keys()
    for name, tensor in weights.items():
        assert tensor.shape == mlp({}).state_dict()[name].shape
        # Not a view of the bucket's stack: torch.save writes a view's whole storage.
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    assert os.path.getsize(os.path.join(checkpoint_dir, WEIGHTS_FILE)) < 4096


def test_the_weights_bytes_come_out_without_torch(tmp_path, trained):
    blob = tmp_path / "member.bin"
    blob.write_bytes(state_io.dumps(trained))
    out = tmp_path / "out"
    out.mkdir()
    code = ("import sys; sys.modules['torch'] = None\n"  # any import of torch fails
            "from chorus_tune.tune.trial.checkpoint import write_weights\n"
            f"write_weights({str(out)!r}, open({str(blob)!r}, 'rb').read())\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    weights = torch.load(out / WEIGHTS_FILE, weights_only=True)
    torch.testing.assert_close(weights["2.bias"], trained["model"]["2.bias"], rtol=0, atol=0)


def test_load_model_fills_the_module_you_built(checkpoint_dir, trained):
    mine = mlp({})
    model = load_model(checkpoint_dir, model=mine)
    assert model is mine and not model.training
    for name, tensor in trained["model"].items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)


def test_a_module_of_another_shape_is_refused_naming_what_differs(checkpoint_dir):
    wider = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    with pytest.raises(ValueError, match=r"0\.weight: checkpoint \(8, 4\) vs model \(16, 4\)"):
        load_model(checkpoint_dir, model=wider)
    deeper = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"missing from the checkpoint: 3\.bias, 3\.weight"):
        load_model(checkpoint_dir, model=deeper)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="model= must be the nn.Module to fill"):
        load_model("unused", model=mlp)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran",))


def test_a_weights_file_that_would_run_code_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / WEIGHTS_FILE, "wb") as f:
        pickle.dump({"0.weight": _RunsCode()}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        load_weights(str(tmp_path))
    assert not (tmp_path / "ran").exists()


def test_the_weights_of_a_checkpoint_dict_are_read_without_its_pickles(trained):
    weights = load_weights({"chorus_format": 2, "member": state_io.dumps(trained), "factory": b"never read"})
    torch.testing.assert_close(weights["0.weight"], trained["model"]["0.weight"], rtol=0, atol=0)


def test_a_directory_without_weights_says_what_it_may_be(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no weights\.pt.*before the trial's first result.*trust"):
        load_weights(str(tmp_path))
