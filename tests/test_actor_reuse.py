"""When the pool says that Tune starts a process for every trial (chorus_tune.tune.rules.actor_reuse), no Ray."""
from chorus_tune.tune.rules.actor_reuse import ActorReuse


def _fresh_processes(reuse: ActorReuse, trials: range, in_flight: int = 4) -> list[int]:
    """Trials each from an actor of its own; the trial numbers at which it was said."""
    return [t for t in trials if reuse.reserved(f"t{t}", f"actor{t}", in_flight)]


def test_a_run_whose_trials_each_start_a_process_is_told_once_after_twice_the_trials_in_flight():
    reuse = ActorReuse()
    assert _fresh_processes(reuse, range(1, 30), in_flight=4) == [8]


def test_with_more_trials_in_flight_it_waits_for_twice_as_many():
    reuse = ActorReuse()
    assert _fresh_processes(reuse, range(1, 60), in_flight=16) == [32]


def test_a_run_whose_processes_serve_several_trials_is_never_told():
    reuse = ActorReuse()
    said = [reuse.reserved(f"t{t}", f"actor{t % 4}", 4) for t in range(40)]
    assert not any(said)


def test_a_restarted_trial_in_a_new_process_counts_as_no_reuse():
    reuse = ActorReuse()
    said = [reuse.reserved("t0", f"actor{n}", 1) for n in range(3)]  # one trial, restarted twice
    said += [reuse.reserved(f"t{t}", f"actor{t + 10}", 1) for t in range(1, 8)]
    assert said.count(True) == 1 and said[-1]


def test_a_new_run_may_be_told_again():
    reuse = ActorReuse()
    assert _fresh_processes(reuse, range(1, 10)) == [8]
    reuse.new_run()
    assert _fresh_processes(reuse, range(1, 10)) == [8]


def test_a_reservation_from_no_known_process_counts_for_nothing():
    reuse = ActorReuse()
    assert not any(reuse.reserved(f"t{t}", None, 1) for t in range(20))
