"""Which widths share a padded stack, and who is of one padded family (docs/design.md D9; Ray-free, no training)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import chorus_tune as ct
from chorus_tune.stack import describe_split, structural_key
from chorus_tune.width_rule import WidthGroups, WidthRule
from chorus_tune.widths import Profile, padding_family, shapes_of, widest

from models import digits


def _key(factory, config=None):
    return structural_key(ct.Task(factory, digits(), batch_size=32), config or {})


def test_members_within_the_factor_share_on_a_cpu():
    verdict = WidthRule().judge([100.0, 400.0], padded=400.0, device_type="cpu", batch=32)
    assert verdict.shares and verdict.factors == (4.0, 1.0)


def test_a_member_past_the_factor_on_a_cpu_does_not_share_and_the_reason_names_its_price():
    verdict = WidthRule().judge([100.0, 500.0], padded=500.0, device_type="cpu", batch=32)
    assert not verdict.shares
    assert "a member costing 100 would cost 500 (5x its own; the limit on cpu is 4x for a padded step of 1.6e+04 " \
           "multiply-adds)" in verdict.reason


def test_a_launch_bound_step_on_a_gpu_allows_the_larger_factor():
    rule = WidthRule(factor=4, launch_bound_factor=16, launch_bound_work=1e6)
    assert rule.judge([100.0, 1000.0], padded=1000.0, device_type="cuda", batch=32).shares  # 32 * 1000 <= 1e6
    assert not rule.judge([100.0, 1000.0], padded=1000.0, device_type="cpu", batch=32).shares


def test_a_large_step_on_a_gpu_keeps_the_cpu_factor():
    rule = WidthRule(factor=4, launch_bound_factor=16, launch_bound_work=1e6)
    assert not rule.judge([1e4, 1e5], padded=1e5, device_type="cuda", batch=64).shares  # 64 * 1e5 > 1e6


def test_an_overhead_bound_step_on_a_cpu_allows_the_factor():
    # 64 rows x 16k multiply-adds = 1M, within cpu_overhead_work (2^20): padding rides on fixed costs.
    assert WidthRule().judge([5e3, 16e3], padded=16e3, device_type="cpu", batch=64).shares


def test_a_compute_bound_step_on_a_cpu_allows_only_the_compute_factor():
    # 64 rows x 17k = 1.09M > 2^20: every padded multiply-add costs its full price.
    verdict = WidthRule().judge([13e3, 17e3], padded=17e3, device_type="cpu", batch=64)
    assert not verdict.shares and verdict.limit == 1.25
    assert "the limit on cpu is 1.25x for a padded step of 1.09e+06 multiply-adds" in verdict.reason
    assert WidthRule().judge([14e3, 17e3], padded=17e3, device_type="cpu", batch=64).shares  # 1.21x


def test_a_device_neither_cpu_nor_cuda_keeps_the_general_factor():
    assert WidthRule().limit("mps", batch=64, padded=1e6) == 4


def test_the_cpu_compute_factor_never_exceeds_the_factor():
    assert WidthRule(factor=1, cpu_compute_factor=1.25).limit("cpu", batch=64, padded=1e6) == 1


def test_the_compute_bound_cpu_limit_ignores_the_gpu_s_launch_bound():
    rule = WidthRule(cpu_overhead_work=1e3, launch_bound_work=1e9)
    assert rule.limit("cpu", batch=10, padded=1e3) == 1.25
    assert rule.limit("cuda", batch=10, padded=1e3) == 16


@pytest.mark.parametrize("field, value", [("factor", 0.5), ("launch_bound_factor", True), ("factor", "4"),
                                          ("cpu_compute_factor", 0.9), ("cpu_overhead_work", None)])
def test_a_bad_rule_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        WidthRule(**{field: value})


def _params(shapes):
    return float(sum(math.prod(s) for s in shapes.values()))


def _hidden(h):
    """An MLP 64 -> h -> h -> 10's weights."""
    return {"fc1": (h, 64), "fc2": (h, h), "out": (10, h)}


def test_width_groups_pair_overhead_bound_neighbours_of_a_doubling_sweep_and_split_compute_bound_ones():
    groups = WidthGroups()
    assigned = [groups.assign("mlp", _hidden(h), _params, batch=64) for h in (32, 64, 128, 256)]
    # 32 padded to 64 costs 2.6x its own (a padded step of 64 x 8.8k multiply-adds: overhead-bound),
    # to 128 7.6x; 128 padded to 256 costs 3.3x, but that step (64 x 85k) is compute-bound on a CPU.
    assert assigned == [0, 0, 1, 2]
    assert "7.62x its own; the limit on cpu is 1.25x" in groups.reasons[("mlp", 1)]
    assert "the limit on cpu is 1.25x for a padded step of" in groups.reasons[("mlp", 2)]


def test_the_same_widths_always_get_the_same_group_and_other_structures_their_own():
    groups = WidthGroups()
    first = groups.assign("mlp", _hidden(32), _params, batch=64)
    groups.assign("mlp", _hidden(256), _params, batch=64)
    assert groups.assign("mlp", _hidden(32), _params, batch=64) == first == 0
    assert groups.assign("cnn", _hidden(256), _params, batch=64) == 0


def test_a_newcomer_joins_a_group_only_if_every_member_stays_within_the_factor():
    groups = WidthGroups(WidthRule(factor=4))
    groups.assign("mlp", _hidden(32), _params, batch=64)
    groups.assign("mlp", _hidden(64), _params, batch=64)
    # 128 with 64 alone would be 2.9x, but 32 would pay 7.6x: it opens a group.
    assert groups.assign("mlp", _hidden(128), _params, batch=64) == 1


def test_on_a_gpu_small_widths_pad_further():
    groups = WidthGroups(device_type="cuda")
    assert {groups.assign("mlp", _hidden(h), _params, batch=64) for h in (32, 64, 128)} == {0}


def _mlp(c):
    return nn.Sequential(nn.Linear(64, c["h"]), nn.ReLU(), nn.Linear(c["h"], 10))


def test_widths_of_linear_layers_are_one_padded_family():
    narrow, wide = _key(_mlp, {"h": 16}), _key(_mlp, {"h": 32})
    assert narrow != wide
    assert padding_family(narrow) == padding_family(wide)
    assert widest([shapes_of(narrow), shapes_of(wide)]) == shapes_of(wide)
    assert describe_split(narrow, wide).startswith("they differ only in widths")


def test_a_kernel_size_is_no_width():
    a, b = _key(lambda c: nn.Conv2d(1, 4, c["k"]), {"k": 3}), _key(lambda c: nn.Conv2d(1, 4, c["k"]), {"k": 5})
    assert padding_family(a) != padding_family(b)


def test_a_grouped_convolution_does_not_pad():
    def conv(c):
        return nn.Conv2d(4, c["out"], 3, groups=2)

    assert padding_family(_key(conv, {"out": 4})) != padding_family(_key(conv, {"out": 8}))


def test_a_layernorm_over_a_width_is_another_family_and_the_split_names_it():
    def ln(c):
        return nn.Sequential(nn.Linear(64, c["h"]), nn.LayerNorm(c["h"]), nn.Linear(c["h"], 10))

    a, b = _key(ln, {"h": 16}), _key(ln, {"h": 32})
    assert padding_family(a) != padding_family(b)
    assert "(LayerNorm).normalized_shape: (16) vs (32)" in describe_split(a, b)
    assert "cannot pad" in describe_split(a, b)


def test_a_subclass_of_linear_does_not_pad():
    class MyLinear(nn.Linear):
        pass

    assert padding_family(_key(lambda c: MyLinear(64, c["h"]), {"h": 8})) != padding_family(
        _key(lambda c: MyLinear(64, c["h"]), {"h": 16}))


def test_the_profile_prices_a_convolution_by_its_output_positions():
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
    profile = Profile.of(model, torch.zeros(1, 8, 8))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    cost = profile.cost(shapes, shapes)
    assert cost.macs == 4 * 1 * 3 * 3 * 64 + 256 * 10
    assert cost.params == sum(p.numel() for p in model.parameters())


def test_a_model_that_cannot_run_on_meta_is_priced_by_its_parameters():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x) * float(x.sum())  # .item() on meta raises

    model = DataDependent()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    cost = Profile.of(model, torch.zeros(4)).cost(shapes, shapes)
    assert cost.macs is None and cost.measure == 10


def test_the_sharing_key_groups_widths_within_the_rule_and_the_split_beyond_it_is_said():
    from chorus_tune.stack import sharing_key

    task = ct.Task(_mlp, digits(), batch_size=32)
    groups = WidthGroups()
    narrow, near, far = (sharing_key(task, {"h": h}, groups) for h in (20, 64, 256))
    assert narrow == near != far
    assert describe_split(narrow, far) == ("their widths would cost more padded together than the width rule "
                                           "allows (chorus_tune/width_rule.py)")
    assert describe_split(narrow, _key(_mlp, {"h": 256})).startswith("they differ only in widths")


# ----- what the pool and the driver price padding with (widths.PaddingPrices) ----------------------
def _conv_head(c):
    """Convolutions do most of the work; the swept widths are the head's."""
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 12 * 12, c["l1"]), nn.ReLU(), nn.Linear(c["l1"], 10))


def _images():
    x = torch.zeros(8, 3, 16, 16)
    y = torch.zeros(8, dtype=torch.long)
    return (x, y), (x, y)


def test_prices_by_multiply_adds_let_a_cnn_s_head_widths_share_where_parameters_split_them():
    from chorus_tune.stack import sharing_key
    from chorus_tune.widths import PaddingPrices

    task = ct.Task(_conv_head, _images)
    # The head from 4 to 32 units: 6.4x its parameters, 1.15x its multiply-adds per sample (the
    # convolutions' 416k stay), within the compute-bound CPU limit of 1.25x.
    by_parameters = WidthGroups()
    assert sharing_key(task, {"l1": 4}, by_parameters) != sharing_key(task, {"l1": 32}, by_parameters)
    by_work, prices = WidthGroups(), PaddingPrices(task.input_row)
    assert sharing_key(task, {"l1": 4}, by_work, prices) == sharing_key(task, {"l1": 32}, by_work, prices)


def test_the_input_row_is_asked_for_once_and_only_when_a_second_width_comes():
    from chorus_tune.stack import sharing_key
    from chorus_tune.widths import PaddingPrices

    task = ct.Task(_conv_head, _images)
    asked = []
    prices = PaddingPrices(lambda: asked.append(1) or task.input_row())
    groups = WidthGroups()
    for _ in range(3):
        sharing_key(task, {"l1": 8}, groups, prices)
    assert asked == []  # a sweep of one width never loads data to price it
    for l1 in (16, 32, 4):
        sharing_key(task, {"l1": l1}, groups, prices)
    assert asked == [1]


def test_where_no_input_row_can_be_had_widths_are_priced_by_parameters():
    from chorus_tune.stack import sharing_key
    from chorus_tune.widths import PaddingPrices

    def broken_data():
        raise OSError("no such file")

    task = ct.Task(_conv_head, broken_data)
    groups, prices = WidthGroups(), PaddingPrices(task.input_row)
    assert sharing_key(task, {"l1": 4}, groups, prices) != sharing_key(task, {"l1": 64}, groups, prices)
