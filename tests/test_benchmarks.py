"""The side-by-side benchmark: its Ray-free logic here, and one tiny sweep end to end.

Timings are never asserted (shared machines are noisy): only which runs happen
in which order, what each way is asked for, how the report is summarised, and
that every way ran every trial and the report holds the fields docs/benchmarks.md
quotes. Only the end-to-end test starts Ray (``ray`` marker: `make test-core`
leaves it out).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
from collections import Counter

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import vs_tune  # noqa: E402  (benchmarks/ is not a package)
from vs_tune import Outcome, RowSpec  # noqa: E402

import workloads  # noqa: E402


def _args(**over) -> argparse.Namespace:
    base = dict(workload="synth-mlp64", n_train=None, n_val=None, trials=32, rows=None, epochs=10, asha_epochs=None,
                bucket_size="16", scheduler="asha", repeats=3, warmup=1, ways="plain,chorus,fused",
                max_iterations_column=False, gpu_fraction=None)
    return argparse.Namespace(**{**base, **over})


# ----- which runs, in which order -----------------------------------------------------------------
def test_the_order_rotates_so_no_way_always_goes_first():
    assert vs_tune.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert vs_tune.rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert vs_tune.rotated(["a", "b", "c"], 5) == ["c", "a", "b"]
    rows = [RowSpec("w", "fifo", 10, 16)]
    runs = vs_tune.schedule(rows, ["plain", "chorus", "fused"], repeats=3, warmup=0)
    firsts = [runs[3 * r][2] for r in range(3)]
    assert sorted(firsts) == ["chorus", "fused", "plain"]  # each way leads one repeat


def test_warm_ups_come_first_once_per_way_and_workload_then_every_row_repeats_interleaved():
    rows = [RowSpec("w1", "fifo", 10, 16), RowSpec("w1", "asha", 10, 16), RowSpec("w2", "fifo", 10, 16)]
    ways = ["plain", "chorus"]
    runs = vs_tune.schedule(rows, ways, repeats=3, warmup=1)
    warm = [(i, w) for r, i, w in runs if r == 0]
    assert runs[:len(warm)] == [(0, i, w) for i, w in warm]  # all warm-ups before any timed run
    assert sorted(warm) == [(0, "chorus"), (0, "plain"), (2, "chorus"), (2, "plain")]  # each workload's first row
    timed = Counter((i, w) for r, i, w in runs if r > 0)
    assert timed == {(i, w): 3 for i in range(3) for w in ways}
    # Interleaved: all of repeat 1 before any of repeat 2.
    repeats = [r for r, _, _ in runs if r > 0]
    assert repeats == sorted(repeats)


def test_the_max_iterations_column_runs_on_fifo_rows_only():
    rows = [RowSpec("w", "fifo", 10, 16), RowSpec("w", "asha", 10, 16)]
    runs = vs_tune.schedule(rows, ["chorus", "chorus-maxit"], repeats=2, warmup=0)
    assert Counter((i, w) for _, i, w in runs) == {(0, "chorus"): 2, (0, "chorus-maxit"): 2, (1, "chorus"): 2}


def test_rows_from_a_list_or_from_the_matrix():
    rows = vs_tune.parse_rows("fifo:10:16, stock-asha:10:32", ["synth-mlp64", "synth-mixed"])
    assert rows == [RowSpec("synth-mlp64", "fifo", 10, 16), RowSpec("synth-mlp64", "stock-asha", 10, 32),
                    RowSpec("synth-mixed", "fifo", 10, 16), RowSpec("synth-mixed", "stock-asha", 10, 32)]
    for bad in ("fifo:10", "median:10:16", "fifo:0:16"):
        with pytest.raises(ValueError):
            vs_tune.parse_rows(bad, ["w"])
    matrix = vs_tune.matrix_rows(["w"], ["fifo", "asha"], [16, 32], epochs=40, asha_epochs=10)
    assert [(r.scheduler, r.epochs, r.bucket_size) for r in matrix] == [
        ("fifo", 40, 16), ("fifo", 40, 32), ("asha", 10, 16), ("asha", 10, 32)]


def test_the_plan_expands_plain_over_card_shares_and_adds_the_max_iterations_column():
    plan = vs_tune.plan_from(_args(rows="fifo:10:16", gpu_fraction="0.25,0.125,0.0625", max_iterations_column=True))
    assert plan.ways == ["plain@0.25", "plain@0.125", "plain@0.0625", "chorus", "chorus-maxit", "fused"]
    assert vs_tune.plan_from(_args(gpu_fraction="0.125")).ways == ["plain", "chorus", "fused"]
    args = _args(gpu_fraction="0.25,0.125")
    vs_tune.plan_from(args)
    assert vs_tune.way_args(args, "plain@0.125").gpu_fraction == 0.125
    assert vs_tune.way_args(args, "chorus").gpu_fraction == 0.25
    for bad in (dict(gpu_fraction="0"), dict(ways="plain,nope"), dict(scheduler="hyperband"), dict(repeats=0)):
        with pytest.raises(ValueError):
            vs_tune.plan_from(_args(**bad))


def test_each_side_gets_the_rows_scheduler():
    from ray.tune.schedulers import ASHAScheduler

    from chorus_tune import ChorusASHA

    assert vs_tune.scheduler_for("plain", "fifo", 10, 4) is None
    assert vs_tune.scheduler_for("chorus", "fifo", 10, 4) is None
    assert type(vs_tune.scheduler_for("plain", "asha", 10, 4)) is ASHAScheduler
    assert type(vs_tune.scheduler_for("chorus", "asha", 10, 4)) is ChorusASHA
    for kind in ("plain", "chorus"):
        stock = vs_tune.scheduler_for(kind, "stock-asha", 10, 4)
        assert type(stock) is ASHAScheduler and stock._max_t == 10 and stock._reduction_factor == 4


# ----- between runs -------------------------------------------------------------------------------
def test_the_cluster_is_free_when_every_held_resource_is_back_and_every_bucket_closed():
    total = {"CPU": 16.0, "GPU": 1.0, "memory": 8e9, "object_store_memory": 2e9, "node:10.0.0.1": 1.0}
    assert vs_tune.resources_free(total, {**total, "memory": 1e9, "object_store_memory": 1.0})
    assert not vs_tune.resources_free(total, {**total, "GPU": 0.875})  # a trial's 1/8 card is still held
    assert not vs_tune.resources_free(total, {k: v for k, v in total.items() if k != "GPU"})  # all GPU taken
    assert vs_tune.buckets_closed({}) and vs_tune.buckets_closed({"b1": {"closed": True}})
    assert not vs_tune.buckets_closed({"b1": {"closed": True}, "b2": {"model": "mlp"}})


def test_waste_per_bucket_is_the_larger_of_what_results_said_and_what_the_pool_reads_after():
    assert vs_tune.wasted_total({"b1": 2, "b2": 0}, {"b2": {"wasted": 3}, "b3": {"wasted": None}}) == 5
    assert vs_tune.wasted_total({}, {}) == 0


# ----- the ceiling (c) ----------------------------------------------------------------------------
def test_the_ceiling_gets_the_threads_a_bucket_of_b_gets():
    assert vs_tune.fused_threads("cpu", parallel=2, cpus=2) == 1
    assert vs_tune.fused_threads("cpu", parallel=1, cpus=2) == 2  # a lone bucket shares every core
    assert vs_tune.fused_threads("cpu", parallel=3, cpus=16) == 5
    assert vs_tune.fused_threads("cuda", parallel=1, cpus=16) == 1  # one CPU per bucket on a GPU


def test_the_ceiling_seats_a_width_sweep_by_sharing_key_as_the_pool_does():
    sw = vs_tune.make_sweep("synth-mixed", 32)
    task = vs_tune.make_task("synth-mixed", 64)
    blocks = vs_tune.fused_blocks(task, sw.configs, 16)
    # widths 64 and 128 pad into one stack (docs/design.md D9): two full blocks
    assert [len(b) for b in blocks] == [16, 16] and {c["width"] for c in blocks[0]} == {64, 128}
    widths = vs_tune.make_sweep("synth-widths", 32)
    blocks = vs_tune.fused_blocks(vs_tune.make_task("synth-widths", 64), widths.configs, 16)
    # 32 against 256 is beyond the width rule's 4x: they split
    assert sum(len(b) for b in blocks) == 32
    assert not any({32, 256} <= {c["width"] for c in b} for b in blocks)


# ----- issue 19's workload ------------------------------------------------------------------------
def test_synth_mixed_draws_the_same_configs_as_tunes_default_generator():
    from ray.tune.experiment import Experiment
    from ray.tune.search import BasicVariantGenerator

    sw = vs_tune.make_sweep("synth-mixed", 32)
    assert sw.random_state == 0 and sw.num_samples == 32 and len(sw.configs) == 32
    assert {c["width"] for c in sw.configs} == {64, 128}
    assert all(0 <= c["dropout"] <= 0.5 and 3e-3 <= c["lr"] <= 0.3 and 1e-5 <= c["weight_decay"] <= 1e-2
               for c in sw.configs)
    assert sw.configs == vs_tune.make_sweep("synth-mixed", 32).configs  # fixed from run to run
    gen = BasicVariantGenerator(random_state=0)  # what plain Tune's side is given
    gen.add_configurations([Experiment("x", lambda config: None, config=workloads.mixed_space(), num_samples=32)])
    drawn = [t.config for t in iter(gen.next_trial, None)]
    keys = list(sw.configs[0])
    assert vs_tune.configs_digest(drawn, keys) == vs_tune.configs_digest(sw.configs, keys)
    grid = vs_tune.make_sweep("synth-mlp64", 32)
    assert grid.random_state is None and grid.num_samples == 1 and len(grid.configs) == 32
    assert len({c["lr"] for c in grid.configs}) == 8  # 8 learning rates x 4 weight decays
    # The GPU check's 64 trials: 16 learning rates x 4 weight decays (docs/benchmarks.md says so).
    assert len({c["lr"] for c in vs_tune.make_sweep("tab-mlp2", 64).configs}) == 16


def test_the_width_sweep_is_one_pass_of_its_grid_in_plain_tunes_order():
    from ray.tune.experiment import Experiment
    from ray.tune.search import BasicVariantGenerator

    sw = vs_tune.make_sweep("synth-widths", 999)  # a grid: one pass, whatever --trials says
    assert sw.num_samples == 1 and len(sw.configs) == 32
    assert sorted({c["width"] for c in sw.configs}) == [32, 64, 128, 256]
    gen = BasicVariantGenerator()  # plain Tune's side: its default generator, num_samples 1
    gen.add_configurations([Experiment("x", lambda config: None, config=workloads.width_grid(), num_samples=1)])
    drawn = [t.config for t in iter(gen.next_trial, None)]
    assert drawn == sw.configs  # the same trials, in the order ChorusSearch seats them
    model, _ = workloads.workload("synth-widths")
    assert model(sw.configs[-1]).fc2.in_features == sw.configs[-1]["width"]


def test_the_tutorial_space_builds_the_tutorials_net_at_its_widths():
    import torch

    sw = vs_tune.make_sweep("tutorial-cnn", 16)
    assert sw.random_state == 0 and len(sw.configs) == 16
    assert {c["batch_size"] for c in sw.configs} <= {2, 4, 8, 16}
    model, _ = workloads.workload("tutorial-cnn", n_train=8, n_val=8)
    net = model({"l1": 32, "l2": 8})
    assert (net.fc1.out_features, net.fc2.out_features) == (32, 8)
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_synth_mixed_builds_its_width_and_dropout_from_the_config():
    import torch
    from torch import nn

    model, _ = workloads.workload("synth-mixed")
    net = model({"width": 128, "dropout": 0.3})
    (drop,) = [m for m in net if isinstance(m, nn.Dropout)]
    assert drop.p == 0.3 and net[0].out_features == 128
    assert net(torch.zeros(5, 64)).shape == (5, 10)


# ----- the report ---------------------------------------------------------------------------------
def _outcome(way: str, wall: float, **kw) -> Outcome:
    return Outcome(way, wall, trials=32, best=kw.pop("best", 0.85), reached_max_t=32, **kw)


def test_the_summary_takes_plain_at_its_best_share_and_reports_per_member_epoch():
    outcomes = {
        "plain@0.25": [_outcome("plain@0.25", 40.0, member_epochs=320),
                       _outcome("plain@0.25", 44.0, member_epochs=320)],
        "plain@0.125": [_outcome("plain@0.125", 30.0, member_epochs=320, first_result_s=3.0)],
        "chorus": [_outcome("chorus", 15.0, member_epochs=330, wasted=10, first_result_s=6.0, mean_live=12.5,
                            mean_rows=13.0)],
        "fused": [_outcome("fused", 10.0, member_epochs=320, first_result_s=2.0)],
    }
    row = vs_tune.summarise({"trials": 32}, outcomes)
    assert row["mean_live"] == {"chorus": 12.5} and row["mean_rows"] == {"chorus": 13.0}
    assert row["plain_way"] == "plain@0.125" and row["plain_over_chorus"] == pytest.approx(2.0)
    assert row["median_wall_s"]["plain@0.25"] == pytest.approx(42.0)
    assert row["plain_over_chorus_per_member_epoch"] == pytest.approx((30 / 320) / (15 / 330))
    assert row["chorus_over_fused"] == pytest.approx(1.5)
    assert row["chorus_minus_fused"] == pytest.approx({"total_s": 5.0, "startup_s": 4.0, "rest_s": 1.0})
    assert row["wasted"] == {"chorus": 10} and row["member_epochs"]["chorus"] == 330
    assert row["trials_per_min"]["chorus"] == pytest.approx(60 * 32 / 15) and "best_gap_caveat" not in row
    table = vs_tune.markdown_table([dict(row, workload="w", bucket_size=16, epochs=10, scheduler="fifo")])
    head = "| FIFO, 10 epochs, w | 32 | 16 | 30.0 s (0.125 card) | 15.0 s | 10.0 s | 2.00× | 94 ms / 45 ms |"
    assert head in table, table
    assert "| 12.5 / 13.0 | 320 / 330 / 320 (10) | 3.0 s / 6.0 s |" in table, table


def test_a_run_cut_by_its_budget_reports_no_rate_and_its_gap_carries_a_caveat():
    outcomes = {"plain": [_outcome("plain", 60.0, budget_hit=True, best=0.80)],
                "chorus": [_outcome("chorus", 20.0, best=0.85)]}
    row = vs_tune.summarise({"trials": 32}, outcomes)
    assert row["trials_per_min"]["plain"] is None and row["trials_per_min"]["chorus"] is not None
    assert outcomes["plain"][0].trials_per_min is None
    assert row["best_plain_minus_chorus"] == pytest.approx(-0.05) and "budget" in row["best_gap_caveat"]
    table = vs_tune.markdown_table([dict(row, workload="w", bucket_size=16, epochs=10, scheduler="asha")])
    assert "60.0 s+" in table and "(cut: see JSON)" in table and "hit the time budget" in table


def test_configs_digest_sees_the_multiset_not_the_order():
    a, b = {"lr": 0.1, "wd": 0.0}, {"lr": 0.2, "wd": 0.0}
    assert vs_tune.configs_digest([a, b], ["lr", "wd"]) == vs_tune.configs_digest([b, a], ["lr", "wd"])
    assert vs_tune.configs_digest([a, b], ["lr", "wd"]) != vs_tune.configs_digest([a, a], ["lr", "wd"])


# ----- end to end ---------------------------------------------------------------------------------
def test_vs_tune_runs_every_way_and_writes_json_and_plot(tmp_path, script_ray_env):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1",
           **script_ray_env}  # the suite's Ray (conftest.py)
    done = subprocess.run(
        # 2 trials: every way runs, with the fewest trial processes (each imports ray.tune: 2 CPU-s here).
        [sys.executable, str(BENCHMARKS / "vs_tune.py"), "--workload", "digits-mlp64", "--trials", "2",
         "--epochs", "2", "--bucket-size", "2", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path),
         "--name", "smoke"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").stat().st_size > 0 and "| sweep |" in (tmp_path / "smoke.md").read_text()
    (row,) = report["rows"]
    assert set(row["median_wall_s"]) == {"plain", "chorus", "lockstep", "fused"}
    for way, runs in row["runs"].items():
        assert [r["trials"] for r in runs] == [2], way
        assert not math.isnan(row["best"][way]), way
        assert runs[0]["member_epochs"] > 0 and runs[0]["settled"], way
    assert row["same_configs"]
    assert row["plain_over_chorus"] > 0 and row["chorus_over_fused"] > 0 and row["plain_over_lockstep"] > 0
