"""Member states as bytes.

A member state (docs/design.md D7) travels through trial actors and Tune checkpoints
as opaque bytes: trial actors never unpickle it, so they hold no tensors and
need no torch of their own to pass it on.
"""
from __future__ import annotations

import io
from typing import Any

# torch is imported inside the functions: this module is imported wherever a
# bucket actor handle is deserialised, trial actors included, and those must
# not load torch.


def dumps(state: dict[str, Any]) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def loads(blob: bytes) -> dict[str, Any]:
    import torch

    # Our own bytes (a bucket's member_state), not an arbitrary file: the full
    # unpickler is needed for the optimizer and data-order entries.
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
