#!/usr/bin/env bash
# The whole suite, as `make test` runs it: the Ray tests (`-m ray`) in one
# pytest, and beside them, at the same time, the Ray-free tests (`-m "not ray"`)
# in a second one, whose report is printed after the first's.
#
# Why two at once: run one after another on 2 cores, the Ray tests leave a
# core idle for much of their time (actor processes starting one at a time,
# sweeps waiting on a bucket or a timeout: 377 of 1,560 core-seconds idle in a
# full run measured here), while the Ray-free tests (86 s alone, about 70
# CPU-seconds, mostly one thread) need no Ray and fit in those gaps.
# Tried and measured, not kept (the first pytest's time; 601 s as it is):
# the fake clusters in the second pytest too, 654 s (their raylets kept both
# cores busy); the dashboard head's modules there instead, 631 s; the fake
# clusters last in the first pytest, so that the Ray-free tests run beside the
# local Ray's tests only, 656 s. Runs here vary by tens of seconds.
#
# Arguments go to both pytests (`make test PYTEST_ARGS=...`). pytest exits 5
# when it collected nothing: that is fine for one half (arguments that select
# only Ray tests, or none), and a failure when both collected nothing.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

# chorus_tune's bytecode, compiled once here: every Ray worker (about 300 a
# run: trial actors, buckets, pools) imports it, and where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines) none may write
# it, so each compiled the sources again. Measured: a bucket's chorus_tune
# imports took 0.2 CPU-s less with the bytecode there.
"$PY" -m compileall -q chorus_tune >/dev/null

core_log=$(mktemp)
core_pid=""
finish() {
    if [ -n "$core_pid" ]; then kill "$core_pid" 2>/dev/null; fi
    rm -f "$core_log"
}
trap finish EXIT
trap 'exit 130' INT TERM

# No cache plugin in the Ray-free half: two pytests writing .pytest_cache at once would race.
# At the lowest priority: it is there to fill the Ray tests' idle core, not to
# take a core they could use. Ray starts its workers (trial actors, buckets,
# pools) at nice 15 (RAY_worker_niceness), so at nice 0 these tests took about
# 97% of any core they shared with one (CFS weights 1024 against 36), and at
# nice 19 about 30% (15 against 36). Measured, the Ray tests of one commit:
# 575 s alone, 672 s beside the Ray-free tests at nice 0, 608 s beside them at
# nice 19. Under SCHED_IDLE (weight 3 against 36) they take less again:
# three Ray test modules (trainable, idioms, metrics) ran in 98 and 102 s
# beside them at nice 19 and in 87 and 83 s beside them under SCHED_IDLE
# (alternated; a CPU-bound loop measured the same: about 26% of a core it
# shared with two nice-15 loops at nice 19, about 7% under SCHED_IDLE). They
# then take longer (267-330 s in a working clone, 507 and 570 s in two
# clean-clone CI runs, once 1 s after the Ray tests): that costs the suite
# nothing, since once the Ray tests end they get both cores.
# chrt sets it where the kernel allows (any user may lower their own class).
idle_class=()
if command -v chrt >/dev/null 2>&1 && chrt --idle 0 true 2>/dev/null; then
    idle_class=(chrt --idle 0)
fi
nice -n 19 ${idle_class[@]+"${idle_class[@]}"} "$PY" -m pytest -q -m "not ray" -p no:cacheprovider "$@" >"$core_log" 2>&1 &
core_pid=$!

"$PY" -m pytest -q -m ray "$@"
ray_rc=$?

wait "$core_pid"
core_rc=$?
core_pid=""
echo
echo "===== the Ray-free tests (-m 'not ray'), run beside the Ray tests above ====="
cat "$core_log"
echo "===== Ray tests: exit $ray_rc; Ray-free tests: exit $core_rc ====="

if [ "$ray_rc" -eq 5 ] && [ "$core_rc" -eq 5 ]; then
    exit 5
fi
for rc in "$ray_rc" "$core_rc"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit "$rc"
    fi
done
exit 0
