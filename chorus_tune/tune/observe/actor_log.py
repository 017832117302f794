"""Lines a chorus actor writes to its own log: the dashboard's Log link (docs/design.md D12).

Ray configures only its own ``ray`` logger inside a worker: an INFO line of any
other logger is dropped there (Python's last-resort handler prints WARNING and
above only). A bucket's status lines and a trial actor's "serving trial ..."
lines are INFO, so the actors route their logger to the worker's stdout,
which Ray writes to the actor's ``.out`` file, shows under the actor's Log
link and echoes to the driver.
"""
from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)s %(message)s"


class _ActorStdout(logging.StreamHandler):
    """The handler :func:`log_to_actor_stdout` adds (recognised so it is added once)."""


def log_to_actor_stdout(logger: logging.Logger) -> None:
    """Let ``logger``'s INFO lines reach this process's stdout (the actor's log).

    Leaves alone a process whose logging the user configured: when the root
    logger has handlers (``ray.init(logging_config=...)``, or the user's own),
    the lines go there, at the levels chosen there.
    """
    if logging.getLogger().handlers or any(isinstance(h, _ActorStdout) for h in logger.handlers):
        return
    handler = _ActorStdout(sys.stdout)
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
