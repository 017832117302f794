"""What the pool's stats say of every bucket (chorus_tune.tune.rules.bucket_history), no Ray."""
from chorus_tune.tune.rules.bucket_history import BucketHistory

LIVE = {"node_id": "n2", "wasted": 3, "iterations": 40, "route": "vmap", "max_queue": 2, "decision_points": [3],
        "member_iterations": 90, "rows_computed": 120}


def opened(trials=None):
    history = BucketHistory()
    history.opened("b1", "MLP", 4, trials if trials is not None else ["t1"], capacity_fit=None)
    return history


def test_an_opened_bucket_reports_its_model_size_and_trials():
    report = opened().report("b1", ["t1"])
    assert report == {"model": "MLP", "bucket_size": 4, "capacity": 4, "trials": ["t1"], "closed": False,
                      "reaped": [], "capacity_fit": None, "solo": False, "members": ["t1"]}


def test_a_bucket_reports_how_long_it_took_to_start():
    history = BucketHistory()
    history.opened("b1", "MLP", 4, ["t1"], capacity_fit=None, at=10.0)
    history.started("b1", {"node_id": "n1"}, at=12.5)
    assert history.report("b1", ["t1"])["start_s"] == 2.5


def test_a_solo_place_reports_itself_solo():
    history = BucketHistory()
    history.opened("b1", "MLP", 1, ["t1"], capacity_fit=None, solo=True)
    assert history.report("b1", [])["solo"] is True


def test_the_trials_follow_members_that_join_after_the_opening():
    trials = ["t1"]
    history = opened(trials)
    trials.append("t2")  # the placement's own list of every member the bucket held
    assert history.report("b1", [])["trials"] == ["t1", "t2"]


def test_a_report_is_a_copy():
    history = opened()
    history.report("b1", [])["trials"].append("x")
    assert history.report("b1", [])["trials"] == ["t1"]


def test_a_bucket_has_started_once_it_says_where_it_runs():
    history = opened()
    assert not history.has_started("b1")
    history.started("b1", {"node_id": "n1", "device": "cpu"})
    assert history.has_started("b1") and history.node_of("b1") == "n1"
    assert history.report("b1", [])["device"] == "cpu"


def test_an_unknown_bucket_has_not_started_and_runs_nowhere():
    history = BucketHistory()
    history.started("b9", {"node_id": "n1"})
    assert not history.has_started("b9") and history.node_of("b9") is None


def test_what_a_bucket_said_while_open_is_reported_and_kept_after_it_closes():
    history = opened()
    assert history.report("b1", ["t1"], LIVE)["decision_points"] == [3]
    history.closed("b1")
    later = history.report("b1", [])
    assert (later["closed"], later["iterations"], later["route"], later["wasted"]) == (True, 40, "vmap", 3)
    assert (later["member_iterations"], later["rows_computed"]) == (90, 120)  # how full its iterations ran
    assert "max_queue" not in later and "decision_points" not in later  # true only while it is open


def test_reaped_members_are_reported():
    history = opened()
    history.note("b1", "reaped", "t1")
    assert history.report("b1", [])["reaped"] == ["t1"]


def test_a_compaction_lowers_the_capacity_and_is_counted():
    history = opened()
    history.compacted("b1", 2)
    history.compacted("b1", 1)
    report = history.report("b1", [])
    assert (report["capacity"], report["bucket_size"], report["compactions"]) == (1, 4, 2)


def test_a_bucket_that_died_reports_the_members_lost_with_it():
    history = opened()
    history.gone("b1", died=True, lost=["t1"])
    report = history.report("b1", [])
    assert (report["closed"], report["died"], report["lost"]) == (True, True, ["t1"])


def test_buckets_are_listed_in_the_order_they_opened():
    history = opened()
    history.opened("b0", "CNN", 2, [], None)
    assert list(history.names()) == ["b1", "b0"] and "b0" in history


def test_a_member_that_left_no_bucket_is_noted_nowhere():
    history = opened()
    history.note(None, "reaped", "t1")
    assert history.report("b1", [])["reaped"] == []


def test_a_bucket_opened_while_the_names_are_read_does_not_disturb_the_reading():
    # The pool's stats await each bucket's describe() in turn: a bucket opened
    # meanwhile once raised "dictionary changed size during iteration".
    history = opened()
    read = []
    for name in history.names():
        read.append(name)
        history.opened("b2", "MLP", 4, [], None)
    assert read == ["b1"] and list(history.names()) == ["b1", "b2"]


def test_a_regroup_is_counted_in_both_buckets_entries():
    history = BucketHistory()
    history.opened("b1", "MLP", 16, [], None)
    history.opened("b2", "MLP", 16, [], None)
    history.regrouped("b2", "b1", ["m1", "m2"])
    history.regrouped("b2", "b1", ["m3"])
    assert (history.report("b2", [])["regroups"], history.report("b2", [])["moved_out"]) == (2, 3)
    assert history.report("b1", [])["moved_in"] == 3 and "regroups" not in history.report("b1", [])


def test_a_buckets_place_is_its_node_device_and_gpus():
    history = BucketHistory()
    history.opened("b1", "MLP", 16, [], None)
    assert history.place_of("b1") == (None, None, ())  # not started yet
    history.started("b1", {"node_id": "n1", "device": "cuda:0", "gpu_ids": ["3"]})
    assert history.place_of("b1") == ("n1", "cuda:0", ("3",))
