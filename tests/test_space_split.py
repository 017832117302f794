"""How a sweep's trials split into structures, said in words (issue 41 item 5)."""
from __future__ import annotations

from torch import nn

import chorus_tune as ct
from chorus_tune.tune.search.space_split import split_of

from models import digits


def widths(config: dict) -> nn.Module:
    return nn.Sequential(nn.Linear(64, int(config.get("l1", 32))), nn.ReLU(), nn.Linear(int(config.get("l1", 32)), 10))


TASK = ct.Task(widths, digits())


def test_trials_of_one_structure_are_said_to_fuse():
    split = split_of(TASK, [{"lr": lr, "l1": 32} for lr in (0.1, 0.01, 0.001)])
    assert (split.structures, split.sizes, split.splitting) == (1, (3,), ())
    assert split.message(16) == "3 trials share one structure: they fuse in buckets of up to 16"


def test_a_width_and_the_batch_size_are_named_as_what_splits_and_lr_is_not():
    configs = [{"lr": 0.1 * (i + 1), "l1": l1, "batch_size": b}
               for i, (l1, b) in enumerate([(16, 32), (256, 32), (16, 64), (256, 8)])]  # 16x apart: no padding
    split = split_of(TASK, configs)
    assert split.structures == 4 and not split.fuses
    assert split.splitting == (("batch_size", 3), ("l1", 2))
    message = split.message(16)
    assert message.startswith("4 trials fall into 4 structures (batch_size takes 3 values, l1 takes 2 values; ")
    assert message.endswith(": nothing will fuse, every trial trains in a bucket of its own")
    # Where members seated alone train solo (chorus_tune.tune.rules.solo), it says so.
    assert split.message(16, solo=True).endswith(": nothing will fuse, every trial trains alone in its own "
                                                 "process, as plain Tune would")


def test_structures_that_hold_several_trials_are_said_to_fuse_within_themselves():
    configs = [{"lr": lr, "l1": l1} for l1 in (16, 256) for lr in (0.1, 0.01, 0.001)] + [{"lr": 0.5, "l1": 16}]
    split = split_of(TASK, configs)
    assert split.sizes == (4, 3) and split.fuses and split.splitting == (("l1", 2),)
    assert "the largest structure holds 4 of them, the smallest 3" in split.message()


def test_tune_s_private_keys_are_ignored_and_a_config_that_cannot_build_is_counted_not_raised():
    def picky(config: dict) -> nn.Module:
        if config["l1"] < 0:
            raise ValueError("l1 must be positive")
        return widths(config)

    task = ct.Task(picky, digits())
    split = split_of(task, [{"l1": 16, "__trial_index__": 0}, {"l1": 16, "__trial_index__": 1}, {"l1": -1}])
    assert (split.trials, split.structures, split.unbuildable, split.splitting) == (3, 1, 1, ())


def test_widths_that_pad_within_the_rule_do_not_split_and_widths_beyond_it_are_said():
    # Priced as the pool prices, by multiply-adds per sample (74 * l1): 128 costs 4x 32, 256 8x.
    within = split_of(TASK, [{"lr": 0.1, "l1": l1} for l1 in (32, 64, 128)])
    assert (within.structures, within.splitting) == (1, ())
    apart = split_of(TASK, [{"lr": 0.1, "l1": l1} for l1 in (32, 64, 128, 256)])
    assert (apart.structures, apart.sizes, apart.splitting) == (2, (3, 1), (("l1", 4),))
    assert "their widths would cost more padded together than the width rule allows" in apart.message()


def test_the_head_widths_of_a_cnn_are_priced_by_their_work_and_do_not_split_it():
    """The PyTorch tutorial's case: the swept layers are a small part of the
    work, so padding them costs little though it multiplies their parameters."""
    def cnn_head(config: dict) -> nn.Module:
        return nn.Sequential(nn.Conv2d(1, 64, 3), nn.ReLU(), nn.Conv2d(64, 16, 3), nn.ReLU(), nn.Flatten(),
                             nn.Linear(16 * 4 * 4, int(config["l1"])), nn.ReLU(), nn.Linear(int(config["l1"]), 10))

    # From 4 to 128 head units: 4.0x the parameters (which would split), 1.19x the multiply-adds
    # (the convolutions' 168k stay): compute-bound on a CPU, where the limit is 1.25x.
    split = split_of(ct.Task(cnn_head, digits(images=True)), [{"l1": l1} for l1 in (4, 32, 128)])
    assert (split.structures, split.splitting) == (1, ())
