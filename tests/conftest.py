"""What the test modules share: the local Ray fixture and the ``ray`` marker
(and ``unfused_copies``, for the core's tests of a bucket's unfused copies).

A module that needs a Ray instance says so with
``pytestmark = pytest.mark.usefixtures("local_ray")``. Those modules share one
instance (``address="local"``: another Ray may run on this machine), and the
pool actor of this process's job with it, and run one after another: starting
Ray and a pool cost most of a small sweep's time (measured on this 2-core
machine: a 4-trial, 2-iteration sweep took 34 s in a fresh Ray and 3.6 s in
the next run after it). A module that needs a Ray of another shape (a fake
cluster, declared GPUs, the dashboard) shuts it down and starts its own; the
next module using ``local_ray`` starts a fresh one. The modules that look at
Ray's dashboard and metrics endpoint share a head of that shape in the same way
(``observed_ray``). After each module the
instance must be free again (every CPU back, within 30 s), or it is shut down
so that no module inherits another's leftovers. Every test that runs Ray — through this fixture,
a fake cluster (``cluster`` marker), or its own (``pytestmark =
pytest.mark.ray``) — carries the ``ray`` marker, so ``make test-core``
(``-m "not ray"``) is the fast, Ray-free suite for the inner loop.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import time
import warnings
import weakref

import pytest
import ray
import torch

# The tests' own torch work (references, core buckets) at one thread: on this
# 2-core machine, busy with the suite's other pytest and Ray workers, two
# OpenMP threads spin for each other (measured: a 4-iteration digits reference
# took 0.9-1.5 CPU-s at 2 threads, 0.03 at 1), and results are bit for bit the
# same (measured at 1, 2 and 4 threads: tests/stable_settings.py). Ray workers
# set their own (buckets: ChorusBucket's thread count).
torch.set_num_threads(1)

# torch.optim's first use paid once for the whole suite (it imports torch._dynamo):
# a bucket trains a lone member unfused only once it is (bucket_lone.py), and without
# this a test's route would depend on whether an earlier test had used torch.optim.
# The tests of the cold case say so (``torch_optim_cold``).
from chorus_tune.unfused import warm_torch_optim  # noqa: E402

warm_torch_optim()


@pytest.fixture(autouse=True)
def _buckets_whatever_fusing_gains(monkeypatch):
    """Every ChorusTrainable a test makes without ``solo_below`` keeps its members
    in buckets, whatever fusing them would gain (``solo_below=None``). Why: the
    pool decides by timing a few fused steps against steps alone
    (rules/fusion_verdicts.py), and on this shared, busy machine a burst of
    load could move a test's members into solo trials, which the tests of
    anything else do not expect. The rule's own tests (test_fusion_*.py,
    test_solo_ray.py) set it, and the examples, run as scripts, keep the default."""
    from chorus_tune.tune.trial.trainable import ChorusTrainable

    monkeypatch.setattr(ChorusTrainable, "solo_below", None)


_SHARED: dict[str, str | None] = {"gcs_address": None}
FREE_WAIT_S = 30.0


def _shared_ray_is_up() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().gcs_address == _SHARED["gcs_address"]


def _wait_until_free(timeout_s: float) -> bool:
    """Whether every CPU of the instance came back within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="module")
def local_ray():
    """The suite's shared local Ray (2 CPUs, no dashboard): see the module docstring."""
    if not _shared_ray_is_up():
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
        _SHARED["gcs_address"] = ray.get_runtime_context().gcs_address
    yield
    if ray.is_initialized() and not _wait_until_free(FREE_WAIT_S):
        # Said, not silent: a restart costs the next module its Ray and its pool.
        warnings.warn(f"local_ray: not free after {FREE_WAIT_S:.0f} s, shut down; held by {_held()}", stacklevel=1)
        ray.shutdown()


def _held() -> str:
    """The CPUs in use, the actors alive by class and job, the placement groups not removed by job, and
    the jobs that ended: what kept the instance from being free."""
    try:
        alive = collections.Counter(f"{a.get('ActorClassName')} (job {a.get('JobID')})"
                                    for a in ray._private.state.actors().values() if a.get("State") == "ALIVE")
        used = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
        # A placement group's id ends with its creator's job id.
        table = ray.util.placement_group_table()
        groups = collections.Counter(f"{g['state']} {g['bundles']} (job {pg_id[-8:]})"
                                     for pg_id, g in table.items() if g["state"] != "REMOVED")
        dead_jobs = sorted(j.get("JobID") for j in ray._private.state.jobs() if j.get("IsDead"))
        return (f"{used:g} CPU in use; alive: {dict(alive)}; placement groups: {dict(groups)}; "
                f"jobs ended: {dead_jobs}")
    except Exception as exc:  # noqa: BLE001 - a diagnosis only
        return f"(could not tell: {exc!r})"


_OBSERVED: dict = {}  # the observed head while it runs: "head", "metrics_port", "stack"
_NEXT_ITEM: dict = {"item": None}  # the test after the one running: whether it still needs that head


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # A test not marked ``ray`` runs in the Ray-free half of the suite, beside the
    # Ray tests: one that starts a Ray node there (``ray.get_runtime_context()``,
    # ``ray.get_actor()``... start one when none runs) competes with theirs, and a
    # start that timed out under that load failed CI once. It fails here, at once.
    was_up = ray.is_initialized()
    outcome = yield
    if not was_up and ray.is_initialized() and item.get_closest_marker("ray") is None:
        ray.shutdown()
        pytest.fail("this test is not marked `ray` (make test-core runs it without Ray) but started "
                    "a Ray node: mark it, use the local_ray fixture, or keep it from Ray", pytrace=False)
    return outcome


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _NEXT_ITEM["item"] = nextitem


@pytest.fixture(scope="module")
def observed_ray():
    """A Ray started as a user starts one (``ray start --head``, its dashboard
    and token authentication), exporting metrics every second on a port of its
    own, this process connected: ``(RayHead, metrics port)``. The modules that
    use it run one after another (see ``pytest_collection_modifyitems``) and
    share it, as the ``local_ray`` modules share theirs: starting one costs
    about 8 s here. It stops after the last of them."""
    from dashboard_support import free_port, ray_head

    if "head" not in _OBSERVED or not ray.is_initialized():
        _stop_observed()
        if ray.is_initialized():
            ray.shutdown()
        stack, port = contextlib.ExitStack(), free_port()
        head = stack.enter_context(ray_head(num_cpus=2, metrics_export_port=port,
                                            system_config={"metrics_report_interval_ms": 1000}))
        _OBSERVED.update(head=head, metrics_port=port, stack=stack)
    yield _OBSERVED["head"], _OBSERVED["metrics_port"]
    following = _NEXT_ITEM["item"]
    if following is None or "observed_ray" not in following.fixturenames:
        _stop_observed()


def _stop_observed() -> None:
    stack = _OBSERVED.pop("stack", None)
    _OBSERVED.clear()
    if stack is not None:
        stack.close()


@pytest.fixture(scope="module")
def script_ray_env(local_ray) -> dict[str, str]:
    """What a script a test starts needs in its environment to join the shared
    Ray as a driver (a job) of its own, as a user's script joins a running
    one, instead of starting Ray again (about 6 s of a 20 s example run here):
    its address, and the instance's auth token where the script's ``HOME``
    differs from this process's (a new local Ray writes its token to
    ``~/.ray/auth_token`` and requires it from every driver)."""
    env = {"RAY_ADDRESS": _SHARED["gcs_address"]}
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        if name in os.environ:
            env[name] = os.environ[name]
    token = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    if not {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & set(env) and os.path.exists(token):
        env["RAY_AUTH_TOKEN_PATH"] = token
    return env


@pytest.fixture
def vmap_times_faster(monkeypatch):
    """The route probe's timing says vmap is the faster route. Timed for real,
    eager may win on a loaded machine, and a bucket on eager never probes a
    newcomer, and a test of what the probe does with one would check nothing."""
    from chorus_tune import route

    monkeypatch.setattr(route, "time_routes", lambda step, routes, sync, reset=None: {
        r: (0.5 if r == "vmap" else 1.0) for r in routes})
    # And where training's own steps time the routes (RouteChoice.time_in_training).
    record_step = route.RouteChoice.record_step
    monkeypatch.setattr(route.RouteChoice, "record_step",
                        lambda self, r, seconds: record_step(self, r, 0.5 if r == "vmap" else 1.0))


@pytest.fixture
def torch_optim_cold(monkeypatch):
    """As in a process where ``torch.optim`` was never used (this one has: above)."""
    from chorus_tune import bucket_lone

    monkeypatch.setattr(bucket_lone, "torch_optim_ready", lambda: False)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "local_ray" in item.fixturenames or item.get_closest_marker("cluster") is not None:
            item.add_marker(pytest.mark.ray)
    # The modules on a shared Ray run one after another (in their own order):
    # a module with a Ray of its own between two of them would make the second
    # start Ray again. The observed head's first, the local one's last.
    items.sort(key=lambda item: ("local_ray" in item.fixturenames, "observed_ray" not in item.fixturenames))


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    # Modules that start Ray themselves may leave it running: shut it down
    # while the interpreter is whole.
    _stop_observed()
    if ray.is_initialized():
        ray.shutdown()
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # After the last report is written, leave without the interpreter's
    # teardown. Twice, a full run's pytest process died there with SIGSEGV
    # after every test had passed or failed and the summary was printed: the
    # kernel log showed a non-main thread jumping into freed memory (a native
    # callback outliving the Python objects it called, torch's or Ray's), which
    # turned the run's own exit status into make's "Segmentation fault". The
    # status exited with is pytest's own.
    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


@pytest.fixture
def unfused_copies(monkeypatch) -> list:
    """A weak reference to every ``UnfusedMember`` built during the test, in
    order: which of a bucket's unfused copies are still alive (after
    ``gc.collect()``), where each is a second copy of a member's model."""
    from chorus_tune.unfused import UnfusedMember

    built: list[weakref.ref] = []
    real_init = UnfusedMember.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(weakref.ref(self))

    monkeypatch.setattr(UnfusedMember, "__init__", init)
    return built
