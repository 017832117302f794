"""Which structures train solo because fusing them measured too small a gain (Ray-free; docs/design.md D2,
"Solo where fusing does not pay").

On a CPU, where buckets share the machine's cores (:func:`~.solo.may_train_solo`),
the pool measures once per structure how much faster a member trains fused
than alone (:func:`chorus_tune.fusion_gain.measure_fusion_gain`), on the first
members of it seated together (two or more; a lone one trains solo anyway).
Where every structure measured in a seating gains less than the run's
``solo_below`` (``BucketOptions``), every member of them trains solo, in its
trial's own process, as plain Tune would train it (:meth:`FusionVerdicts.solo_keys`
says why all or none); where one gains more, or could not be measured, they
share buckets as before. A verdict is kept for the pool's
life: the structure, the device and the machine do not change under it.

Why a floor of 1.3 by default: measured on the 2-core machine (K=8, 4 steps),
a width-64 MLP gained 2.0-2.9x, one of width 256 1.1-1.8x, the PyTorch
tutorial's CNN 1.5-1.6x at batch 2, 1.1-1.3x at 4 and 0.7-1.0x at 8 and 16,
and the ConvNet of Ray's ``mnist_pytorch.py`` 1.0x. Trained solo, the
tutorial's 64 trials ran at 0.90x plain Tune against 0.49x fused and the
mnist port at 1.04x against 0.69x, while the MLP's FIFO sweep ran at 0.97x
solo against 2.02x fused (docs/benchmarks.md, Stop 64).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Mapping

# Members of a structure a measurement trains fused (at most): enough to see
# what a bucket gains, few enough to keep the seat that waits for it short.
PROBE_MEMBERS = 8


class FusionVerdicts:
    """Per structure key: the gain measured, and whether its members train solo."""

    def __init__(self) -> None:
        self._gains: dict[Hashable, Any] = {}  # key -> FusionGain, or None (not measurable)
        self._run_fuses = False  # a seating of the run shares buckets: see solo_keys

    def new_run(self) -> None:
        """A new Tune run starts: its seatings are judged afresh (the verdicts per structure stay)."""
        self._run_fuses = False

    def needs_measuring(self, keys: Iterable[Hashable], floor: float | None) -> bool:
        """Whether a seating of ``keys`` is worth measuring: not where its run
        shares buckets already, nor where one of its keys is known to gain
        enough (or could not be measured), since it shares buckets then
        whatever the others gain (:meth:`solo_keys`). Measured on the 4-width sweep,
        three runs in one driver: each run's first seat measured one more
        width group (0.5 s before Tune's first trial, under the run's start-up
        load) while the first gained 2.8x."""
        if self._run_fuses or floor is None:
            return False
        return not any(key in self._gains and not self.trains_solo(key, floor) for key in keys)

    def to_measure(self, seating: Iterable[tuple[Hashable, dict, int]],
                   capacity: Mapping[Hashable, int]) -> dict[Hashable, list[tuple[dict, int]]]:
        """The keys of ``seating`` (``(key, config, seed)`` per member, in seat
        order) not judged yet that two members or more of it share: for each,
        the ``(config, seed)`` of its first members, as many as would share one
        of its buckets (``capacity[key]`` slots; :data:`PROBE_MEMBERS` at most).

        As many as would share one, not more: what fusing gains grows with the
        members fused (a width-64 digits MLP, 2-core CPU: 1.0-1.2x at 2, 1.4x
        at 3, 2.2-2.3x at 6), and two members of a structure that the run
        seats alone gain too little to pay for a bucket."""
        samples: dict[Hashable, list[tuple[dict, int]]] = {}
        for key, config, seed in seating:
            if key not in self._gains:
                samples.setdefault(key, []).append((config, seed))
        out = {}
        for key, sample in samples.items():
            most = min(PROBE_MEMBERS, capacity[key], len(sample))
            if most >= 2:
                out[key] = sample[:most]
        return out

    def judge(self, key: Hashable, gain: Any) -> None:
        """Record what measuring ``key`` gave (a ``FusionGain``, or ``None``)."""
        self._gains[key] = gain

    def judge_with(self, key: Hashable, kin: Hashable) -> None:
        """Record for ``key`` what ``kin``, a structure of its family measured
        in its place (:func:`measuring_order`), gave."""
        self._gains[key] = self._gains[kin]

    def trains_solo(self, key: Hashable, floor: float | None) -> bool:
        """Whether fusing ``key`` gains too little: its gain was measured, below ``floor``."""
        gain = self._gains.get(key)
        return floor is not None and gain is not None and gain.ratio < floor

    def solo_keys(self, keys: Iterable[Hashable], floor: float | None) -> set[Hashable]:
        """The keys of one seating whose members train solo: every key of it
        that was measured (a key seen with one member only trains solo anyway),
        where each of them gains too little (:meth:`trains_solo`) and at least
        one was measured; else none.

        All or none: a structure sent solo beside others that share buckets
        trains in places of the same budget, one solo trial per place, while
        the buckets hold the others. Measured on the 4-width sweep (FIFO, 32
        trials, 2 cores): its width-256 group measured 1.29x and went solo
        while the narrower widths shared buckets, and the sweep ran at 0.70x
        plain Tune against 0.99-1.16x with every width in buckets.

        And for the run: once a seating of it shares buckets, later ones do
        too, whatever their new structures measure (the same queue for the
        same places, across seatings)."""
        if self._run_fuses:
            return set()
        measured = {key for key in keys if key in self._gains}
        if measured and all(self.trains_solo(key, floor) for key in measured):
            return measured
        self._run_fuses = self._run_fuses or bool(measured)
        return set()


def measuring_order(samples: Mapping[Hashable, list], family: Callable[[Hashable], Hashable],
                    batch_size: Callable[[Hashable], int]) -> list[tuple[Hashable, list[Hashable]]]:
    """The structures of ``samples`` (:meth:`FusionVerdicts.to_measure`) to
    measure, in order, each with its kin: the other structures of its family
    (``family(key)``: the same structure at other batch sizes), which take its
    verdict where it gains too little. Per family the one with the smallest
    batch size is measured (ties: the one with more members), and the families
    in order of their members, most first.

    Why one per family: on a CPU the seat that first brings a structure waits
    for its measurement, and so does Tune's first trial. The PyTorch tutorial's
    sweep seats 6 structures of one CNN at once (4 batch sizes, 2 width
    groups): measuring each took 4.2 s before its first trial could start
    (2-core machine), and each gained 0.64-0.91x. Why the smallest batch:
    fusing gains by sharing a step's fixed costs among members, and a larger
    batch is a larger share of compute, so gains less (the tutorial's CNN,
    quiet: 1.5-1.6x at batch 2, 1.1-1.3x at 4, 0.7-1.0x at 8 and 16). Where
    that structure gains too little, its kin would too. Not across widths
    (width groups are families apart): a wider group gains less too, but
    which of two groups is the narrower their keys do not say, and a wide
    group measured in place of a narrow one would send the narrow one solo
    (the 4-width grid: 2.8-3.4x at widths 32-64, 1.3x at 256)."""
    families: dict[Hashable, list[Hashable]] = {}
    for key in samples:
        families.setdefault(family(key), []).append(key)
    order = []
    for keys in families.values():
        keys.sort(key=lambda k: (batch_size(k), -len(samples[k])))
        order.append((keys[0], keys[1:]))
    order.sort(key=lambda item: -sum(len(samples[k]) for k in [item[0], *item[1]]))
    return order
