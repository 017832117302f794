"""The pool's part that takes members in (docs/design.md D2, D10): seating ChorusSearch's members
ahead of their trials, binding trials to them, scouts, reservations and waits for a placement,
and a new run's clean slate. A part of :class:`~chorus_tune.tune.actors.pool.ChorusPool` (its
state is the pool's, set in its ``__init__``); the rules it applies live in ``rules/``."""
from __future__ import annotations

import asyncio
import logging

import ray
import ray.cloudpickle as cloudpickle

from chorus_tune.tune.rules.fusion_verdicts import measuring_order
from chorus_tune.tune.rules.grouping import GroupKey
from chorus_tune.tune.rules.solo import is_solo_key, lone_members, may_train_solo, solo_key
from chorus_tune.tune.values.options import BucketOptions, Join
from chorus_tune.tune.values.plan import Plan
from chorus_tune.tune.values.protocol import NEED_TASK, SOLO, Reservation

# The pool's one log: its _start sends it to the actor's own stdout.
logger = logging.getLogger("chorus_tune.tune.actors.pool")

# Why a member left, in its bucket's history: an earlier run seated it and no trial ever read it.
UNREAD_AT_NEW_RUN = "unread when a new run started"
_REALIZE_WAIT_S = 5.0  # reserve waits this long for its bucket, then the trial waits in await_placement


class Seating:
    """Members in: seats, binds, scouts and reservations (ChorusPool's part; see the module)."""

    async def seat(self, seats: list[tuple[str, dict, int]], task_id_: str, task_blob: bytes | None,
                   options: BucketOptions, plan: Plan) -> dict[str, str] | str:
        """Seat members ``(member, config, seed)`` in buckets of their structure
        now, before any trial reads them: each starts training as soon as it
        has a slot. All are placed before any is built, so members seated
        together train (and reach their rungs) together. Returns, per member,
        ``"seated"``, ``"queued"`` (every bucket of its key is full), ``"solo"``
        (its trial trains it, when its place in the budget is free: rules/solo.py) or
        ``"failed"`` (its model cannot be built: the trial bound to it fails
        with the factory's error); or ``NEED_TASK``."""
        self._start()
        if not self._learn_task(task_id_, task_blob):
            return NEED_TASK
        out, placements, keyed = {}, [], []
        for member, config, seed in seats:
            if self.scouts.release(member) is not None:
                # A scout's member: seated now, first, with the cohort it waited for.
                self.seats.unseat(member)
            if self.seats.is_kept(member):
                # Seated again (ChorusSearch restored in this job): kept as it is.
                # (A trial that read some of its results and left made it leave.)
                out[member] = self.seats.status(member)
                continue
            try:
                key = self._key(task_id_, options, config)
                size = await self._bucket_size(key, options, config)
            except Exception as exc:  # noqa: BLE001 - the factory's (or the sizing's) error, for this member's trial
                self.seats.fail(member, exc)
                out[member] = "failed"
                continue
            keyed.append((member, config, seed, key, size))
        # Decided over the whole seating, before any is placed: members seated
        # together are the ones that would share a bucket (rules/solo.py), unless
        # fusing them was measured not to pay here (rules/fusion_verdicts.py).
        solo: set[str] = set()
        if may_train_solo(ray.cluster_resources(), options):
            slow: set[GroupKey] = set()
            keys = {k for *_, k, _ in keyed}
            if options.solo_below is not None and not self.actor_reuse.never_reused:
                measured = self.fusion.needs_measuring(keys, options.solo_below) and await self._measure_fusion(
                    task_id_, [(k, c, s) for _, c, s, k, _ in keyed], {k: size for *_, k, size in keyed})
                slow = self.fusion.solo_keys(keys, options.solo_below)
                if measured:  # said once, where a structure was measured anew
                    _say_solo(slow, any(self.fusion.trains_solo(k, options.solo_below) for k in keys),
                              options.solo_below)
            lone = lone_members([(m, k) for m, _, _, k, _ in keyed], self._key_in_pool)
            solo = lone | {m for m, _, _, k, _ in keyed if k in slow}
            self.solo_for_gain.update({m: (k, size) for m, _, _, k, size in keyed if k in slow and m not in lone})
        for member, config, seed, key, size in keyed:
            self.seats.seat(member, Join(config=dict(config), seed=int(seed), plan=plan))
            placed = self._request(member, solo_key(key, member), 1) if member in solo else self._request(
                member, key, size)
            out[member] = "solo" if member in solo else "queued" if placed is None else "seated"
            if placed is not None:
                placements.append(placed)
        # Not awaited: a new bucket actor takes seconds to start (it imports
        # torch), and the trials Tune starts meanwhile wait for their member's
        # placement in their own first step, in parallel with it.
        self._realize_all(placements)
        return out

    async def trains_solo(self, member: str) -> bool:
        """Whether ``member`` trains solo: its place, or the one it waits for, is a solo member's."""
        return self._member_is_solo(member)

    def _member_is_solo(self, member: str) -> bool:
        """:meth:`trains_solo`, for the pool's own use."""
        if self.placement is None:
            return False
        name = self.placement.bucket_of(member)
        if name is not None:
            return self._is_solo(name)
        waiting = self.placement.waiting_ahead(member)
        return waiting is not None and is_solo_key(waiting[0])

    async def _back_to_buckets(self) -> None:
        """Tune starts a process for every trial (rules/actor_reuse.py): a solo
        trial would import torch and load the data in each, which a bucket's
        trials never do. Members sent solo for their gain (rules/fusion_verdicts.py)
        that no trial reads yet go back to buckets of their structure, and no
        seating of this run is sent solo for its gain again. Measured on Ray's
        ``mnist_pytorch.py`` as it ships (50 trials, 2 cores): every trial solo,
        1.02x plain Tune (108.0 s against 110.2 s); in buckets, 1.98x."""
        read = self.readers.members_read()
        back = [(m, key, size) for m, (key, size) in self.solo_for_gain.items()
                if m not in read and self.seats.is_seated(m)]
        self.solo_for_gain.clear()
        if not back:
            return
        # Those still waiting for a place first: a placed one's place, freed, would go to them.
        back.sort(key=lambda item: not self.placement.is_waiting(item[0]))
        for member, _, _ in back:
            self.seats.unhouse(member)
            await self._apply(self.placement.remove(member))
        placements = [p for p in (self._request(m, key, size) for m, key, size in back) if p is not None]
        logger.warning("pool: %d members sent solo for what fusing gains go back to buckets: a solo trial in a "
                       "process of its own would import torch and load the data each time", len(back))
        self._realize_all(placements)

    async def _measure_fusion(self, task_id_: str, seating: list[tuple[GroupKey, dict, int]],
                              capacity: dict[GroupKey, int]) -> bool:
        """Measure how much each structure of ``seating`` not measured yet gains
        fused in buckets of ``capacity[key]`` slots (rules/fusion_verdicts.py), off the event
        loop, one after another; say what each one gains. Whether it measured any."""
        samples = self.fusion.to_measure(seating, capacity)
        if not samples:
            return False
        from chorus_tune.fusion_gain import measure_fusion_gain

        loop = asyncio.get_running_loop()
        task = cloudpickle.loads(self.blobs[task_id_])  # a copy: the pool's own task holds no data
        refs = await self.data.get(task_id_, ray.get_runtime_context().get_node_id())
        if refs:
            task._loaded = await refs[0]
        # One structure per family (the same structure at other batch sizes), the
        # largest family first, and no further once one gains enough: the seating
        # then shares buckets whatever the others gain (all or none).
        order = measuring_order(samples, lambda key: (key.task_id, key.options,
                                                      key.structural_key._replace(batch_size=None)),
                                lambda key: task.batch_size_for(samples[key][0][0]))
        for key, kin in order:
            sample = samples[key]
            gain = await loop.run_in_executor(None, measure_fusion_gain, task, sample)
            self.fusion.judge(key, gain)
            too_little = self.fusion.trains_solo(key, key.options.solo_below)
            _say_gain(key, task, sample[0][0], gain, too_little)
            if not too_little:
                break
            for other in kin:
                self.fusion.judge_with(other, key)
            if kin:
                logger.info("pool: %d more structure(s) of %s (batch sizes %s) judged with it, not measured: a "
                            "larger batch gains less (rules/fusion_verdicts.py, measuring_order)",
                            len(kin), key.model_name,
                            sorted({task.batch_size_for(samples[k][0][0]) for k in kin}))
        return True

    async def bind(self, trial_id: str, candidates: list[str]) -> str | None:
        """Bind Tune's new trial to one of ``candidates`` (seated members, oldest
        first): one with a bucket, then one with a slot in a bucket still
        starting, before one still waiting for a slot, so the trials Tune runs
        read results that exist (or soon will). Returns the member; for a
        trial that runs already, the candidate it reads, or ``None`` when it
        reads a member of its own."""
        return self.readers.bind(trial_id, candidates, self.seats.is_seated, self.seats.is_housed, self._is_slotted,
                                 self._member_is_solo)

    def _is_slotted(self, member: str) -> bool:
        """Whether ``member`` has a slot in a bucket (housed, or its bucket still starting)."""
        return self.placement is not None and self.placement.bucket_of(member) is not None

    async def expect_scout(self, trial_id: str, seat: tuple[str, dict, int]) -> None:
        """ChorusSearch (no ``task=``) hands Tune ``trial_id`` first: when its
        first step reserves, it teaches the pool its task, and it reads the
        member ``seat`` (``(member, config, seed)``), placed with the cohort
        the search seats next."""
        self.scouts.expect(trial_id, seat)

    async def scout_task(self, trial_id: str) -> tuple[str, BucketOptions] | None:
        """``(task id, options)`` the scout reserved with, once it has."""
        return self.scouts.taught(trial_id)

    def _hold_scout(self, trial_id: str, task_id_: str, options: BucketOptions) -> str:
        member, config, seed = self.scouts.arrived(trial_id, task_id_, options)
        key = self._key(task_id_, options, config)  # the factory's error, for the scout's trial
        self.seats.seat(member, Join(config=dict(config), seed=int(seed), plan=options.plan()))
        self.readers.bind_to(trial_id, member)
        self.scouts.hold(member, key, lambda m: asyncio.get_running_loop().create_task(self._place_held(m)))
        return member

    async def _place_held(self, member: str) -> None:
        key = self.scouts.release(member)
        if key is None:
            return  # seated with its cohort, or left, before its wait was over
        logger.warning("pool: scout member %s waited %.0f s for its cohort; placed alone", member,
                       self.scouts.wait_s)
        options = key.options
        size = await self._bucket_size(key, options, self.seats.join_of(member).config)
        placed = self._request(member, key, size)
        if placed is not None:
            await self._realize_waiting([placed])

    async def new_run(self, seated_by: str) -> None:
        """A new Tune run starts in this driver (ChorusSearch says so): where
        the last run's scheduler stopped trials says nothing of this one's, and
        the members earlier runs seated that no trial reads leave. Those named
        ``seated_by`` (the prefix of the member names the run's own search
        seats) stay: Ray does not keep the order of an async actor's calls
        (docs: "Actor Task Execution Order"), so this one may run after the
        run's first seats. A restore in this driver keeps its search's
        prefix, and so its seats, as before.

        Tune tells a searcher nothing when a run ends early (a stopper's
        ``stop_all``, ``time_budget_s``, ``fail_fast``): the members seated
        ahead of it stayed, trained, unread, for good, their bucket never
        drained, and the next run's trials waited for its budget for ever
        (measured: a second fit in one driver at ``max_buckets=1`` hung). One
        run at a time per driver is assumed, as for the stop counts above."""
        self._start()
        self._stops.clear()
        self.actor_reuse.new_run()
        self.fusion.new_run()
        self.solo_for_gain.clear()
        for handle in list(self.handles.values()):
            handle.reset_stops.remote()
        unread = self.seats.unread(self.readers.members_read(), spare=seated_by)
        if self.placement is not None:
            # Queued ones first: a placed one's slot must not go to one about to leave.
            unread.sort(key=lambda member: not self.placement.is_waiting(member))
        # All forgotten before the first await: no seat can come between them.
        gone = [(member, *self._forget(member, UNREAD_AT_NEW_RUN)) for member in unread]
        if gone:
            logger.info("pool: a new run starts; %d members seated before and never read leave: %s",
                        len(gone), [member for member, _, _ in gone])
        for member, name, update in gone:
            await self._left(member, name, update)

    async def reserve(self, trial_id: str, task_id_: str, task_blob: bytes | None, config: dict,
                      options: BucketOptions, client: str | None = None, seed: int | None = None):
        """Where ``trial_id`` reads its results: a :class:`Reservation`, or
        ``NEED_TASK`` when the pool has not seen this task yet (call again with
        its bytes). A trial bound to a seated member reads that member; any
        other gets a member of its own (named by its trial id, seeded with
        ``seed``), placed in a bucket of its structure. Never waits for a
        slot (the trial waits in :meth:`await_placement`, saying what for);
        it may wait for the trial's last member to leave its bucket, at most
        that bucket's running iteration. Raises what the model factory raises
        for ``config``."""
        self._start()
        if not self._learn_task(task_id_, task_blob):
            return NEED_TASK
        self.clients[trial_id] = client
        if self.readers.is_reading(trial_id):
            # A trial reserving again is a restart (a new actor, a recovery, a
            # restore in this job): what its member holds is stale for it. It
            # gets a member of its own (restored from its checkpoint, if any).
            await self.trial_left(trial_id)
        # Its member's name (its trial id) comes back only once its last leave
        # reached the bucket (leaving.py says what happened before: an actor's
        # leave is not waited for, and the bucket holds it to the iteration's end).
        await self.leaving.finished(trial_id, options.result_timeout_s)
        if self.scouts.is_expected(trial_id):
            self._hold_scout(trial_id, task_id_, options)
        member = self.readers.bound_member(trial_id, self.seats.is_seated)  # None once lost with its bucket
        token = self.readers.start(trial_id, trial_id if member is None else member)
        if self.actor_reuse.reserved(trial_id, client, len(self.readers.reading)):
            logger.warning(
                "chorus_tune: each of this run's first %d trials started a process of its own: Tune's "
                "TuneConfig(reuse_actors=...) is off (its default). Each new process imports Ray Tune (about "
                "1.5 CPU-s) before its trial reads a result; reuse_actors=True lets a finished trial's process "
                "serve the next (Ray's mnist_pytorch.py, 50 trials on 2 cores: 71.8 s off, 16.9 s on; "
                "docs/benchmarks.md).", self.actor_reuse.trials)
            await self._back_to_buckets()
        if member is not None:
            failure = self.seats.failure(member)
            if failure is not None:
                raise failure
            seat = self.seats.join_of(member)
            home, name = self.seats.home(member), self._read_from(member)
            # Its bucket watches this trial's actor from now on, not only once
            # it first reads: an actor that dies before would leave the member
            # holding its slot for good.
            self.clients[member] = client
            if home in self.handles and client is not None:
                self.handles[home].watch.remote(member, client)
            return Reservation(member, seat.seed, seat.plan, name, self.handles.get(name), True, token,
                               solo=self._is_solo(name))
        key = self._key(task_id_, options, config)
        size = await self._bucket_size(key, options, config)
        plan = options.plan(self.plans.get(trial_id))
        seed = int(seed) if seed is not None else 0
        placed = self._request(trial_id, key, size)
        if placed is None:
            logger.info("pool: %s waits for a bucket (all %s in use)", trial_id, self.placement.max_buckets)
            return Reservation(trial_id, seed, plan, None, None, False, token)
        # A new bucket may wait long to start (for a GPU another bucket holds):
        # the trial then waits in await_placement, which says what it waits for
        # and ends (docs/design.md "Faults: every wait ends"), not in here.
        realizing = asyncio.get_running_loop().create_task(self._realize_waiting([placed]))
        await asyncio.wait({realizing}, timeout=_REALIZE_WAIT_S)
        if trial_id in self._unplaced:
            raise self._unplaced.pop(trial_id)
        name = self._read_from(trial_id)
        return Reservation(trial_id, seed, plan, name, self.handles.get(name), False, token)

    async def await_placement(self, member: str):
        """``(bucket name, handle)`` of a member waiting for a slot, once it has one
        (and its bucket expects it)."""
        if member in self._unplaced:
            raise self._unplaced[member]
        name = self._read_from(member)
        if name is None:
            placed = self.scouts.is_held(member) or self.placement is not None and (
                self.placement.is_waiting(member) or self.placement.bucket_of(member) is not None)
            if not placed:
                raise RuntimeError(f"member {member} is neither placed nor waiting for a bucket")
            future = self._waiting.setdefault(member, asyncio.get_running_loop().create_future())
            name = await future
        return name, SOLO if self._is_solo(name) else self.handles[name]

    async def stops_seen(self, name: str, stopped: dict[int, int], continued: dict[int, int]) -> None:
        """Bucket ``name`` saw Tune stop a trial early, or continue one where the run still gathers
        evidence (docs/design.md D4): tell the run's other buckets."""
        self._stops.seen(name, stopped, continued)
        for other in list(self.handles):
            if other != name:
                self._send_stops(other)

    def _send_stops(self, name: str) -> None:
        counts = self._stops.elsewhere(name)
        if counts is not None and name in self.handles:
            self.handles[name].stops_elsewhere.remote(*counts)


def _say_gain(key: GroupKey, task, config: dict, gain, too_little: bool) -> None:
    what = f"structure {key.model_name} (batch size {task.batch_size_for(config)})"
    if gain is None:
        logger.info("pool: %s: how much fusing it gains could not be measured", what)
    else:
        logger.log(logging.WARNING if too_little else logging.INFO, "pool: %s: %s (solo_below=%s)", what,
                   gain.describe(), key.options.solo_below)


def _say_solo(slow: set, some_too_little: bool, floor: float) -> None:
    """What a seating's measured structures decided: ``slow``, those sent solo;
    ``some_too_little``: whether any of them gains less than ``floor``."""
    if slow:
        logger.warning("pool: fusing gains less than solo_below=%s for every structure measured (%d): each of "
                       "their trials trains its member in its own process, as plain Tune would (chorus/solo)",
                       floor, len(slow))
    elif some_too_little:
        logger.info("pool: fusing gains less than solo_below for some structures only: all share buckets "
                    "(rules/fusion_verdicts.py, FusionVerdicts.solo_keys)")
