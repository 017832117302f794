"""Every member trains with its own module settings (docs/design.md D9, D8, 'What equivalent means').

Settings the stack lifts (dropout rates, LeakyReLU's slope, ELU's alpha) are
per member inside one fused step; any other setting that differs splits the
bucket, and says which.
"""
from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import chorus_tune as ct
from chorus_tune import reference
from chorus_tune.route import RouteReason

from models import digits, params_close

MLP_RTOL = 1e-5  # test_fidelity.py: float32, MLPs
RATES = (0.0, 0.3, 0.6, 0.9)
DATA = digits()


def dropout_mlp(config: dict) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(config["p"]), nn.Linear(128, 10))


def dropout_task(**kwargs) -> ct.Task:
    kwargs.setdefault("iteration_steps", 10)
    return ct.Task(dropout_mlp, DATA, optimizer="sgd", batch_size=32, **kwargs)


# ----- each member's rate is its own, on every route ---------------------------------------------------
WIDE = 2048  # activations per sample: enough draws that a wrong rate is many standard deviations off
BATCH = 64


def zeroed_fraction_and_scale(output: torch.Tensor) -> list[float]:
    """Of one member's dropout output on an all-ones input: the fraction of
    zeros, and the value the kept ones were scaled to."""
    zeroed = (output == 0).float().mean()
    # Every kept value is the scale: its largest and smallest nonzero agree (a sum would round).
    smallest_kept = torch.where(output != 0, output, torch.full_like(output, float("inf"))).amin()
    return [zeroed.item(), output.amax().item(), smallest_kept.item()]


def binomial_bound(p: float, n: int, sigmas: float = 6.0) -> float:
    # A fair rate misses it with probability ~1e-9 per member.
    return sigmas * math.sqrt(p * (1 - p) / n)


def ones_through_dropout(route: str, kind: type = nn.Dropout, training: bool = True, compile: bool = False):
    """A bucket of eight members (``RATES`` twice, each its own seed) whose
    model's activations before its ``kind`` dropout are all 1, and what comes
    out for each member: the mask times the scale."""
    task = ct.Task(lambda c: nn.Sequential(nn.Linear(8, WIDE), kind(c["p"])),
                   ((torch.ones(BATCH, 8), torch.zeros(BATCH, dtype=torch.long)),) * 2, batch_size=BATCH,
                   compile=compile)
    bucket = ct.Bucket(task, 8, route=route)
    rates = {bucket.add(dict(p=p, seed=i)): p for i, p in enumerate(RATES * 2)}
    with torch.no_grad():
        bucket.stack.params["0.weight"].zero_()
        bucket.stack.params["0.bias"].fill_(1.0)
    bucket.stack.set_training(training)
    x, y = torch.ones(BATCH, 8), torch.zeros(BATCH, dtype=torch.long)
    with torch.no_grad():
        outputs = bucket.stack.call(route, lambda output, target: output, x, y, shared=True, slots=list(rates))
    return rates, outputs


@pytest.mark.parametrize("route", ["vmap", "compiled", "batched", "eager"])
def test_eight_members_each_drop_at_their_own_rate_on_every_route(route):
    rates, outputs = ones_through_dropout(route, compile=route == "compiled")
    for slot, p in rates.items():
        zeroed, largest, smallest = zeroed_fraction_and_scale(outputs[slot])
        assert abs(zeroed - p) <= binomial_bound(p, BATCH * WIDE), f"slot {slot}: p={p} but {zeroed:.4f} zeroed"
        for scale in (largest, smallest):
            assert math.isclose(scale, 1 / (1 - p), rel_tol=1e-6), f"slot {slot}: kept values scaled by {scale}"
    # Two members at one rate draw masks of their own (torch.vmap's randomness
    # "different"): with "same", every member at a rate dropped the same units.
    for slot, p in rates.items():
        twin = next(k for k, q in rates.items() if q == p and k != slot)
        if 0 < p < 1:
            same = (outputs[slot] == outputs[twin]).float().mean().item()
            assert same < 1.0, f"slots {slot} and {twin} (both p={p}) drew the same mask"


@pytest.mark.parametrize("kind, route", [(nn.Dropout, "vmap"), (nn.AlphaDropout, "vmap"), (nn.Dropout, "batched")])
def test_in_eval_mode_every_members_dropout_passes_its_input_through_on_a_fused_route(kind, route):
    rates, outputs = ones_through_dropout(route, kind, training=False)
    for slot, p in rates.items():
        assert torch.equal(outputs[slot], torch.ones(BATCH, WIDE)), f"slot {slot} (p={p}) changed its input in eval"


def test_the_probe_rejects_a_fused_route_that_gives_members_another_members_rate():
    bucket = ct.Bucket(dropout_task(), 4)
    for i, p in enumerate(RATES):
        bucket.add(dict(p=p, lr=0.05, seed=i))
    # A fused route that reads the template's rate for everyone (the bug this
    # probe once missed: it switched dropout off) disagrees with the per-member loop.
    bucket.stack.settings["2.p"].fill_(RATES[0])
    bucket.run_iteration()
    assert bucket.route == "eager" and bucket.route_reason is RouteReason.DISAGREES
    assert "members [1, 2, 3]" in bucket.route_report()["rejected"]["vmap"]["detail"]


def test_a_dropout_sweep_shares_one_bucket_and_the_probe_keeps_vmap(vmap_times_faster):
    task = dropout_task()
    assert len({task.structural_key(dict(p=p)) for p in RATES}) == 1
    bucket = ct.Bucket(task, 4)
    slots = [bucket.add(dict(p=p, lr=0.05, seed=i)) for i, p in enumerate(RATES)]
    results = bucket.run_iteration()
    # vmap is timed the faster (the fixture): eager here would mean the probe dropped it.
    assert bucket.route == "vmap" and {m["route"] for m in results.values()} == {"vmap"}
    report = bucket.route_report()
    assert report["rejected"] == {} and report["reason"] == "faster"
    assert report["per_member"] == {"2.p": dict(zip(slots, RATES))}
    assert "2: Dropout(inplace=False, p=per member)" in report["configuration"]


# ----- equivalence: dropout members against their own unfused runs, statistically -------------------------
SEEDS = (0, 1, 2)
ITERATIONS = 4
# The gap: the largest, over 4 epochs of 30 steps, of |seed-mean fused
# train_loss - seed-mean own-rate reference train_loss|, 3 seeds per rate.
# Measured (unseeded masks): 0 at p=0, 0.008-0.026 at p=0.3-0.9 against
# the member's own rate; against the neighbouring rate of RATES 0.096-0.18,
# against the template's p=0 0.096-0.81. The bound sits between, with the
# global generator seeded so that the test is deterministic.
DROPOUT_LOSS_BOUND = 0.05


def seed_mean_curves(runs: dict[tuple[float, int], list[float]]) -> dict[float, list[float]]:
    return {p: [statistics.fmean(runs[(p, s)][i] for s in SEEDS) for i in range(ITERATIONS)] for p in RATES}


@pytest.mark.parametrize("route", ["vmap", "batched"])
def test_dropout_members_train_like_their_own_unfused_run_within_a_stated_bound(route):
    torch.manual_seed(0)  # the masks: the fused route's and the reference's come from the global generator
    task = dropout_task(iteration_steps=30)
    configs = {(p, s): dict(p=p, lr=0.1, seed=10 * s + int(10 * p)) for p in RATES for s in SEEDS}
    bucket = ct.Bucket(task, len(configs), route=route)
    slots = {bucket.add(c): key for key, c in configs.items()}
    fused: dict[tuple[float, int], list[float]] = {key: [] for key in configs}
    for _ in range(ITERATIONS):
        for slot, metrics in bucket.run_iteration().items():
            fused[slots[slot]].append(metrics["train_loss"])
    unfused, models = {}, {}
    for key, config in configs.items():
        history, models[key] = reference.train(task, config, iterations=ITERATIONS)
        unfused[key] = [m["train_loss"] for m in history]
    ours, theirs = seed_mean_curves(fused), seed_mean_curves(unfused)
    for p in RATES:
        gap = max(abs(a - b) for a, b in zip(ours[p], theirs[p]))
        assert gap <= DROPOUT_LOSS_BOUND, f"p={p}: seed-mean train_loss {ours[p]} vs its own-rate reference " \
                                          f"{theirs[p]} ({gap:.4f} apart, bound {DROPOUT_LOSS_BOUND})"
    # p = 0 draws no mask: those members follow their reference step for step.
    for slot, (p, s) in slots.items():
        if p == 0:
            params_close(bucket.export_model(slot), models[(p, s)], MLP_RTOL)


# ----- lifted settings are not member state -------------------------------------------------------------
def test_lifted_rates_stay_out_of_member_state_and_follow_the_member_through_restore_and_compaction():
    task = dropout_task(iteration_steps=3)
    source = ct.Bucket(task, 4)
    slots = [source.add(dict(p=p, lr=0.05, seed=i)) for i, p in enumerate(RATES)]
    source.run_iteration()
    state = source.member_state(slots[3])
    assert state["model"].keys() == dropout_mlp(dict(p=0.9)).state_dict().keys()
    assert source.stack.member_settings(slots[3]) == pytest.approx({"2.p": 0.9})  # the rate the fused step used
    target = ct.Bucket(task, 3)
    target.add(dict(p=0.0, lr=0.05, seed=9))
    moved = target.restore(state)
    assert target.stack.member_settings(moved) == pytest.approx({"2.p": 0.9})
    source.retire(slots[0])
    source.retire(slots[2])
    renumbered = source.compact()
    assert source.stack.member_settings(renumbered[slots[1]]) == pytest.approx({"2.p": 0.3})
    assert source.stack.member_settings(renumbered[slots[3]]) == pytest.approx({"2.p": 0.9})


# ----- other lifted settings: deterministic, so step for step ----------------------------------------------
def activations_mlp(config: dict) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(config["slope"]), nn.Linear(64, 64),
                         nn.ELU(config["alpha"]), nn.Linear(64, 10))


@pytest.mark.parametrize("route", ["vmap", "batched"])
def test_members_with_their_own_leaky_relu_slope_and_elu_alpha_share_a_fused_bucket_and_follow_their_reference(route):
    task = ct.Task(activations_mlp, DATA, optimizer="sgd", batch_size=32, iteration_steps=25)
    # Measured: within 2.2e-7 of the reference after 100 steps. ELU's vectorised
    # kernel rounds its expm1 differently (1 ulp), and at lr=0.1 with momentum
    # 0.9 a member with slope 0 amplifies that to 2.6e-3: chaotic, not wrong.
    configs = [dict(slope=s, alpha=a, lr=0.05, momentum=0.5, seed=i)
               for i, (s, a) in enumerate([(0.01, 1.0), (0.2, 0.5), (0.0, 2.0), (0.5, 1.0)])]
    assert len({task.structural_key(c) for c in configs}) == 1
    bucket = ct.Bucket(task, 4, route=route)
    slots = [bucket.add(c) for c in configs]
    fused = [bucket.run_iteration() for _ in range(4)]
    for slot, config in zip(slots, configs):
        history, model = reference.train(task, config, iterations=4)
        for ours, theirs in zip(fused, history):
            assert math.isclose(ours[slot]["val_loss"], theirs["val_loss"], rel_tol=MLP_RTOL)
        params_close(bucket.export_model(slot), model, MLP_RTOL)


# ----- settings that are not lifted split the bucket, and say so ------------------------------------------
def activation_mlp(config: dict) -> nn.Module:
    act = nn.ReLU() if config["act"] == "relu" else nn.Tanh()
    return nn.Sequential(nn.Linear(64, 64), act, nn.Linear(64, 10))


def test_an_activation_sweep_gets_one_vmapped_bucket_per_activation_each_member_following_its_reference():
    task = ct.Task(activation_mlp, DATA, optimizer="sgd", batch_size=32, iteration_steps=20)
    assert task.structural_key(dict(act="relu")) != task.structural_key(dict(act="tanh"))
    for act in ("relu", "tanh"):
        configs = [dict(act=act, lr=lr, seed=i) for i, lr in enumerate((0.05, 0.1, 0.2))]
        bucket = ct.Bucket(task, 4, route="vmap")
        slots = [bucket.add(c) for c in configs]
        other = "tanh" if act == "relu" else "relu"
        with pytest.raises(ValueError, match=r"module '1': (ReLU vs Tanh|Tanh vs ReLU)"):
            bucket.add(dict(act=other, lr=0.1, seed=9))
        fused = [bucket.run_iteration() for _ in range(3)]
        for slot, config in zip(slots, configs):
            history, model = reference.train(task, config, iterations=3)
            for ours, theirs in zip(fused, history):
                assert math.isclose(ours[slot]["val_loss"], theirs["val_loss"], rel_tol=MLP_RTOL)
                assert ours[slot]["route"] == "vmap"
            params_close(bucket.export_model(slot), model, MLP_RTOL)


def test_the_probe_keeps_vmap_for_one_activation_where_it_ran_everyone_eager_before(vmap_times_faster):
    task = ct.Task(activation_mlp, DATA, optimizer="sgd", batch_size=32, iteration_steps=5)
    bucket = ct.Bucket(task, 3)
    for i in range(3):
        bucket.add(dict(act="tanh", lr=0.1, seed=i))
    results = bucket.run_iteration()
    assert bucket.route == "vmap" and {m["route"] for m in results.values()} == {"vmap"}
    assert bucket.route_report()["rejected"] == {}


class Block(nn.Module):
    """A user's module with a setting of its own, read in forward: not liftable."""

    def __init__(self, residual: bool, p: float):
        super().__init__()
        self.residual = residual
        self.inner = nn.Linear(64, 64)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.inner(x)))
        return self.head(h + x if self.residual else h)


def test_an_unliftable_setting_splits_the_bucket_and_says_which_instead_of_running_everyone_eager():
    task = ct.Task(lambda c: Block(c["residual"], c["p"]), DATA, batch_size=32, iteration_steps=5)
    assert task.structural_key(dict(residual=True, p=0.1)) == task.structural_key(dict(residual=True, p=0.5))
    assert task.structural_key(dict(residual=True, p=0.1)) != task.structural_key(dict(residual=False, p=0.1))
    bucket = ct.Bucket(task, 3)
    bucket.add(dict(residual=True, p=0.1, lr=0.05, seed=0))
    bucket.add(dict(residual=True, p=0.5, lr=0.05, seed=1))
    with pytest.raises(ValueError, match=r"settings the stack cannot give each member: module '\(root\)' "
                                         r"\(Block\)\.residual: True vs False"):
        bucket.add(dict(residual=False, p=0.1, lr=0.05, seed=2))
    bucket.run_iteration()
    report = bucket.route_report()
    assert report["rejected"] == {}  # never eager for everyone because of a mismatch
    assert "(root): Block(residual=True)" in report["configuration"]


def test_multihead_attentions_dropout_float_splits_while_a_transformer_layers_dropout_modules_are_lifted():
    def layer(config: dict) -> nn.Module:
        return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=config["p"], batch_first=True)

    # Sequences of 4 tokens of width 8, regressed on: data the layer takes (the
    # first member's join runs a forward of two rows: Task.check_model).
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randn(n, 4, 8, generator=generator) for n in (64, 64, 16, 16)]
    task = ct.Task(layer, (tuple(sequences[:2]), tuple(sequences[2:])), loss="mse", batch_size=32)
    key = task.structural_key(dict(p=0.1))
    assert key != task.structural_key(dict(p=0.2))
    lifted = ct.Bucket(task, 2)
    lifted.add(dict(p=0.1, seed=0))
    assert set(lifted.stack.settings) == {"dropout.p", "dropout1.p", "dropout2.p"}
    with pytest.raises(ValueError, match=r"module 'self_attn' \(MultiheadAttention\)\.dropout: 0\.1 vs 0\.2"):
        lifted.add(dict(p=0.2, seed=1))


class SelfRate(nn.Module):
    """Reads its rate from ``self`` in forward, through ``F.dropout``."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.inner, self.head = nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.dropout(torch.relu(self.inner(x)), self.p, self.training))


def test_a_rate_read_from_self_splits_by_rate_and_each_rates_bucket_is_fused():
    task = ct.Task(lambda c: SelfRate(c["p"]), DATA, batch_size=32, iteration_steps=5)
    assert task.structural_key(dict(p=0.2)) != task.structural_key(dict(p=0.4))
    bucket = ct.Bucket(task, 3)
    for i in range(3):
        bucket.add(dict(p=0.2, lr=0.05, seed=i))
    bucket.run_iteration()
    assert bucket.route_report()["rejected"] == {}  # it ran eager for everyone before


class HiddenRate(nn.Module):
    """Keeps its rate where no configuration looks (a dict): the probe's to catch."""

    def __init__(self, p: float):
        super().__init__()
        self.options = {"p": p}
        self.inner, self.head = nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.dropout(torch.relu(self.inner(x)), self.options["p"], self.training))


def test_a_rate_no_configuration_shows_is_still_caught_by_the_probe():
    task = ct.Task(lambda c: HiddenRate(c["p"]), DATA, batch_size=32, iteration_steps=5)
    assert task.structural_key(dict(p=0.0)) == task.structural_key(dict(p=0.6))
    bucket = ct.Bucket(task, 2)
    bucket.add(dict(p=0.0, lr=0.05, seed=0))
    bucket.add(dict(p=0.6, lr=0.05, seed=1))
    bucket.run_iteration()
    assert bucket.route == "eager" and bucket.route_reason is RouteReason.DISAGREES


def test_the_probes_deterministic_dropout_stays_in_the_probing_thread():
    import threading

    from chorus_tune.configuration import deterministic_dropout

    x = torch.ones(10_000)
    seen = {}
    with deterministic_dropout():
        seen["probe"] = F.dropout(x, 0.5, True)
        other = threading.Thread(target=lambda: seen.setdefault("other", F.dropout(x, 0.5, True)))
        other.start()
        other.join()
    assert torch.equal(seen["probe"], x * 0.5)
    assert 0.4 < (seen["other"] == 0).float().mean().item() < 0.6  # real dropout there
    assert 0.4 < (F.dropout(x, 0.5, True) == 0).float().mean().item() < 0.6  # and here, afterwards
