"""The reaper's question (actors/liveness.py): is the trial actor with this id gone?"""
from __future__ import annotations

import time

import pytest
import ray

from chorus_tune.tune.actors import liveness

pytestmark = pytest.mark.usefixtures("local_ray")


@ray.remote(num_cpus=0)
class _Trial:
    def my_id(self) -> str | None:
        return liveness.current_actor_id()


def test_a_live_actor_is_not_dead_and_a_killed_one_is():
    actor = _Trial.remote()
    actor_id = ray.get(actor.my_id.remote())
    assert actor_id == actor._actor_id.hex()
    assert not liveness.is_dead(actor_id)
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while not liveness.is_dead(actor_id):
        assert time.monotonic() < deadline, "the GCS never said the killed actor is dead"
        time.sleep(0.1)
    assert liveness.dead_among({actor_id}) == {actor_id}


def test_an_actor_the_gcs_does_not_know_is_not_taken_for_dead():
    assert not liveness.is_dead("ff" * 16)


def test_outside_an_actor_there_is_no_actor_id():
    assert liveness.current_actor_id() is None
