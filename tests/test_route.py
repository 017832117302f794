"""Choosing the route (docs/design.md D8): per-member verdicts, reasons, the report."""
from __future__ import annotations

import math

import pytest
import torch

import chorus_tune as ct
from chorus_tune import reference
from chorus_tune.route import ProbeResult, RouteChoice, RouteReason, judge

from models import cnn, digits, mlp_task, params_close

IMAGES = digits(images=True)
CNN_RTOL = 1e-4  # test_fidelity.py: convolutions and BatchNorm, documented there


def probe(losses, *state):
    return ProbeResult(torch.tensor(losses), [torch.tensor(t) for t in state])


def test_judge_compares_only_members_finite_on_both_routes():
    nan, inf = float("nan"), float("inf")
    members = [3, 5, 6, 9]
    eager = probe([1.0, nan, 1.0, 1.0], [[1.0, 2.0], [nan, 1.0], [1.0, 1.0], [4.0, 4.0]], [1, 2, 3, 4])
    other = probe([1.0, nan, 1.0, 1.0], [[1.0, 2.0], [nan, 1.0], [inf, 1.0], [4.0, 5.0]], [1, 2, 3, 4])
    verdict = judge(members, eager, other, rtol=1e-3, atol=1e-5)
    # 5 is non-finite on both, 6 on one route only: their own problem, left out.
    assert verdict.nonfinite == [5, 6]
    assert verdict.compared == [3, 9]
    assert verdict.disagreeing == [9] and not verdict.agrees


def test_judge_holds_integer_state_to_equality():
    eager = probe([1.0, 1.0], [[1.0], [1.0]], [3, 3])
    other = probe([1.0, 1.0], [[1.0], [1.0]], [3, 4])
    assert judge([0, 1], eager, other, rtol=1e-3, atol=1e-5).disagreeing == [1]


def test_every_reason_says_itself_in_words_and_an_unknown_route_is_refused():
    assert all(reason.description for reason in RouteReason)
    assert RouteChoice("vmap").reason is RouteReason.REQUESTED
    with pytest.raises(ValueError, match="route must be one of"):
        ct.Bucket(mlp_task(), 2, route="fast")


def test_a_member_that_diverges_never_demotes_its_bucket_mates(vmap_times_faster):
    # A member whose weights have blown up (SGD at lr=1e3 takes a CNN's to
    # ~1e28 within an iteration) gives non-finite probe rows. Judged with the
    # others, that made the whole bucket fall back to the eager loop. Its
    # divergence is planted (weights at 1e30): left to lr=1e3 alone, whether
    # its probe step overflows depends on the route and on the machine. And
    # vmap is made the faster route, so that the newcomer is probed at all.
    task = ct.Task(cnn, IMAGES, optimizer="sgd", batch_size=32, iteration_steps=5)
    bucket = ct.Bucket(task, 4)
    healthy = {bucket.add(c): c for c in (dict(lr=0.01, seed=0), dict(lr=0.02, seed=1))}
    wild = bucket.add(dict(lr=1e3, seed=2))
    first = bucket.run_iteration()
    assert bucket.route == "vmap"
    with torch.no_grad():
        for weights in bucket.stack.params.values():
            weights[wild].fill_(1e30)
    late = dict(lr=0.01, seed=5)
    healthy[bucket.add(late)] = late
    second = bucket.run_iteration()
    report = bucket.route_report()
    assert report["nonfinite_members"] == [wild]
    assert bucket.route_reason is RouteReason.FASTER and report["rejected"] == {}
    assert report["reason"] == "faster" and set(report["seconds"]) == {"eager", "vmap"}
    for slot, config in healthy.items():
        history = [first[slot], second[slot]] if slot in first else [second[slot]]
        expected, model = reference.train(task, config, iterations=len(history))
        assert all(math.isclose(a["val_loss"], b["val_loss"], rel_tol=CNN_RTOL) for a, b in zip(history, expected))
        params_close(bucket.export_model(slot), model, CNN_RTOL)


def test_the_probe_gives_each_member_its_own_batch_when_training_does():
    bucket = ct.Bucket(mlp_task(iteration_steps=2), 3)
    slots = [bucket.add(dict(lr=0.05, seed=s)) for s in (1, 2, 3)]
    orders = [bucket.members[k].order.state_dict() for k in slots]
    x, y, shared = bucket._probe_batch(slots, gather=False)
    assert not shared and x.shape[0] == 3
    assert not torch.equal(x[0], x[1]) and not torch.equal(x[1], x[2])
    # Each member's next training batch, and the probe took nothing from its order.
    for k, order in zip(slots, orders):
        assert bucket.members[k].order.pos == order["pos"]
        assert torch.equal(x[k], bucket._train.tensors[0][bucket.members[k].order.take(1)[0]])


def test_the_tune_options_accept_exactly_the_cores_routes():
    from chorus_tune.route import ROUTES
    from chorus_tune.tune.values.options import BucketOptions

    for route in ROUTES:
        assert BucketOptions(route=route).route == route
    with pytest.raises(ValueError, match="route must be"):
        BucketOptions(route="fast")


def test_the_probe_compares_in_full_float32_and_gives_the_users_math_modes_back():
    from chorus_tune.route import same_math_mode

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # a user who chose TF32
    try:
        with same_math_mode():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _probed_stack_sizes(monkeypatch) -> list[tuple[str, int]]:
    """(route, rows of the stack it ran on) for every probe step from now on."""
    seen: list[tuple[str, int]] = []
    step = ct.Bucket._probe_step

    def spy(self, route, live):
        seen.append((route, self.capacity))
        return step(self, route, live)

    monkeypatch.setattr(ct.Bucket, "_probe_step", spy)
    return seen


def test_the_probe_of_a_partly_filled_bucket_runs_on_its_live_rows_as_training_does(monkeypatch):
    # Training gathers 2 live members of 4 into a stack of 2 (bucket_iteration.
    # _trains_gathered); a probe over all 4 rows timed vmap at twice its cost
    # and settled a bucket of 8 live members of 16 on eager (1.3-1.8x slower).
    seen = _probed_stack_sizes(monkeypatch)
    task = mlp_task(iteration_steps=3)
    bucket = ct.Bucket(task, 4)
    configs = {bucket.add(c): c for c in (dict(lr=0.05, seed=1), dict(lr=0.02, seed=2))}
    results = bucket.run_iteration()
    assert {route for route, _ in seen} == {"eager", "vmap", "batched"}  # an MLP: batched.py accepts it
    assert {rows for _, rows in seen} == {2}
    for slot, config in configs.items():
        expected, model = reference.train(task, config)
        assert math.isclose(results[slot]["val_loss"], expected[0]["val_loss"], rel_tol=1e-5)
        params_close(bucket.export_model(slot), model, 1e-5)


def _two_members(iteration_steps: int) -> ct.Bucket:
    bucket = ct.Bucket(mlp_task(iteration_steps=iteration_steps), 2)
    for seed in (1, 2):
        bucket.add(dict(lr=0.05, seed=seed))
    return bucket


def test_the_probe_of_a_full_bucket_runs_on_the_whole_stack(monkeypatch):
    seen = _probed_stack_sizes(monkeypatch)
    bucket = _two_members(iteration_steps=3)
    bucket.run_iteration()
    assert seen and {rows for _, rows in seen} == {2}


def test_the_route_timing_leaves_the_put_back_untimed():
    import time

    from chorus_tune.route import time_routes

    resets = []
    seconds = time_routes(lambda route: None, ["eager", "vmap"], sync=lambda: None,
                          reset=lambda: (resets.append(1), time.sleep(0.02)), repeats=3)
    assert len(resets) == 6
    assert all(s < 0.02 for s in seconds.values())


def test_the_timing_in_training_interleaves_the_routes_and_keeps_the_fastest():
    choice = RouteChoice("auto", repeats=2)
    choice.time_in_training(["batched", "vmap", "eager"])
    assert choice.route == "batched" and choice.reason is RouteReason.TIMING and not choice.timed
    took = {"batched": [0.3, 0.2], "vmap": [0.1, 0.4], "eager": [0.5, 0.6]}
    order = []
    while choice.timing:
        route = choice.step_route()
        order.append(route)
        choice.record_step(route, took[route][order.count(route) - 1])
    assert order == ["batched", "vmap", "eager"] * 2
    assert choice.seconds == {"batched": 0.2, "vmap": 0.1, "eager": 0.5}  # the best of each
    assert choice.route == "vmap" and choice.reason is RouteReason.FASTER and choice.checked


def test_a_wider_stack_forgets_the_timing_half_done():
    choice = RouteChoice("auto")
    choice.time_in_training(["vmap", "eager"])
    choice.record_step("vmap", 0.1)
    choice.forget_timing()
    assert not choice.timing and not choice.timed


def test_training_steps_time_the_routes_and_the_probe_only_checks_them(monkeypatch):
    # The probe's own timing ran each route five more times on the probe batch,
    # put back after each: about half the first iteration (route.py). Now each
    # candidate runs one probe step, against eager's, and training's first
    # steps time them, every one a step the members keep.
    probed = _probed_stack_sizes(monkeypatch)
    task = mlp_task(iteration_steps=16)
    configs = [dict(lr=0.05 * (s + 1), seed=s) for s in range(3)]
    bucket = ct.Bucket(task, 3)
    slots = [bucket.add(c) for c in configs]
    results = bucket.run_iteration()
    report = bucket.route_report()
    assert sorted(route for route, _ in probed) == ["batched", "eager", "vmap"]
    assert set(report["seconds"]) == {"batched", "vmap", "eager"}
    assert bucket.route_reason is RouteReason.FASTER and bucket.route == min(report["seconds"],
                                                                              key=report["seconds"].get)
    assert bucket.last_route == "batched+eager+vmap" and bucket.last_routes == 3
    for slot, config in zip(slots, configs):
        expected, model = reference.train(task, config, iterations=1)
        assert results[slot]["route"] == bucket.route
        assert math.isclose(results[slot]["val_loss"], expected[0]["val_loss"], rel_tol=1e-5)
        params_close(bucket.export_model(slot), model, 1e-5)


def test_an_iteration_too_short_to_time_every_route_is_timed_by_the_probe(monkeypatch):
    probed = _probed_stack_sizes(monkeypatch)
    bucket = _two_members(iteration_steps=4)
    bucket.run_iteration()
    assert len(probed) > 3  # checked, then timed on the probe batch
    assert bucket.route_reason is not RouteReason.TIMING and bucket.route_report()["seconds"]
