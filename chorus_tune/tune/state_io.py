"""Member states as bytes.

A member state (DESIGN D7) travels through trial actors and Tune checkpoints
as opaque bytes: trial actors never unpickle it, so they hold no tensors and
need no torch of their own to pass it on.
"""
from __future__ import annotations

import io
from typing import Any

import torch


def dumps(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def loads(blob: bytes) -> dict[str, Any]:
    # Our own bytes (a bucket's member_state), not an arbitrary file: the full
    # unpickler is needed for the optimizer and data-order entries.
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
