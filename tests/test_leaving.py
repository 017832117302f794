"""Members on their way out of their buckets (Leaving, Ray-free): a name comes back once every leave of it is over."""
import asyncio

import pytest

from chorus_tune.tune.rules.leaving import Leaving


def test_a_member_with_no_leave_under_way_is_finished_at_once():
    asyncio.run(Leaving().finished("t1", timeout_s=0.01))


def test_a_member_is_finished_only_once_every_leave_of_it_is_over():
    async def scenario():
        leaving = Leaving()
        leaving.start("t1")
        leaving.start("t1")  # a restart's leave while the last one still waits in the bucket
        waiter = asyncio.get_running_loop().create_task(leaving.finished("t1", timeout_s=5.0))
        leaving.end("t1")
        await asyncio.sleep(0.05)
        still_waiting = not waiter.done()
        leaving.end("t1")
        await asyncio.wait_for(waiter, 1.0)
        return still_waiting, leaving.is_leaving("t1")

    assert asyncio.run(scenario()) == (True, False)


def test_another_member_s_leave_holds_nothing():
    async def scenario():
        leaving = Leaving()
        leaving.start("t2")
        await leaving.finished("t1", timeout_s=1.0)
        return leaving.is_leaving("t2")

    assert asyncio.run(scenario()) is True


def test_a_leave_that_never_ends_fails_the_wait_naming_the_member():
    async def scenario():
        leaving = Leaving()
        leaving.start("t1")
        await leaving.finished("t1", timeout_s=0.05)

    with pytest.raises(TimeoutError, match="member t1 was still leaving its bucket after 0.05 s"):
        asyncio.run(scenario())
