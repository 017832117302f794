"""The pool's part that opens, watches and closes bucket actors (docs/design.md D2, "Faults"):
placements made real (a bucket actor created, or a solo member's place), idle and drained
buckets closed, cores shared among the open ones, lost ones cleaned up. A part of
:class:`~chorus_tune.tune.actors.pool.ChorusPool` (its state is the pool's); when to close and
compact is ``rules/closing.py``."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import ray
from ray.exceptions import RayActorError

from chorus_tune.tune.actors.cluster import node_cpus
from chorus_tune.tune.rules.closing import idle_close_s, stays_idle
from chorus_tune.tune.rules.opening import actor_options, new_bucket_options
from chorus_tune.tune.rules.placement import Placed
from chorus_tune.tune.rules.resources import shared_threads, training_buckets
from chorus_tune.tune.values.protocol import NAMESPACE

# The pool's one log: its _start sends it to the actor's own stdout.
logger = logging.getLogger("chorus_tune.tune.actors.pool")

_DRAIN_POLL_S = 0.2


class BucketLifecycle:
    """Buckets opened, watched and closed (ChorusPool's part; see the module)."""

    def _realize_all(self, placements: list[Placed]) -> None:
        """Realize ``placements`` in the background, one task per bucket: the
        members placed in one bucket together reach it in one call."""
        by_bucket: dict[str, list[Placed]] = {}
        for placed in placements:
            by_bucket.setdefault(placed.bucket, []).append(placed)
        for group in by_bucket.values():
            asyncio.get_running_loop().create_task(self._realize_waiting(group))

    async def _realize_waiting(self, group: list[Placed]) -> None:
        try:
            await self._realize(group)
        except Exception as exc:  # noqa: BLE001 - the waiting trials hear of it
            for placed in group:
                logger.error("pool: placing member %s in bucket %s failed: %r", placed.trial_id, placed.bucket, exc)
                # Kept for a trial that asks later: with no one told, it would wait forever.
                self._unplaced[placed.trial_id] = exc
                future = self._waiting.pop(placed.trial_id, None)
                if future is not None and not future.done():
                    future.set_exception(exc)

    async def _realize(self, group: list[Placed]) -> None:
        """Make placements in one bucket real: create the bucket actor if new,
        and have it expect the members (and build them now, those seated), in
        one call. One call per member reached a new bucket apart under load,
        and two of a cohort of eight seated together trained an iteration
        before the other six arrived (a cohort must reach its rungs together)."""
        name = group[0].bucket
        if self._is_solo(name):
            self._realize_solo(group[0])
            return
        if any(p.opened for p in group) or name not in self.handles:
            record = self.placement.buckets[name]
            tid, options, model_name, _ = self.key_info[record.key]
            resources = self._bucket_resources(options)
            fit = self._fit_of(record.key)
            from chorus_tune.tune.actors.bucket_actor import BucketActor

            handle = BucketActor.options(**actor_options(name, NAMESPACE, resources)).remote(
                name, self.blobs[tid], new_bucket_options(options, record.capacity, resources), model_name,
                ray.get_runtime_context().current_actor, capacity_fit=fit)
            self.handles[name] = handle
            self._send_stops(name)  # a bucket opened mid-run knows the decision points already
            self._share_cores()
            self.history.opened(name, model_name, record.capacity, record.ever, fit, at=time.monotonic())
            asyncio.get_running_loop().create_task(self._watch_bucket(name, handle))
        members = [p.trial_id for p in group]
        handle = self.handles[name]
        await handle.expect_all.remote([(m, self.clients.get(m), self.seats.join_of(m)) for m in members])
        for member in members:
            if self.placement.bucket_of(member) != name:
                # It left while the bucket was being told (a new bucket's actor
                # takes seconds to start): its leave found no home to tell, so the
                # bucket would train it, unread, for good, and never drain. Seen as
                # a restore in one driver re-seated a member its restarted trial
                # no longer read: the idle bucket held the bucket budget and the
                # next run's trials waited for it.
                with contextlib.suppress(RayActorError):
                    await handle.leave.remote(member, keep_state=False)
                continue
            # Known as its home only once the bucket expects it: a trial that asks
            # the bucket before then would find no such member there.
            self.seats.house(member, name)
            self._events += 1
            future = self._waiting.pop(member, None)
            if future is not None and not future.done():
                future.set_result(name)

    def _realize_solo(self, placed: Placed) -> None:
        """A solo member's place in the budget is its home: no actor starts;
        its trial trains it (rules/solo.py)."""
        name, member = placed.bucket, placed.trial_id
        if placed.opened:
            record = self.placement.buckets[name]
            now = time.monotonic()
            self.history.opened(name, record.key.model_name, 1, record.ever, None,
                                at=now, solo=True)
            self.history.started(name, {"node_id": None, "device": "cpu", "requested_device": "cpu",
                                        "gpu_ids": []}, at=now)
        self.seats.house(member, name)
        self._events += 1
        future = self._waiting.pop(member, None)
        if future is not None and not future.done():
            future.set_result(name)

    async def close_idle(self) -> list[str]:
        """Close every idle bucket (no member in its slots) now rather than its
        ``idle_close_s`` later; each still closes only once its trials have
        read every result. Their names."""
        if self.placement is None:
            return []
        names = [name for name, record in self.placement.buckets.items() if not record.members]
        for name in names:
            _, update = self.placement.close(name)
            await self._apply(update)
            asyncio.get_running_loop().create_task(self._close_when_drained(name))
        if names:
            self._share_cores()
        return names

    async def _close_if_idle(self, name: str) -> None:
        # It stays in the placement until its members' trials read every result (see closing.py).
        delay_s = idle_close_s(self.placement, name)
        if delay_s is None:
            return
        if self._is_solo(name):
            delay_s = 0.0  # a solo member's place takes no other member

        await asyncio.sleep(delay_s)
        if not self._idle.start(name):
            return
        try:
            while True:
                if not stays_idle(self.placement, name):
                    return
                if await self._drained(name):
                    break
                await asyncio.sleep(_DRAIN_POLL_S)
        finally:
            self._idle.end(name)
        _, update = self.placement.close(name)
        await self._apply(update)
        self._share_cores()
        await self._close_when_drained(name)

    async def _drained(self, name: str) -> bool:
        handle = self.handles.get(name)
        if handle is None:
            return True
        try:
            return await handle.drained.remote()
        except RayActorError:
            return True

    async def _close_when_drained(self, name: str) -> None:
        # A bucket whose slots are empty may still hold results its members'
        # trials have not read: it closes once they have.
        if not self._closing.start(name):
            return
        try:
            while name in self.handles:
                try:
                    if await self.handles[name].drained.remote():
                        break
                except RayActorError:
                    break
                await asyncio.sleep(_DRAIN_POLL_S)
            await self._close_actor(name)
        finally:
            self._closing.end(name)

    def _share_cores(self) -> None:
        """On a CPU-only machine with default bucket resources, the buckets that
        train share every core: a lone bucket (one bucket of 32, say) then uses
        both cores of a 2-core machine instead of idling one, and so does the
        last bucket still training once the others' members have finished
        (measured on the 4-width sweep: its wide bucket of 16 trained an epoch
        in 2.3 s on 2 threads against 3.8-4.1 s on 1, while the narrow bucket,
        done, waited one core away for its trials to read it). A bucket with no
        member to train keeps its threads until one comes (it computes
        nothing). Buckets given explicit resources keep the threads their CPU
        share says. Only changes are sent."""
        self._training_shared = self._training_now()
        if ray.cluster_resources().get("GPU", 0) > 0:
            return
        shared = [n for n, h in self.handles.items() if n in self.placement.buckets
                  and self.placement.buckets[n].key.options.resources_per_bucket is None]
        if not shared:
            return
        # Per node: a bucket shares the cores of the node it runs on, not the cluster's.
        nodes = {name: self.history.node_of(name) for name in training_buckets(shared, self._has_members)}
        for name, threads in shared_threads(node_cpus(), nodes).items():
            if self._threads_sent.get(name) != threads:
                self._threads_sent[name] = threads
                self.handles[name].set_threads.remote(threads)

    def _share_cores_if_training_changed(self) -> None:
        """:meth:`_share_cores` after a placement change, only when the set of
        buckets with members to train changed: it asks the cluster for its
        resources and nodes (two GCS calls), and placement changes come with
        every member in and out."""
        if self._training_now() != self._training_shared:
            self._share_cores()

    def _training_now(self) -> frozenset:
        return frozenset(name for name in self.handles if self._has_members(name))

    def _has_members(self, name: str) -> bool:
        record = self.placement.buckets.get(name)
        return record is not None and bool(record.members)

    async def bucket_started(self, name: str, where: dict) -> None:
        """Bucket ``name`` runs: ``where`` holds its ``node_id``, ``device``,
        ``requested_device`` and ``gpu_ids``. Kept in its history, so the stats
        say where a bucket ran after it closed or died with its node."""
        self._events += 1
        self.history.started(name, where, at=time.monotonic())
        if name in self.handles:
            self._share_cores()

    async def _close_actor(self, name: str) -> None:
        handle = self.handles.pop(name, None)
        self.history.closed(name)
        if handle is None:
            return
        try:
            await handle.close.remote()
        except RayActorError:
            pass
        ray.kill(handle)

    async def _watch_bucket(self, name: str, handle) -> None:
        try:
            await handle.wait_closed.remote()
        except RayActorError as exc:
            if self.handles.get(name) is handle:
                logger.warning("pool: bucket %s died: %s", name, exc)
                await self._bucket_gone(name, died=True)

    async def _bucket_gone(self, name: str, died: bool) -> None:
        self._events += 1
        self.handles.pop(name, None)
        self._stops.forget(name)
        for member, source in list(self._draining.items()):
            if source == name:
                del self._draining[member]  # its unread results died there (its trial hears it)
        lost = self.seats.bucket_lost(name)
        self.history.gone(name, died, lost)
        if self.placement is None or name not in self.placement.buckets:
            return
        # A bucket dies with its node, and the node's resources go with it: the
        # budget must not open buckets the cluster no longer holds.
        self._size_budget(self.placement.buckets[name].key.options)
        _, update = self.placement.close(name)
        logger.warning("pool: bucket %s lost with members %s; budget now %s buckets; placed %s", name, lost,
                       self.placement.max_buckets, [(p.trial_id, p.bucket) for p in update.placed])
        await self._apply(update)
        self._share_cores()

    async def shutdown(self) -> None:
        for name in list(self.handles):
            await self._close_actor(name)
