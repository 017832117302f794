"""Which widths share a padded stack, and who is of one padded family (docs/design.md D9; Ray-free, no training)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import chorus_tune as ct
from chorus_tune.stack import describe_split, structural_key
from chorus_tune.width_rule import WidthRule, bracket, describe_band
from chorus_tune.widths import Profile, padding_family, shapes_of, widest

from models import digits


def _key(factory, config=None):
    return structural_key(ct.Task(factory, digits(), batch_size=32), config or {})


def test_a_bracket_holds_widths_up_to_a_power_of_the_ratio():
    assert [bracket(w, 4) for w in (1, 2, 4, 5, 16, 17, 32, 64, 65, 256)] == [0, 1, 1, 2, 2, 3, 3, 3, 4, 4]
    assert bracket(8 ** 7, 8) == 7  # the top of a bracket is in it (a float logarithm says 8)


def test_a_doubling_sweep_pairs_neighbours_on_a_cpu():
    rule = WidthRule()
    bands = {w: rule.band([64, w, w, w, w, 10], params=10 ** 6, device_type="cpu", batch=32)
             for w in (32, 64, 128, 256)}
    assert bands[32] == bands[64] != bands[128] == bands[256]


def test_a_small_model_on_a_gpu_takes_the_launch_bound_ratio():
    rule = WidthRule(ratio=4, launch_bound_ratio=16, launch_bound_work=2 ** 24)
    # 32 rows x 1000 parameters x 16^2 = 8.2e6 multiply-adds: within the launch-bound work.
    assert rule.ratio_for(1000, "cuda", 32) == 16
    assert rule.band([32], 1000, "cuda", 32) == rule.band([200], 1000, "cuda", 32)
    assert rule.band([32], 1000, "cpu", 32) != rule.band([200], 1000, "cpu", 32)


def test_a_large_model_on_a_gpu_keeps_the_cpu_ratio():
    assert WidthRule().ratio_for(10 ** 6, "cuda", 32) == 4


def test_a_band_is_said_as_its_brackets():
    assert describe_band((4, (3, 3, 2))) == "ratio 4: (4, 16], (16, 64]"


@pytest.mark.parametrize("field, value", [("ratio", 1), ("launch_bound_ratio", True), ("ratio", "4")])
def test_a_bad_rule_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        WidthRule(**{field: value})


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


def test_the_sharing_key_is_equal_within_a_band_and_the_split_between_bands_is_said():
    from chorus_tune.stack import sharing_key

    task = ct.Task(_mlp, digits(), batch_size=32)
    assert sharing_key(task, {"h": 20}) == sharing_key(task, {"h": 64})
    assert sharing_key(task, {"h": 20}) != sharing_key(task, {"h": 128})
    words = describe_split(sharing_key(task, {"h": 20}), sharing_key(task, {"h": 128}))
    assert words == ("their widths fall in different bands of the width rule: a width in (16, 64] vs one in "
                     "(64, 256] (brackets of ratio 4)")
