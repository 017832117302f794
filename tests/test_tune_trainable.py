"""ChorusTrainable through tune.Tuner: fidelity, result fields, placement, checkpoints, errors."""
from __future__ import annotations

import os
import time

import pytest
import ray
import torch
from ray import tune

from chorus_tune import reference
from chorus_tune.tune import ChorusSearch, ChorusTrainable, bucket_stats, load_model, retire_trial
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values.protocol import NAMESPACE

from tune_support import digits_task, history, imported, mlp, picky_mlp, run_config

pytestmark = pytest.mark.usefixtures("local_ray")

# Each Tune run costs seconds of Tune's own start-up on this 2-core machine
# (a trial actor starts in about 2.5 s): the tests that only read a plain sweep
# share one.
OWN_MEMBER_LRS = (0.05, 0.1, 0.2, 5.0)  # picky_mlp refuses lr=5.0


def _fit(trainable, param_space, tmp_path, iterations, **tune_kwargs):
    tuner = tune.Tuner(trainable, param_space=param_space,
                       tune_config=tune.TuneConfig(metric="val_loss", mode="min", **tune_kwargs),
                       run_config=run_config(tmp_path, iterations))
    return tuner.fit()


def _processes(prefix: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(prefix.encode()):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


class _Inspect(tune.Callback):
    """At the first result: which trial and bucket processes have torch mapped
    (``None`` where there is no /proc), and which of ``ray.tune``, ``sklearn``
    the bucket that sent it has imported."""

    torch_maps = None
    bucket_imports = None

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if self.bucket_imports is not None:
            return
        if os.path.exists("/proc/self/maps"):
            self.torch_maps = ({p: _maps_torch(p) for p in _processes("ray::ChorusTrainable")},
                               {p: _maps_torch(p) for p in _processes("ray::ChorusBucket")})
        bucket = ray.get_actor(result[rk.BUCKET], namespace=NAMESPACE)
        self.bucket_imports = ray.get(bucket.__ray_call__.remote(imported, ("ray.tune", "sklearn")))


@pytest.fixture(scope="module")
def own_member_sweep(local_ray, tmp_path_factory):
    """Tune's default search (each trial builds a member of its own), no seed
    in the config, one config the model factory refuses; 2 iterations."""
    task = digits_task(model=picky_mlp)
    trainable = ChorusTrainable.for_task(task, bucket_size=4)
    inspect = _Inspect()
    tuner = tune.Tuner(trainable, param_space={"lr": tune.grid_search(list(OWN_MEMBER_LRS))},
                       tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
                       run_config=run_config(tmp_path_factory.mktemp("own"), 2, callbacks=[inspect]))
    return task, tuner.fit(), inspect


def _finished(results):
    return [r for r in results if r.error is None]


def test_grid_matches_reference_per_trial_and_iteration(tmp_path):
    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=8)
    space = {"lr": tune.grid_search([0.02, 0.05, 0.1, 0.3]), "weight_decay": tune.grid_search([0.0, 1e-3]),
             "momentum": 0.5, "seed": 7}
    results = _fit(trainable, space, tmp_path, iterations=3, num_samples=8, reuse_actors=True,
                   search_alg=ChorusSearch(task=trainable))
    assert len(results) == 8 and not results.errors
    for result in results:
        config = {k: result.config[k] for k in ("lr", "weight_decay", "momentum", "seed")}
        expected, _ = reference.train(task, config, seed=7, iterations=3)
        got = history(result)
        assert len(got) == 3
        torch.testing.assert_close(torch.tensor(got), torch.tensor([h["val_loss"] for h in expected]),
                                   rtol=1e-5, atol=1e-6)
    # The eight trials were fused: seated together in one bucket, they trained
    # together as far as run_ahead let them go without their trials.
    assert len({r.metrics["chorus/bucket"] for r in results}) == 1
    first_two = {live for r in results for live in r.metrics_dataframe.sort_values("training_iteration")
                 ["chorus/live"].iloc[:2]}
    assert first_two == {8}


class _CpusInUse(tune.Callback):
    """Ray's view of the CPUs in use at each result."""

    def __init__(self):
        self.used = []

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.used.append(ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0))


def test_under_chorus_search_ray_sees_the_cores_the_buckets_compute_on_in_use(tmp_path):
    # Issue 40 item 5: the tutorial's shape showed 0.125 of 2 CPUs in use
    # while the buckets computed on both cores. ChorusSearch runs 2 trials at
    # once here (one per CPU); their tokens now hold the 2 cores.
    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=4)
    cpus = _CpusInUse()
    results = tune.Tuner(
        trainable, param_space={"lr": tune.grid_search([0.05, 0.1, 0.2, 0.3])},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=4, reuse_actors=True,
                                    search_alg=ChorusSearch(task=trainable)),
        run_config=run_config(tmp_path, 2, callbacks=[cpus])).fit()
    assert not results.errors
    assert max(cpus.used) == pytest.approx(ray.cluster_resources()["CPU"]), cpus.used


def test_structures_get_separate_buckets_and_the_first_fills_to_capacity(tmp_path):
    trainable = ChorusTrainable.for_task(digits_task(), bucket_size=3, max_buckets=4)
    # 16 and 256: too far apart to pad together (docs/design.md D9), so two structures.
    space = {"width": tune.grid_search([16, 256]), "lr": tune.grid_search([0.05, 0.1, 0.2, 0.3])}
    results = _fit(trainable, space, tmp_path, iterations=2, num_samples=8, reuse_actors=True,
                   search_alg=ChorusSearch(task=trainable))
    assert not results.errors
    width_of = {r.metrics["chorus/member"]: r.config["width"] for r in results}
    ours = [(name, s) for name, s in bucket_stats().items() if set(s["trials"]) & set(width_of)]
    ours.sort(key=lambda item: int(item[0].rsplit("-", 1)[1]))  # in the order they were opened
    first_of_width = {}
    for _name, s in ours:
        widths = {width_of[t] for t in s["trials"]}
        assert len(widths) == 1  # one structure per bucket
        first_of_width.setdefault(widths.pop(), s)
    assert set(first_of_width) == {16, 256}
    # Members seated while the first bucket of their width had room went into it.
    assert all(len(s["trials"]) >= 3 for s in first_of_width.values())
    assert max(r.metrics["chorus/live"] for r in results) <= 3


def test_trials_of_widths_within_the_width_rule_share_one_padded_bucket_and_follow_their_references(tmp_path):
    # docs/design.md D9: the MLP at width 20 padded to 64 costs 3.2x its own parameters, within 4x.
    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=8)
    space = {"width": tune.grid_search([20, 32, 48, 64]), "lr": tune.grid_search([0.05, 0.1]), "seed": 3}
    results = _fit(trainable, space, tmp_path, iterations=2, num_samples=8, reuse_actors=True,
                   search_alg=ChorusSearch(task=trainable))
    assert len(results) == 8 and not results.errors
    assert len({r.metrics["chorus/bucket"] for r in results}) == 1
    for result in results:
        config = {k: result.config[k] for k in ("width", "lr", "seed")}
        expected, _ = reference.train(task, config, iterations=2)
        torch.testing.assert_close(torch.tensor(history(result)), torch.tensor([h["val_loss"] for h in expected]),
                                   rtol=1e-4, atol=1e-6)


def test_reuse_actors_resets_into_new_members(tmp_path):
    task = digits_task()
    trainable = ChorusTrainable.for_task(task, bucket_size=2, max_buckets=1)
    tuner = tune.Tuner(trainable, param_space={"lr": tune.grid_search([0.05, 0.1, 0.2, 0.3]), "seed": 1},
                       tune_config=tune.TuneConfig(metric="val_loss", mode="min", reuse_actors=True),
                       run_config=run_config(tmp_path, 2))
    results = tuner.fit()
    assert not results.errors and len(results) == 4
    pids = {r.metrics["pid"] for r in results}
    assert len(pids) < 4  # some actor served two trials
    for r in results:
        expected, _ = reference.train(task, {"lr": r.config["lr"], "seed": 1}, seed=1, iterations=2)
        assert history(r) == pytest.approx([h["val_loss"] for h in expected], rel=1e-5)


class _RetireTwice(tune.Callback):
    """At the lr=0.3 trial's first result: its bucket's members before
    ``retire_trial`` of it, after it, after it again, and after
    ``retire_trial`` of a trial that never joined."""

    def __init__(self):
        self.member, self.members = None, []

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if trial.config["lr"] != 0.3 or self.member is not None:
            return
        self.member, bucket = result[rk.MEMBER], result[rk.BUCKET]
        self.members.append(bucket_stats()[bucket]["members"])
        for trial_id in (trial.trial_id, trial.trial_id, "never-joined-00000"):
            retire_trial(trial_id)
            self.members.append(bucket_stats()[bucket]["members"])


def test_retire_trial_frees_the_slot_once_and_a_repeat_or_an_unknown_trial_changes_nothing(tmp_path):
    task = digits_task()
    # run_ahead=0, speculate=False: no member trains to its end before its
    # trial reads, so the retired one is still in its bucket when retired.
    trainable = ChorusTrainable.for_task(task, bucket_size=2, run_ahead=0, speculate=False)
    spy = _RetireTwice()
    results = tune.Tuner(
        trainable, param_space={"lr": tune.grid_search([0.1, 0.3]), "seed": 4},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0, callbacks=[spy],
                                  stop=lambda trial_id, result: result["training_iteration"]
                                  >= (1 if result["config"]["lr"] == 0.3 else 2))).fit()
    assert not results.errors
    before, retired, again, unknown = spy.members
    assert spy.member in before
    assert retired == [m for m in before if m != spy.member]  # its slot freed, the others kept
    assert again == retired and unknown == retired
    mate = next(r for r in results if r.config["lr"] == 0.1)  # trains on, on its own trajectory
    expected, _ = reference.train(task, {"lr": 0.1, "seed": 4}, seed=4, iterations=2)
    assert history(mate) == pytest.approx([h["val_loss"] for h in expected], rel=1e-5)


class _CompactionBeforeIteration(tune.Callback):
    """Holds Tune at the survivor's result ``iteration`` until its bucket has
    compacted (at most ``timeout_s``): the other trials leave from their own
    actors, and on a fast machine the survivor could finish first."""

    def __init__(self, iteration: int, timeout_s: float = 30.0):
        self.iteration, self.timeout_s = iteration, timeout_s

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result["config"]["epochs"] != 8 or result["training_iteration"] != self.iteration:
            return
        deadline = time.monotonic() + self.timeout_s
        while bucket_stats()[result[rk.BUCKET]].get("compactions", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)


def test_bucket_compacts_as_members_finish_and_the_survivor_stays_on_its_trajectory(tmp_path):
    task = digits_task()
    # run_ahead=0: the survivor trains on only as its trial asks, so the bucket
    # compacts (after the others leave) before the survivor is done. ChorusSearch
    # seats the four members together: with members of their own, the survivor
    # started in the full bucket only if its trial actor started before the
    # first ones had finished (a race it lost once the first trial no longer
    # waited for an earlier test's idle bucket).
    trainable = ChorusTrainable.for_task(task, bucket_size=4, compact_after_s=0.0, run_ahead=0)
    tuner = tune.Tuner(
        trainable, param_space={"epochs": tune.grid_search([1, 1, 2, 8]), "lr": 0.1, "seed": 6},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=4,
                                    search_alg=ChorusSearch(task=trainable, max_concurrent_trials=4)),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0, callbacks=[_CompactionBeforeIteration(4)],
                                  stop=lambda trial_id, result: result["training_iteration"]
                                  >= result["config"]["epochs"]))
    results = tuner.fit()
    assert not results.errors
    survivor = next(r for r in results if r.config["epochs"] == 8)
    frame = survivor.metrics_dataframe.sort_values("training_iteration")
    # The bucket compacted while the survivor trained in it. (Not "its first
    # row at capacity 4": at run_ahead=0 the survivor's first step waits for
    # its trial to ask, and a CI run's trial asked just after the first
    # iteration began, by when the two 1-epoch members had finished.)
    assert frame["chorus/capacity"].iloc[0] > frame["chorus/capacity"].iloc[-1]
    stats = bucket_stats()[survivor.metrics["chorus/bucket"]]
    assert stats["capacity"] < 4 and stats["compactions"] >= 1
    expected, _ = reference.train(task, {"lr": 0.1, "seed": 6, "epochs": 8}, seed=6, iterations=8)
    assert history(survivor) == pytest.approx([h["val_loss"] for h in expected], rel=1e-5)


def test_every_result_carries_the_chorus_fields(own_member_sweep):
    _, results, _ = own_member_sweep
    for result in _finished(results):
        frame = result.metrics_dataframe
        for key in (rk.MEMBER, rk.BUCKET, rk.SLOT, rk.ROUTE, rk.LIVE, rk.CAPACITY, rk.SEED, rk.COMPACTIONS,
                    rk.AHEAD, rk.WASTED):
            assert key in frame, key
        m = result.metrics
        assert m[rk.MEMBER] == m["trial_id"]  # no ChorusSearch: each trial has a member of its own
        assert m[rk.BUCKET].startswith("chorus-bucket-") and m[rk.ROUTE] in ("vmap", "batched", "eager", "unfused")
        assert isinstance(m[rk.SLOT], int) and isinstance(m[rk.SEED], int)
        assert 1 <= m[rk.LIVE] <= 3 and m[rk.CAPACITY] == 4
        # O(K) per result: nothing names the bucket-mates.
        assert not any(k.startswith("chorus/cohort") and k not in (rk.COHORT_SIZE, rk.COHORT_RANK) for k in frame)


def test_seed_without_config_seed_is_derived_from_trial_id_and_reproducible(own_member_sweep):
    task, results, _ = own_member_sweep
    finished = _finished(results)
    seeds = {r.metrics["chorus/seed"] for r in finished}
    assert len(seeds) == len(finished) == 3
    for result in finished:
        expected, _ = reference.train(task, {"lr": result.config["lr"]}, seed=result.metrics["chorus/seed"],
                                      iterations=2)
        assert history(result) == pytest.approx([h["val_loss"] for h in expected], rel=1e-5)


def test_load_model_returns_users_module_with_trained_weights(own_member_sweep):
    task, results, _ = own_member_sweep
    best = results.get_best_result()
    model = load_model(best.checkpoint)
    assert type(model) is type(mlp({}))
    seed = best.metrics["chorus/seed"]
    _, ref_model = reference.train(task, {"lr": best.config["lr"]}, seed=seed, iterations=2)
    for (name, p), (_, q) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert not model.training


def test_every_checkpoint_holds_weights_that_load_without_running_code(own_member_sweep):
    from chorus_tune.tune import load_weights  # issue 40: new, so imported here, not with the module

    task, results, _ = own_member_sweep
    best = results.get_best_result()
    _, ref_model = reference.train(task, {"lr": best.config["lr"]}, seed=best.metrics["chorus/seed"], iterations=2)
    with best.checkpoint.as_directory() as checkpoint_dir:
        # The PyTorch tutorial's own loading code.
        tutorial = torch.load(os.path.join(checkpoint_dir, "weights.pt"), weights_only=True)
    filled = load_model(best.checkpoint, model=mlp(best.config))
    for name, expected in ref_model.state_dict().items():
        torch.testing.assert_close(tutorial[name], expected, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(load_weights(best.checkpoint)[name], tutorial[name], rtol=0, atol=0)
        torch.testing.assert_close(filled.state_dict()[name], tutorial[name], rtol=0, atol=0)
    for result in _finished(results):
        for checkpoint, _ in result.best_checkpoints:
            assert os.path.exists(os.path.join(checkpoint.path, "weights.pt")), checkpoint.path


def test_model_factory_error_fails_only_that_trial_with_its_message(own_member_sweep):
    _, results, _ = own_member_sweep
    errors = [r for r in results if r.error is not None]
    assert len(errors) == 1 and errors[0].config["lr"] == 5.0
    assert "picky_mlp refuses lr=5.0" in str(errors[0].error)
    finished = _finished(results)
    assert len(finished) == 3 and all(r.metrics["training_iteration"] == 2 for r in finished)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc")
def test_trial_actors_load_no_torch_while_the_bucket_does(own_member_sweep):
    trials, buckets = own_member_sweep[2].torch_maps
    assert trials and not any(trials.values())
    assert buckets and all(buckets.values())


def test_a_bucket_process_imports_neither_ray_tune_nor_scikit_learn(own_member_sweep):
    # Trials give the bucket their actor's id, not their handle (whose class
    # would import ray.tune there), and the tests' data loader reads chorus_tune's copy of digits.
    assert own_member_sweep[2].bucket_imports == {"ray.tune": False, "sklearn": False}
