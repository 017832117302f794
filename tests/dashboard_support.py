"""Ray's dashboard for tests: a Ray of the test's own, started as a user
starts one, and headless Chromium to look at it.

:func:`ray_head` runs ``ray start --head`` with every port a free one.
ray.init() puts the dashboard's node agent on port 52365, and where another
Ray on the machine holds that port the agent serves nothing (no logs, no CPU
or memory columns).

:class:`Chromium` is driven over the DevTools protocol.
``chromium --headless --dump-dom URL`` renders a page, but it cannot log in:
Ray 2.60's dashboard asks for a token first (an HttpOnly cookie that its
``/api/authenticate`` sets). Driving the browser over the DevTools protocol
lets a test do what a user does in the token dialog (post the token to
``/api/authenticate`` from the page), then read the rendered page and take a
screenshot. The protocol is JSON over a WebSocket; aiohttp (a dependency of
``ray[default]``) speaks it.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import ray

# Headless in a container: no sandbox (no user namespaces), no GPU, and none
# of the background traffic a fresh profile would start.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")
_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """A Chromium binary: ``$CHROMIUM`` if set, else the first of the usual names on PATH."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return next((path for path in map(shutil.which, _NAMES) if path), None)


class BrowserError(RuntimeError):
    """The browser did not start, or a DevTools command failed."""


class Chromium:
    """One headless Chromium with one page of ``width`` x ``height`` CSS pixels,
    driven synchronously.

    Use as a context manager; the browser and its fresh profile are gone after.
    """

    def __init__(self, binary: str, width: int = 1600, height: int = 1000, start_timeout_s: float = 60.0):
        self._profile = tempfile.mkdtemp(prefix="chorus-chromium-")
        self._process = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
             "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)
        try:
            port = self._devtools_port(start_timeout_s)
            self._session, self._ws = self._run(self._connect(port))
            # The page's size, whatever the window decorations take: screenshots are exactly this.
            self.command("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                         mobile=False)
        except BaseException:
            self.close()
            raise

    # ----- plumbing -------------------------------------------------------------------------------
    def _run(self, coroutine):
        return self._loop.run_until_complete(coroutine)

    def _devtools_port(self, timeout_s: float) -> int:
        # Chromium writes the port it chose (port 0: any free one) into the profile.
        path = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise BrowserError(f"chromium exited with {self._process.returncode} before it listened")
            if path.exists() and path.read_text().strip():
                return int(path.read_text().split()[0])
            time.sleep(0.1)
        raise BrowserError(f"chromium did not open its DevTools port within {timeout_s}s")

    async def _connect(self, port: int):
        session = aiohttp.ClientSession()
        async with session.get(f"http://127.0.0.1:{port}/json/list") as reply:
            targets = await reply.json()
        page = next(t for t in targets if t["type"] == "page")
        ws = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        return session, ws

    async def _send(self, method: str, params: dict | None = None) -> dict:
        ident = next(self._ids)
        await self._ws.send_json({"id": ident, "method": method, "params": params or {}})
        while True:  # events arrive in between; only our answer matters
            message = json.loads((await self._ws.receive()).data)
            if message.get("id") == ident:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message["result"]

    def command(self, method: str, **params: Any) -> dict:
        """Send one DevTools command and return its result."""
        return self._run(self._send(method, params))

    # ----- what tests use -------------------------------------------------------------------------
    def goto(self, url: str) -> None:
        """Open ``url`` (returns once the navigation is committed, not rendered)."""
        self.command("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises are awaited)."""
        result = self.command("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll until ``expression`` is truthy in the page (a page renders from
        data it fetches after loading); returns its value, or raises."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserError:
                value = None  # the page is between documents
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout_s}s: {expression}")
            time.sleep(0.25)

    def dom(self) -> str:
        """The rendered document, as ``--dump-dom`` prints it."""
        return self.evaluate("document.documentElement.outerHTML")

    def screenshot(self, path: str | os.PathLike) -> Path:
        """A PNG of the page as rendered now."""
        data = self.command("Page.captureScreenshot", format="png")["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        """Stop the browser and remove its profile."""
        try:
            if getattr(self, "_ws", None) is not None:
                self._run(self._ws.close())
            if getattr(self, "_session", None) is not None:
                self._run(self._session.close())
        finally:
            self._loop.close()
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The rows of every table on the page, as the user reads them: one list of
# cell texts per row, header rows included.
TABLE_ROWS_JS = ("Array.from(document.querySelectorAll('tr')).map("
                 "tr => Array.from(tr.querySelectorAll('th,td')).map(c => c.innerText.trim()))")


def login(browser: Chromium, dashboard: str, token: str | None) -> int | None:
    """Do what the dashboard's token dialog does: post the token from the page
    to ``/api/authenticate``, which sets the session cookie. Returns the HTTP
    status (200 when the token is good), or ``None`` when no token is needed."""
    browser.goto(dashboard)
    mode = browser.wait_for("fetch('/api/authentication_mode').then(r => r.json())"
                            ".then(j => j.authentication_mode)")
    if mode != "token":
        return None
    if token is None:
        raise BrowserError("the dashboard asks for a token and none was given")
    return browser.evaluate(f"fetch('/api/authenticate', {{method: 'POST', headers: "
                            f"{{Authorization: 'Bearer ' + {json.dumps(token)}}}}}).then(r => r.status)")


# ----- a Ray with its dashboard ------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial_actors(dashboard: str) -> list:
    """Every ``ChorusTrainable`` actor the state API of ``dashboard`` lists, alive or not, with details."""
    from ray.util.state import list_actors

    return list_actors(address=dashboard, filters=[("class_name", "=", "ChorusTrainable")], limit=10_000,
                       detail=True)


def auth_token() -> str:
    """What ``ray get-auth-token`` prints: the README tells a user to run it
    (``--generate`` makes one where the machine has none yet, as a first
    ray.init() would)."""
    ray_cli = Path(sys.executable).with_name("ray")
    return subprocess.run([str(ray_cli), "get-auth-token", "--generate"], check=True, capture_output=True,
                          text=True).stdout.strip()


@dataclasses.dataclass(frozen=True)
class RayHead:
    """A running Ray started by :func:`ray_head`."""

    dashboard: str  # the dashboard's URL
    token: str | None  # what `ray get-auth-token` prints; None where RAY_AUTH_MODE=disabled
    temp_dir: str  # its --temp-dir (where its session_latest is)


@contextlib.contextmanager
def ray_head(num_cpus: int = 2, metrics_export_port: int | None = None,
             system_config: dict | None = None) -> Iterator[RayHead]:
    """A Ray of the caller's own, started with ``ray start --head``, its
    dashboard and token authentication, this process connected to it.

    ``--block`` ties the cluster's processes to that one command, so stopping
    it stops only them. A temp dir of its own keeps other Rays from finding it
    (and it from finding them). This process connects as ``address="auto"``:
    an explicit address would not turn token authentication on here.
    """
    token = None if os.environ.get("RAY_AUTH_MODE") == "disabled" else auth_token()
    # With a token on the machine, `ray start` turns authentication on.
    dashboard_port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live below it
    command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--num-cpus={num_cpus}",
               f"--port={free_port()}", f"--temp-dir={temp_dir}", "--include-dashboard=true",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", "--dashboard-agent-listen-port=0",
               f"--ray-client-server-port={free_port()}", "--disable-usage-stats"]
    if metrics_export_port is not None:
        command.append(f"--metrics-export-port={metrics_export_port}")
    if system_config:
        command.append(f"--system-config={json.dumps(system_config)}")
    head = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = []
        for line in head.stdout:  # it says so once the cluster is up, and then blocks
            said.append(line)
            if "block forever" in line:
                break
        else:
            raise RuntimeError(f"`ray start --head` exited with {head.wait()}:\n{''.join(said)}")
        threading.Thread(target=head.stdout.read, daemon=True).start()  # never let its pipe fill
        ray.init(address="auto", _temp_dir=temp_dir, configure_logging=False)
        yield RayHead(f"http://127.0.0.1:{dashboard_port}", token, temp_dir)
    finally:
        ray.shutdown()
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
