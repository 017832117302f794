"""ChorusSearch driven directly, as Tune's SearchGenerator drives it (no Ray cluster)."""
import pickle

import pytest
from ray import tune
from ray.tune.experiment import Experiment
from ray.tune.search import ConcurrencyLimiter, Searcher
from ray.tune.search.basic_variant import BasicVariantGenerator

from chorus_tune.tune.search import ChorusSearch


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


def _by_width(config):
    return config["width"]


def _search(widths="A", bucket_size=2, max_buckets=None, num_samples=100, **kw):
    s = ChorusSearch(Recorder(widths), bucket_size=bucket_size, max_buckets=max_buckets,
                     key=_by_width, **kw)
    s.set_search_properties("m", "max", {}, num_samples=num_samples)
    return s


def _suggest(s, ids):
    return {t: s.suggest(t) for t in ids}


def test_is_a_concurrency_limiter_whose_limit_is_buckets_times_size():
    s = ChorusSearch(bucket_size=4, max_buckets=3)
    assert isinstance(s, ConcurrencyLimiter) and s.max_concurrent == 12


def test_samples_param_space_exactly_like_tunes_default_generator():
    space = {"lr": tune.loguniform(1e-3, 1e-1), "wd": tune.grid_search([0.0, 1e-4, 1e-3]),
             "fixed": 3}
    default = BasicVariantGenerator(random_state=7)
    default.add_configurations([Experiment("x", run=lambda config: None, config=space,
                                           num_samples=2)])
    expected = []
    while (trial := default.next_trial()) is not None:
        expected.append(trial.config)
    s = ChorusSearch(bucket_size=4, random_state=7)
    s.set_search_properties(None, None, space, num_samples=6)
    got = [s.suggest(f"t{i}") for i in range(6)]
    assert got == expected
    assert s.suggest("t6") == Searcher.FINISHED


def test_without_param_space_every_trial_gets_an_empty_config():
    s = ChorusSearch(bucket_size=2)
    s.set_search_properties(None, None, {}, num_samples=3)
    assert [s.suggest(f"t{i}") for i in range(4)] == [{}, {}, {}, Searcher.FINISHED]


def test_compatible_configs_are_released_together():
    s = _search(widths="AB", bucket_size=3, lookahead=6)
    out = _suggest(s, [f"t{i}" for i in range(6)])
    widths = [c["width"] for c in out.values()]
    assert widths == ["A", "A", "A", "B", "B", "B"]


def test_max_buckets_holds_trials_back_until_a_slot_frees():
    s = _search(widths="A", bucket_size=2, max_buckets=1)
    assert _suggest(s, ["t0", "t1"])["t1"] is not None
    assert s.suggest("t2") is None
    s.on_trial_complete("t0", {"m": 1})
    assert s.suggest("t3") is not None


def test_a_freed_slot_is_refilled_with_the_same_key_before_older_others():
    s = _search(widths="AB", bucket_size=2, max_buckets=2, lookahead=8)
    _suggest(s, ["t0", "t1", "t2", "t3"])          # A, A, B, B: two full buckets
    b_trial = next(t for t in ("t0", "t1", "t2", "t3") if s._key_of[t] == "B")
    s.on_trial_complete(b_trial, {"m": 0})
    assert s.suggest("t4")["width"] == "B"


def test_inner_searcher_sees_results_and_completions_under_its_own_ids():
    s = _search(widths="A", bucket_size=2)
    _suggest(s, ["tuneA", "tuneB"])
    s.on_trial_result("tuneB", {"m": 0.5})
    s.on_trial_complete("tuneA", {"m": 0.7})
    s.on_trial_complete("tuneB", {"m": 0.9}, error=True)
    inner = s.searcher
    ids = {s_id for s_id in inner.suggested[:2]}
    assert {i for i, _ in inner.results} <= ids and len(inner.results) == 1
    assert sorted(inner.completed) == sorted([(inner.suggested[0], False), (inner.suggested[1], True)])
    assert not ids & {"tuneA", "tuneB"}


def test_finishes_after_num_samples_trials():
    s = _search(widths="A", bucket_size=4, num_samples=5)
    out = [s.suggest(f"t{i}") for i in range(6)]
    assert out[5] == Searcher.FINISHED and all(isinstance(c, dict) for c in out[:5])
    assert len(s.searcher.suggested) == 5  # never pulls beyond the budget


def test_finishes_when_the_inner_searcher_does():
    s = ChorusSearch(Recorder("A", finish_after=2), bucket_size=4, key=_by_width)
    s.set_search_properties("m", "max", {}, num_samples=10)
    assert [type(s.suggest(f"t{i}")) for i in range(3)] == [dict, dict, str]


def test_lookahead_is_how_many_suggestions_wait_in_the_buffer():
    s = _search(widths="AB", bucket_size=4, lookahead=3)
    s.suggest("t0")
    assert len(s.book.waiting) == 3 and len(s.searcher.suggested) == 4


def test_buffer_is_kept_topped_up_until_num_samples_is_reached():
    s = _search(widths="A", bucket_size=2, num_samples=5, lookahead=2)
    s.suggest("t0")
    assert s.waiting_by_key() == {"A": 3}            # 2 held back + t0 not started
    for t in ("t1", "t2", "t3"):
        s.suggest(t)
    assert len(s.book.waiting) == 1                  # only 5 in all: 4 out, 1 left
    s.suggest("t4")
    assert not s.book.waiting


def test_a_config_whose_key_fails_starts_alone():
    def key(config):
        if config["n"] == 1:
            raise RuntimeError("factory fails")
        return "A"

    s = ChorusSearch(Recorder("A"), bucket_size=4, max_buckets=2, key=key)
    s.set_search_properties("m", "max", {}, num_samples=6)
    out = _suggest(s, [f"t{i}" for i in range(6)])
    bad = next(t for t, c in out.items() if isinstance(c, dict) and c["n"] == 1)
    assert s._key_of[bad] == ("chorus/unbuildable", s._inner_id[bad])


def test_task_may_be_a_trainable_class_carrying_it():
    class FakeTask:
        def structural_key(self, config):
            return ("w", config["width"])

    class Trainable:
        task = FakeTask()

    s = ChorusSearch(Recorder("A"), bucket_size=2, task=Trainable)
    s.set_search_properties("m", "max", {}, num_samples=2)
    s.suggest("t0")
    assert s._key_of["t0"] == ("w", "A")


def test_task_without_structural_key_is_refused():
    with pytest.raises(TypeError):
        ChorusSearch(bucket_size=2, task=object())


def test_waiting_counts_held_and_unstarted_trials_per_key():
    s = _search(widths="AB", bucket_size=2, max_buckets=1, lookahead=4)
    s.suggest("t0")
    s.suggest("t1")
    # released A, A (not started); held back B, B, A, B (topped up to 4)
    assert s.waiting_by_key() == {"A": 3, "B": 3}
    s.on_trial_result("t0", {"m": 1})
    assert s.waiting_by_key() == {"A": 2, "B": 3}


def test_every_change_is_announced_to_the_pool(monkeypatch):
    import chorus_tune.tune.pool as pool

    sent = []
    monkeypatch.setattr(pool, "set_waiting", sent.append, raising=False)
    s = _search(widths="A", bucket_size=2, num_samples=2, lookahead=1)
    s.suggest("t0")
    s.suggest("t1")
    s.on_trial_result("t0", {"m": 1})
    s.on_trial_result("t1", {"m": 1})
    assert sent == [{"A": 2}, {"A": 2}, {"A": 1}, {}]


def test_save_and_restore_keep_buffer_and_id_maps(tmp_path):
    s = _search(widths="AB", bucket_size=2, max_buckets=1, lookahead=4)
    _suggest(s, ["t0", "t1"])                        # A, A; B, B wait
    released = [s._inner_id["t0"], s._inner_id["t1"]]
    path = str(tmp_path / "search.pkl")
    s.save(path)
    fresh = ChorusSearch(Recorder("AB"), bucket_size=2, max_buckets=1, key=_by_width)
    fresh.restore(path)
    assert fresh.suggest("t2") is None               # the bucket is still full
    fresh.on_trial_complete("t0", {"m": 1})
    fresh.on_trial_complete("t1", {"m": 1})
    assert [c for c, _ in fresh.searcher.completed] == released
    assert fresh.suggest("t3") == {"n": 1, "width": "B"}  # from the restored buffer
    assert fresh._key_fn is _by_width                      # kept, not restored


def test_state_leaves_the_task_out():
    s = ChorusSearch(bucket_size=2, task=type("T", (), {"task": type(
        "K", (), {"structural_key": lambda self, c: 1})()}))
    state = s.get_state()
    assert "_task" not in state and "_key_fn" not in state
    pickle.dumps(state)
