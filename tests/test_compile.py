"""The compiled route (``Task(compile=True)``): torch.compile of the fused step,
probed like any route, on the reference, with its recompiles counted and bounded
(docs/design.md D8; chorus_tune/compiling.py says why one graph per member count)."""
from __future__ import annotations

import math

import pytest
import torch

import chorus_tune as ct
from chorus_tune import reference
from chorus_tune.compiling import CompiledCalls
from chorus_tune.route import RouteReason

from models import cnn, digits, mlp, params_close

RTOL = 1e-5  # test_fidelity.py's MLP bound: the compiled step is the same float32 arithmetic
DIGITS = digits()


@pytest.fixture(scope="module", autouse=True)
def compiler():
    """Skip, saying why, where torch.compile cannot build CPU kernels (no C++ compiler)."""
    try:
        torch.compile(lambda t: t * 2 + 1)(torch.ones(4))
    except Exception as exc:  # noqa: BLE001 - any failure means: no compiled route here
        pytest.skip(f"torch.compile is not usable on this machine: {type(exc).__name__}: {exc}")


def task(**kwargs) -> ct.Task:
    return ct.Task(mlp, DIGITS, optimizer="sgd", batch_size=32, iteration_steps=10, compile=True, **kwargs)


def assert_on_reference(bucket, slot, config, history):
    expected, model = reference.train(bucket.task, config, iterations=len(history))
    for ours, theirs in zip(history, expected):
        assert math.isclose(ours["val_loss"], theirs["val_loss"], rel_tol=RTOL), (ours, theirs)
        assert math.isclose(ours["train_loss"], theirs["train_loss"], rel_tol=RTOL), (ours, theirs)
    params_close(bucket.export_model(slot), model, RTOL)


def train(bucket, iterations, histories):
    for _ in range(iterations):
        for slot, metrics in bucket.run_iteration().items():
            histories.setdefault(slot, []).append(metrics)


def test_a_compiled_bucket_follows_the_reference_recompiling_only_when_its_member_count_changes():
    bucket = ct.Bucket(task(), 4, route="compiled")
    configs = {bucket.add(c): c for c in [dict(lr=0.05 * (i + 1), momentum=0.9, seed=i) for i in range(4)]}
    histories: dict[int, list] = {}
    train(bucket, 2, histories)
    assert {m["route"] for h in histories.values() for m in h} == {"compiled"}
    assert bucket.route_report()["compiles"] == 1
    # Refill: a new member in a freed slot; the stack keeps its shape.
    bucket.retire(3)
    late = dict(lr=0.02, seed=9)
    configs[bucket.add(late)] = late
    histories[3] = []
    train(bucket, 1, histories)
    assert bucket.route_report()["compiles"] == 1
    # Compaction to two members: one more graph, for the new member count.
    bucket.retire(1)
    bucket.retire(3)
    mapping = bucket.compact()
    histories = {new: histories[old] for old, new in mapping.items()}
    configs = {new: configs[old] for old, new in mapping.items()}
    train(bucket, 1, histories)
    assert bucket.route_report()["compiles"] == 2
    # Past the bound, a new member count runs uncompiled instead of compiling again.
    bucket.stack.compiled.max_member_counts = 2
    bucket.retire(1)
    assert bucket.compact() == {0: 0}
    train(bucket, 1, histories)
    report = bucket.route_report()
    assert report["compiles"] == 2 and report["uncompiled_calls"] > 0
    for slot in bucket.live_slots:
        assert_on_reference(bucket, slot, configs[slot], histories[slot])


def test_the_probe_checks_the_compiled_route_against_the_eager_loop_and_times_it():
    bucket = ct.Bucket(task(), 3)
    configs = {bucket.add(c): c for c in [dict(lr=0.05, seed=s) for s in range(3)]}
    histories: dict[int, list] = {}
    train(bucket, 1, histories)
    report = bucket.route_report()
    assert report["rejected"] == {} and set(report["seconds"]) == {"eager", "vmap", "compiled", "batched"}
    assert report["reason"] == "faster" and report["compiles"] >= 1
    for slot, config in configs.items():
        assert_on_reference(bucket, slot, config, histories[slot])


def test_a_compile_that_fails_falls_back_with_its_reason(monkeypatch):
    def broken(self, graph, example_inputs):
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(CompiledCalls, "_backend", broken)
    bucket = ct.Bucket(task(), 2)
    configs = {bucket.add(c): c for c in [dict(lr=0.05, seed=s) for s in range(2)]}
    histories: dict[int, list] = {}
    train(bucket, 1, histories)
    report = bucket.route_report()
    assert bucket.route in ("vmap", "batched", "eager")
    assert report["rejected"]["compiled"]["reason"] == RouteReason.COMPILE_FAILED.value
    assert "no kernels today" in report["rejected"]["compiled"]["detail"]
    # vmap running because compiling failed says so; eager running because it was faster, too.
    assert bucket.route_reason is (RouteReason.COMPILE_FAILED if bucket.route == "vmap" else RouteReason.FASTER)
    for slot, config in configs.items():
        assert_on_reference(bucket, slot, config, histories[slot])



def test_on_the_compiled_route_a_retired_cnn_slot_keeps_its_batchnorm_statistics_bit_for_bit():
    # Only the compiled route still runs a group of more than half the stack on the
    # whole stack (the others gather their rows: Bucket._trains_gathered); its forward
    # writes every row's BatchNorm statistics, and the rows left out are put back.
    cnn_task = ct.Task(cnn, digits(images=True), optimizer="adam", batch_size=32, iteration_steps=2, compile=True)
    bucket = ct.Bucket(cnn_task, 3, route="compiled")
    slots = [bucket.add(dict(lr=1e-3 * (i + 1), seed=i)) for i in range(3)]
    bucket.run_iteration()
    bucket.retire(slots[1])
    frozen = [t[slots[1]].clone() for t in (*bucket.stack.state_tensors(), *bucket.optimizer.tensors())]
    survivor = {n: b[slots[0]].clone() for n, b in bucket.stack.buffers.items()}
    results = bucket.run_iteration()
    assert set(results) == {slots[0], slots[2]} and {m["route"] for m in results.values()} == {"compiled"}
    after = [t[slots[1]] for t in (*bucket.stack.state_tensors(), *bucket.optimizer.tensors())]
    assert all(torch.equal(a, b) for a, b in zip(frozen, after))
    # The survivors' statistics moved: the forward ran in training mode.
    assert any(not torch.equal(b, bucket.stack.buffers[n][slots[0]]) for n, b in survivor.items())
