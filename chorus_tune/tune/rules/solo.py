"""Which members train in their trial's own process instead of a bucket (Ray-free; docs/design.md D2).

A bucket pays for itself only when it trains several members: a member alone
in a bucket of its own pays a new process (it imports torch and loads the
data: 2.3 s median to start, measured on the 2-core machine), the handover
when the bucket closes, and a call per result, and it trains no faster than
its trial would. Measured on a sweep where nothing fuses (8 trials, a batch
size each, ``benchmarks/vs_tune.py --workload synth-solo``): 0.38x plain Tune
with a bucket per trial. So a member that would open a bucket alone trains
*solo*, in the process of the trial that reads it, one iteration per
``step``, as plain Tune trains it.

The rules:

- only where buckets share the machine's cores (no GPU in the cluster, the
  default ``resources_per_bucket``): a trial's actor holds no GPU and none of
  the resources a user gave the buckets, so it can train only what the
  buckets would have trained on the same cores (:func:`may_train_solo`);
- only a member ChorusSearch seats with no other member of its structure in
  the same seating and none in the pool (seated, waiting, or in a bucket):
  members seated together are the ones that would share a bucket
  (:func:`lone_members`). A member that waits for its trial's reservation
  (no ChorusSearch) opens a bucket as before;
- a solo member still holds one bucket of the budget while its trial trains
  it, so buckets and solo trials together never run more than the budget
  says at once (:func:`solo_key` gives it a structure of its own, so no other
  member ever joins it).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable, Iterable, Mapping

from chorus_tune.tune.rules.grouping import GroupKey

# The structural key of a solo member's place: no other member's key equals it.
SOLO_MARK = "chorus/solo"


def may_train_solo(cluster: Mapping[str, float], options) -> bool:
    """Whether members of a run with ``options`` may train solo on ``cluster`` (see the module's rules)."""
    return bool(options.solo) and cluster.get("GPU", 0) <= 0 and options.resources_per_bucket is None


def lone_members(seating: Iterable[tuple[str, Hashable]], in_pool: Callable[[Hashable], bool]) -> set[str]:
    """The members of one seating (``(member, key)`` pairs) that no other member
    of their key would join: alone in the seating, and ``in_pool(key)`` false
    (no member of that key seated before, waiting, or in a bucket)."""
    pairs = list(seating)
    counts = Counter(key for _, key in pairs)
    return {member for member, key in pairs if counts[key] == 1 and not in_pool(key)}


def solo_key(key: GroupKey, member: str) -> GroupKey:
    """The key a solo ``member`` of ``key`` is placed under: its own, so the
    place it holds in the budget takes no other member."""
    return key._replace(structural_key=(SOLO_MARK, member))


def is_solo_key(key: Hashable) -> bool:
    return isinstance(key, GroupKey) and key.structural_key[:1] == (SOLO_MARK,)
