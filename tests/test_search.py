"""ChorusSearch driven directly, as Tune's SearchGenerator drives it (no Ray cluster)."""
import logging
import pickle
import threading

import pytest
from ray import tune
from ray.tune.experiment import Experiment
from ray.tune.search import ConcurrencyLimiter, Searcher
from ray.tune.search.basic_variant import BasicVariantGenerator

from chorus_tune.tune.search.search import ChorusSearch


class Recorder(Searcher):
    """An inner searcher that hands out numbered configs and records calls."""

    def __init__(self, widths, finish_after=None):
        super().__init__()
        self.widths = list(widths)
        self.finish_after = finish_after
        self.suggested, self.results, self.completed = [], [], []

    def suggest(self, trial_id):
        n = len(self.suggested)
        if self.finish_after is not None and n >= self.finish_after:
            return Searcher.FINISHED
        self.suggested.append(trial_id)
        return {"n": n, "width": self.widths[n % len(self.widths)]}

    def on_trial_result(self, trial_id, result):
        self.results.append((trial_id, result["m"]))

    def on_trial_complete(self, trial_id, result=None, error=False):
        self.completed.append((trial_id, error))

    def save(self, path):
        with open(path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, path):
        with open(path, "rb") as f:
            self.__dict__.update(pickle.load(f))


def _search(widths="A", num_samples=100, **kw):
    kw.setdefault("max_concurrent_trials", 100)
    s = ChorusSearch(Recorder(widths), **kw)
    s.set_search_properties("m", "max", {}, num_samples=num_samples)
    return s


def _suggest(s, ids):
    return {t: s.suggest(t) for t in ids}


def test_is_a_concurrency_limiter_whose_limit_is_the_trials_tune_runs_at_once():
    s = ChorusSearch(max_concurrent_trials=3)
    assert isinstance(s, ConcurrencyLimiter) and s.max_concurrent == 3


def test_by_default_tune_runs_one_trial_per_cpu_and_at_least_the_trials_that_clear_an_iteration():
    import os

    from chorus_tune.tune.search.search import CLEAR_AFTER

    # Under FIFO the trials in flight clear each iteration for speculation
    # (docs/design.md D4): fewer than CLEAR_AFTER would wait for trials to end.
    assert ChorusSearch().max_concurrent == max(CLEAR_AFTER, os.cpu_count() or 1)


def test_members_are_seated_to_clear_an_iteration_on_at_most_the_trials_in_flight_and_in_the_run():
    from chorus_tune.tune.search.search import clear_after

    assert clear_after(2, None) == 2 and clear_after(16, None) == 4
    assert clear_after(16, 3) == 3  # nor on more trials than the run has
    small = ChorusSearch(max_concurrent_trials=16)
    small.set_search_properties(None, None, {}, num_samples=3)
    assert clear_after(small.max_concurrent, small._budget) == 3


def test_no_more_trials_than_the_limit_run_at_once():
    s = _search(max_concurrent_trials=2)
    assert None not in _suggest(s, ["t0", "t1"]).values()
    assert s.suggest("t2") is None
    s.on_trial_complete("t0", {"m": 1})
    assert s.suggest("t3") is not None


def test_samples_param_space_exactly_like_tunes_default_generator():
    space = {"lr": tune.loguniform(1e-3, 1e-1), "wd": tune.grid_search([0.0, 1e-4, 1e-3]),
             "fixed": 3}
    default = BasicVariantGenerator(random_state=7)
    default.add_configurations([Experiment("x", run=lambda config: None, config=space,
                                           num_samples=2)])
    expected = []
    while (trial := default.next_trial()) is not None:
        expected.append(trial.config)
    s = ChorusSearch(random_state=7, max_concurrent_trials=10)
    s.set_search_properties(None, None, space, num_samples=6)
    got = [s.suggest(f"t{i}") for i in range(6)]
    assert got == expected
    assert s.suggest("t6") == Searcher.FINISHED


def test_without_param_space_every_trial_gets_an_empty_config():
    s = ChorusSearch(max_concurrent_trials=10)
    s.set_search_properties(None, None, {}, num_samples=3)
    assert [s.suggest(f"t{i}") for i in range(4)] == [{}, {}, {}, Searcher.FINISHED]


def test_suggestions_are_drawn_lookahead_ahead_of_tune_in_their_order():
    s = _search(widths="AB", lookahead=3)
    first = s.suggest("t0")
    assert first == {"n": 0, "width": "A"}
    assert len(s.unbound) == 3 and len(s.searcher.suggested) == 4


def test_the_own_sampler_looks_ahead_over_the_whole_run_up_to_a_bound():
    from chorus_tune.tune.search.search import SAMPLER_LOOKAHEAD_FACTOR, default_lookahead

    # Sampling param_space learns nothing from results: the whole run is seated ahead.
    assert default_lookahead(48, 128, learns_from_results=False) == 128
    assert default_lookahead(48, 10_000, learns_from_results=False) == SAMPLER_LOOKAHEAD_FACTOR * 48
    assert default_lookahead(48, 20, learns_from_results=False) == 48  # never below a fill
    assert default_lookahead(48, None, learns_from_results=False) == 48  # no num_samples known


def test_a_searcher_that_learns_from_results_is_asked_only_a_fill_ahead():
    from chorus_tune.tune.search.search import default_lookahead

    assert default_lookahead(48, 128, learns_from_results=True) == 48


def test_each_call_seats_at_most_a_fill_so_the_first_seat_stays_small():
    s = ChorusSearch(random_state=0, max_concurrent_trials=100)
    s.set_search_properties(None, None, {"x": tune.uniform(0, 1)}, num_samples=100)
    s.lookahead, s._seat_step = 100, 10  # as _size_for_cluster sets them: 100 samples, a fill of 10
    s.suggest("t0")  # draws a fill, binds one, tops up a fill more
    assert len(s.unbound) == 19
    s.suggest("t1")
    assert len(s.unbound) == 38  # a fill before its bind, a fill after


def test_drawing_ahead_stops_at_num_samples():
    s = _search(widths="A", num_samples=5, lookahead=2)
    out = [s.suggest(f"t{i}") for i in range(6)]
    assert out[5] == Searcher.FINISHED and all(isinstance(c, dict) for c in out[:5])
    assert len(s.searcher.suggested) == 5  # never pulls beyond the budget


def test_finishes_when_the_inner_searcher_does():
    s = ChorusSearch(Recorder("A", finish_after=2), max_concurrent_trials=10)
    s.set_search_properties("m", "max", {}, num_samples=10)
    assert [type(s.suggest(f"t{i}")) for i in range(3)] == [dict, dict, str]


def test_inner_searcher_sees_results_and_completions_under_its_own_ids():
    s = _search(widths="A")
    _suggest(s, ["tuneA", "tuneB"])
    s.on_trial_result("tuneB", {"m": 0.5})
    s.on_trial_complete("tuneA", {"m": 0.7})
    s.on_trial_complete("tuneB", {"m": 0.9}, error=True)
    inner = s.searcher
    ids = {s_id for s_id in inner.suggested[:2]}
    assert {i for i, _ in inner.results} <= ids and len(inner.results) == 1
    assert sorted(inner.completed) == sorted([(inner.suggested[0], False), (inner.suggested[1], True)])
    assert not ids & {"tuneA", "tuneB"}


def test_a_stopper_on_training_iteration_is_read_from_the_run():
    s = ChorusSearch(max_concurrent_trials=2)
    s.set_search_properties("m", "max", {}, num_samples=4, stop={"training_iteration": 7})
    assert s._stop_at == 7


def test_task_must_be_the_trainable_class():
    with pytest.raises(TypeError, match="ChorusTrainable class"):
        ChorusSearch(task=object())


def test_without_ray_nothing_is_seated():
    from chorus_tune.tune import ChorusTrainable

    from tune_support import digits_task

    s = ChorusSearch(task=ChorusTrainable.for_task(digits_task(), bucket_size=2), max_concurrent_trials=2)
    s.set_search_properties("m", "max", {"lr": 0.1}, num_samples=2)
    assert not s.seating and s.suggest("t0") == {"lr": 0.1}


def test_save_and_restore_keep_the_drawn_suggestions_and_id_maps(tmp_path):
    s = _search(widths="AB", max_concurrent_trials=2, lookahead=4)
    _suggest(s, ["t0", "t1"])
    released = [s._inner_id["t0"], s._inner_id["t1"]]
    path = str(tmp_path / "search.pkl")
    s.save(path)
    fresh = ChorusSearch(Recorder("AB"), max_concurrent_trials=2)
    fresh.restore(path)
    assert fresh.suggest("t2") is None               # two trials still run
    fresh.on_trial_complete("t0", {"m": 1})
    fresh.on_trial_complete("t1", {"m": 1})
    assert [c for c, _ in fresh.searcher.completed] == released
    assert fresh.suggest("t3") == {"n": 2, "width": "A"}  # from the restored suggestions


def test_state_leaves_the_trainable_and_inner_searcher_out():
    s = _search()
    state = s.get_state()
    assert "_trainable" not in state and "searcher" not in state
    pickle.dumps(state)


def test_with_a_random_state_member_seeds_follow_the_draw_order_not_the_random_ids():
    from chorus_tune.tune.values.options import member_seed

    first, second = ChorusSearch(random_state=3), ChorusSearch(random_state=3)
    other = ChorusSearch(random_state=4)

    def seeds(search):
        return [member_seed({}, search._seed_name(f"{search._prefix}{i:05d}")) for i in range(4)]

    assert first._prefix != second._prefix  # ids stay unique among searches sharing a pool
    assert seeds(first) == seeds(second) and seeds(first) != seeds(other)
    assert len(set(seeds(first))) == 4


GRID_16 = {"lr": tune.grid_search([0.01, 0.03, 0.1, 0.3]), "wd": tune.grid_search([0.0, 1e-4, 1e-3, 1e-2])}


@pytest.mark.parametrize("num_samples", [1, 15, 20])
def test_a_grid_that_num_samples_would_cut_short_is_refused_naming_both(num_samples):
    # With a Searcher, Tune creates num_samples trials in all (SearchGenerator),
    # so a grid of 16 under the default num_samples=1 would run 1 trial of 16.
    s = ChorusSearch(max_concurrent_trials=2)
    with pytest.raises(ValueError, match=rf"grid of 16 points.*num_samples={num_samples}.*num_samples=16"):
        s.set_search_properties("m", "max", GRID_16, num_samples=num_samples)


@pytest.mark.parametrize("num_samples", [16, 32])
def test_whole_passes_over_the_grid_run_every_point(num_samples):
    s = ChorusSearch(max_concurrent_trials=100)
    s.set_search_properties("m", "max", GRID_16, num_samples=num_samples)
    configs = [s.suggest(f"t{i}") for i in range(num_samples)]
    points = {(c["lr"], c["wd"]) for c in configs}
    assert len(points) == 16 and s.suggest("last") == Searcher.FINISHED


def test_an_endless_run_walks_the_grid_again_and_again():
    import sys

    s = ChorusSearch(max_concurrent_trials=100)
    s.set_search_properties("m", "max", GRID_16, num_samples=sys.maxsize)  # Tune's num_samples=-1
    assert len({(c["lr"], c["wd"]) for c in (s.suggest(f"t{i}") for i in range(20))}) == 16


def test_an_inner_searcher_owns_its_own_trial_count():
    # Only ChorusSearch's own sampler walks param_space's grid.
    s = ChorusSearch(Recorder("A"), max_concurrent_trials=2)
    s.set_search_properties("m", "max", GRID_16, num_samples=1)
    assert s.suggest("t0") == {"n": 0, "width": "A"}


def test_each_suggestion_hands_tune_s_next_trial_the_search_s_concurrency():
    # Tune creates the trial, and asks its trainable for resources, right after
    # suggest returns (SearchGenerator.create_trial_if_possible -> add_trial).
    from chorus_tune.tune.values import run_plan

    s = _search(max_concurrent_trials=3)
    run_plan.take_trial_concurrency()
    assert isinstance(s.suggest("t0"), dict) and run_plan.take_trial_concurrency() == 3
    assert run_plan.take_trial_concurrency() is None  # once per trial
    _suggest(s, ["t1", "t2"])
    run_plan.take_trial_concurrency()
    assert s.suggest("t3") is None and run_plan.take_trial_concurrency() is None  # no trial: nothing handed


def _width_mlp(config):
    from torch import nn

    return nn.Sequential(nn.Linear(64, int(config["l1"])), nn.ReLU(), nn.Linear(int(config["l1"]), 10))


def _width_trainable():
    import chorus_tune as ct
    from chorus_tune import ChorusTrainable
    from chorus_tune.examples_data import digits_split

    return ChorusTrainable.for_task(ct.Task(_width_mlp, digits_split), bucket_size=16)


def test_a_space_that_splits_into_structures_is_said_as_a_warning_when_the_run_starts(caplog):
    search = ChorusSearch(task=_width_trainable())
    space = {"l1": tune.grid_search([16, 32, 64, 128]), "lr": tune.grid_search([0.1, 0.01])}
    with caplog.at_level("INFO", logger="chorus_tune.tune.search.space_split"):
        search.set_search_properties("val_loss", "min", space, num_samples=8)
        search.split_report.join(60)
    (record,) = [r for r in caplog.records if "structures" in r.getMessage()]
    assert record.levelname == "WARNING"
    # 16, 32 and 64 pad together within the width rule (docs/design.md D9); 128 would cost 16 8x its own.
    assert record.getMessage() == (
        "ChorusSearch: 8 trials fall into 2 structures (l1 takes 4 values; their widths would cost more padded "
        "together than the width rule allows (chorus_tune/width_rule.py)): "
        "the largest structure holds 6 of them, the smallest 2; each structure fuses only within itself")


def test_the_split_is_read_beside_the_run_not_before_its_first_trial(monkeypatch):
    # Reading it may load the task's data (to price padded widths): Tune must not wait for that.
    from chorus_tune.tune.search import space_split

    started, release = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        started.set()
        release.wait(30)

    monkeypatch.setattr(space_split, "say_how_it_splits", slow)
    search = ChorusSearch(task=_width_trainable())
    search.set_search_properties("val_loss", "min", {"l1": tune.grid_search([16, 32]), "lr": 0.1}, num_samples=2)
    assert started.wait(30) and search.split_report.is_alive()  # set_search_properties returned meanwhile
    release.set()
    search.split_report.join(30)


def test_a_search_reading_its_split_still_pickles_and_saves_its_state(tmp_path):
    search = ChorusSearch(task=_width_trainable())
    search.set_search_properties("val_loss", "min", {"l1": tune.grid_search([16, 32]), "lr": 0.1}, num_samples=2)
    assert pickle.loads(pickle.dumps(search)).split_report is None  # Tune pickles it with the run's state
    search.save(str(tmp_path / "search.pkl"))
    search.split_report.join(60)


def test_a_space_of_one_structure_is_said_to_fuse_at_info():
    search = ChorusSearch(task=_width_trainable())
    with pytest.MonkeyPatch.context() as mp:
        logged = []
        mp.setattr("chorus_tune.tune.search.space_split.logger.log",
                   lambda level, fmt, *a: logged.append((level, fmt % a)))
        search.set_search_properties("val_loss", "min", {"l1": 32, "lr": tune.grid_search([0.1, 0.01])},
                                     num_samples=2)
        search.split_report.join(60)
    assert logged == [(logging.INFO, "ChorusSearch: 2 trials share one structure: they fuse in buckets of up to 16")]
