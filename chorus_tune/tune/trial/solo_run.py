"""A member trained in its trial's own process (docs/design.md D2; who trains solo: rules/solo.py).

The trial trains it one iteration per ``step``, as plain Tune trains a
trial: no bucket actor, no call per result, nothing trained ahead, so
nothing is wasted and Tune makes every decision. It trains with the core's
:class:`~chorus_tune.unfused.UnfusedMember`: the member's own module and the
stock ``torch.optim`` optimizer (the reference's training, at a plain
trial's speed), with a bucket's seed and member state, so a checkpoint
restores into a bucket, and a bucket's into a solo run.
"""
from __future__ import annotations

from typing import Any

from chorus_tune.tune.actors.bucket_actor_values import member_metrics
from chorus_tune.tune.rules.members import meets_stop_criteria
from chorus_tune.tune.values import result_keys as rk
from chorus_tune.tune.values import state_io
from chorus_tune.tune.values.plan import Plan

# Task id -> the task, unpickled once per process: an actor Tune reuses for
# later trials keeps its data loaded (Task caches it), as plain Tune's does.
_TASKS: dict[str, Any] = {}
# One core: a solo member holds one bucket of the budget, and on a CPU
# machine the default budget is one bucket per core (rules/resources.py).
_THREADS = 1


def _task(task_blob: bytes, task_id: str) -> Any:
    task = _TASKS.get(task_id)
    if task is None:
        import ray.cloudpickle as cloudpickle

        from chorus_tune.tune.actors.shared_data import load_task_data
        from chorus_tune.tune.client import get_pool

        task = _TASKS[task_id] = cloudpickle.loads(task_blob)
        # Its data from the sweep's shared copy, once one process has loaded it.
        load_task_data(task, task_id, get_pool(create=False))
    return task


class SoloRun:
    """One member, trained in this process on the CPU: :meth:`step` trains an
    iteration and returns its result (with the ``chorus/*`` keys a bucket
    gives, ``chorus/solo`` True); :meth:`state` is its member state, as a
    bucket's ``save`` gives it."""

    def __init__(self, task_blob: bytes, task_id: str, member: str, place: str, config: dict, seed: int,
                 state: bytes | None = None, plan: Plan | None = None):
        import torch

        from chorus_tune.route import RouteReason
        from chorus_tune.unfused import UnfusedMember

        torch.set_num_threads(_THREADS)
        self.member, self.place = member, place
        self.plan = plan or Plan()
        task = _task(task_blob, task_id)
        if state is None:
            self.core = UnfusedMember(task, dict(config), seed)
        else:
            self.core = UnfusedMember(task, dict(config), state=state_io.loads(state))
        self.seed, self.route_reason = self.core.seed, RouteReason.SOLO.value
        self.iterations = 0
        self.finished = False  # its last result ended it (the plan's budget, a stop criterion)

    def step(self) -> dict[str, Any]:
        metrics = self.core.run_iteration()
        self.iterations += 1
        result = {**member_metrics(metrics),
                  rk.MEMBER: self.member, rk.BUCKET: self.place, rk.SLOT: 0,
                  rk.BUCKET_ITERATION: self.iterations, rk.ROUTE: metrics["route"],
                  rk.ROUTE_REASON: self.route_reason, rk.LIVE: 1, rk.ROWS: 1, rk.CAPACITY: 1,
                  rk.SEED: self.seed, rk.COMPACTIONS: 0, rk.OOM_RECOVERIES: 0, rk.AHEAD: 0, rk.WASTED: 0,
                  rk.SOLO: True}
        # What a bucket marks done (rules/members.py): its plan's budget, or a stop criterion met.
        budget = self.plan.budget
        if meets_stop_criteria(self.plan, result) or (budget is not None and result.get(rk.ITERATION, 0) >= budget):
            result["done"] = True
        self.finished = bool(result.get("done"))
        return result

    def state(self) -> bytes:
        """The member's state after its last iteration, serialised as a bucket's ``save`` serialises it."""
        return state_io.dumps(self.core.member_state())
