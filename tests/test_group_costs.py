"""Which groups train one member at a time (chorus_tune/group_costs.py): only on two
measurements, the unfused member's and the fused route's at the group's size."""
from __future__ import annotations

import pytest

from chorus_tune.group_costs import GroupCosts


def test_nothing_measured_keeps_the_fused_route():
    assert not GroupCosts().trains_unfused("vmap", 2)


def test_an_unfused_member_cheaper_than_the_fused_route_at_that_size_trains_the_group_one_by_one():
    costs = GroupCosts()
    costs.record("unfused", 1, 3.0)
    costs.record("vmap", 2, 10.0)  # 5 s per member
    assert costs.trains_unfused("vmap", 2)


def test_a_fused_route_cheaper_per_member_keeps_the_group_fused():
    costs = GroupCosts()
    costs.record("unfused", 1, 3.0)
    costs.record("vmap", 15, 42.0)  # 2.8 s per member
    assert not costs.trains_unfused("vmap", 15)


def test_a_size_the_fused_route_has_not_run_at_is_not_guessed():
    costs = GroupCosts()
    costs.record("unfused", 1, 1.0)
    costs.record("vmap", 16, 32.0)
    assert not costs.trains_unfused("vmap", 4) and costs.trains_unfused("vmap", 16)


def test_the_unfused_cost_is_per_member_whatever_the_group_size():
    costs = GroupCosts()
    costs.record("unfused", 3, 6.0)
    assert costs.per_member("unfused", 1) == costs.per_member("unfused", 5) == 2.0


def test_one_measurement_moves_the_cost_halfway():
    costs = GroupCosts()
    costs.record("vmap", 2, 4.0)
    costs.record("vmap", 2, 8.0)
    assert costs.per_member("vmap", 2) == pytest.approx(3.0)


def test_a_lone_member_is_not_a_group():
    costs = GroupCosts()
    costs.record("unfused", 1, 1.0)
    costs.record("vmap", 1, 9.0)
    assert not costs.trains_unfused("vmap", 1)
