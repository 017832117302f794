"""Member states as bytes.

A member state (docs/design.md D7) travels through trial actors and Tune checkpoints
as opaque bytes: trial actors never unpickle it, so they hold no tensors and
need no torch of their own to pass it on.

The bytes are a zip archive (stored, not compressed) of two ``torch.save``
files: ``weights.pt``, the member's model ``state_dict`` alone (tensors only,
each holding just its own values), which loads with
``torch.load(weights_only=True)``; and ``state.pt``, the rest of the state
(optimizer, data order, ...), which needs the full unpickler. So a trial takes
the weights out with ``zipfile`` alone (:func:`weights_bytes`) and writes them
into its checkpoint as a file that loads without running code (issue 40).
Bytes saved before this (one ``torch.save`` of the whole state) still load.
"""
from __future__ import annotations

import io
import zipfile
from typing import Any

# torch is imported inside the functions: this module is imported wherever a
# bucket actor handle is deserialised, trial actors included, and those must
# not load torch.

FORMAT_ENTRY, FORMAT = "format", b"chorus-member-state/2"
WEIGHTS_ENTRY, REST_ENTRY = "weights.pt", "state.pt"


def dumps(state: dict[str, Any]) -> bytes:
    import torch

    rest = {k: v for k, v in state.items() if k != "model"}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(FORMAT_ENTRY, FORMAT)
        archive.writestr(WEIGHTS_ENTRY, _torch_bytes(torch, {k: _own(v) for k, v in state["model"].items()}))
        archive.writestr(REST_ENTRY, _torch_bytes(torch, rest))
    return buffer.getvalue()


def loads(blob: bytes) -> dict[str, Any]:
    import torch

    archive = _archive(blob)
    if archive is None:  # saved before the weights had a file of their own
        return _torch_load(torch, blob, weights_only=False)
    with archive:
        # Our own bytes (a bucket's member_state), not an arbitrary file: the full
        # unpickler is needed for the optimizer and data-order entries.
        state = _torch_load(torch, archive.read(REST_ENTRY), weights_only=False)
        state["model"] = _torch_load(torch, archive.read(WEIGHTS_ENTRY), weights_only=True)
    return state


def weights_bytes(blob: bytes) -> bytes | None:
    """The ``torch.save`` bytes of the member's weights alone, taken out
    without torch; ``None`` for bytes saved before they had a file of their own."""
    archive = _archive(blob)
    if archive is None:
        return None
    with archive:
        return archive.read(WEIGHTS_ENTRY)


def _archive(blob: bytes) -> zipfile.ZipFile | None:
    # A plain torch.save file is a zip archive too, but its entries sit in a
    # folder of their own ("archive/data.pkl"): it has no top-level format entry.
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
    except zipfile.BadZipFile:
        return None
    if FORMAT_ENTRY not in archive.namelist() or archive.read(FORMAT_ENTRY) != FORMAT:
        archive.close()
        return None
    return archive


def _own(tensor):
    # torch.save writes a view's whole storage: a member's row of a bucket's
    # stack would carry every member's weights. A member state's rows are
    # copies already (Bucket.member_state); this keeps the file right if not.
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.detach().clone()
    return tensor.detach()


def _torch_bytes(torch, obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _torch_load(torch, data: bytes, weights_only: bool):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
