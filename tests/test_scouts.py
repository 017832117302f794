"""A search's scouts and their held members (chorus_tune.tune.rules.scouts), no Ray."""
from chorus_tune.tune.rules.scouts import SCOUT_WAIT_S, Scouts


class Timers:
    """A fake ``call_later``: records each timer; ``fire`` runs the due ones."""

    def __init__(self):
        self.started: list[Timer] = []

    def __call__(self, delay_s, callback):
        timer = Timer(delay_s, callback)
        self.started.append(timer)
        return timer

    def fire(self):
        for timer in self.started:
            if not timer.cancelled:
                timer.callback()


class Timer:
    def __init__(self, delay_s, callback):
        self.delay_s, self.callback, self.cancelled = delay_s, callback, False

    def cancel(self):
        self.cancelled = True


SEAT = ("m1", {"lr": 0.1}, 7)


def test_an_expected_scout_hands_over_its_seat_when_it_arrives():
    scouts = Scouts(Timers())
    scouts.expect("t1", SEAT)
    assert scouts.is_expected("t1")
    assert scouts.arrived("t1", "task", "options") == SEAT
    assert not scouts.is_expected("t1")


def test_what_a_scout_taught_is_known_once_it_arrived():
    scouts = Scouts(Timers())
    scouts.expect("t1", SEAT)
    assert scouts.taught("t1") is None
    scouts.arrived("t1", "task", "options")
    assert scouts.taught("t1") == ("task", "options")


def test_a_trial_never_expected_is_no_scout():
    scouts = Scouts(Timers())
    assert not scouts.is_expected("t9")
    assert scouts.taught("t9") is None


def test_a_held_member_is_placed_alone_after_the_scout_wait():
    timers, placed = Timers(), []
    scouts = Scouts(timers)
    scouts.hold("m1", "key", placed.append)
    assert scouts.is_held("m1")
    assert [t.delay_s for t in timers.started] == [SCOUT_WAIT_S]
    timers.fire()
    assert placed == ["m1"]


def test_the_scout_wait_is_thirty_seconds_by_default():
    # docs/design.md D10: "The pool places a held scout alone after 30 s".
    assert Scouts(Timers()).wait_s == 30.0


def test_releasing_a_held_member_gives_its_key_and_cancels_its_timer():
    timers, placed = Timers(), []
    scouts = Scouts(timers, wait_s=5.0)
    scouts.hold("m1", "key", placed.append)
    assert scouts.release("m1") == "key"
    assert not scouts.is_held("m1")
    timers.fire()
    assert placed == []


def test_a_member_released_before_its_wait_is_over_is_not_released_again():
    scouts = Scouts(Timers())
    scouts.hold("m1", "key", lambda member: None)
    scouts.release("m1")  # its cohort was seated, or it left
    assert scouts.release("m1") is None  # a timer that fires late finds nothing to place


def test_a_member_never_held_releases_nothing():
    assert Scouts(Timers()).release("m9") is None
