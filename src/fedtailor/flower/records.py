"""fedtailor :class:`~fedtailor.fl.records.Message` <-> Flower ``RecordDict``, losslessly.

Arrays travel in an ``ArrayRecord`` named ``"arrays"`` (torch tensors with their dtype and shape), config
values in a ``ConfigRecord`` named ``"config"`` (int, float, str, bool and bytes as they are). A client's
persistent state is kept in its node's ``context.state`` as bytes (``torch.save`` of the state object), read
back with ``weights_only=True`` on tensors and fedtailor's state classes alone (:mod:`fedtailor.safeload`):
state bytes that name anything else (``os.system``, a function) are refused before unpickling."""

from __future__ import annotations

import io
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedtailor.fl.records import InvalidMessage, Message
from fedtailor.safeload import UnsafeGlobal, load_state

STATE_KEY = "fedtailor-client-state"


def to_records(msg: Message) -> RecordDict:
    arrays = ArrayRecord(torch_state_dict={k: v.detach().cpu().contiguous() for k, v in msg.arrays.items()})
    return RecordDict({"arrays": arrays, "config": ConfigRecord(dict(msg.config))})


def from_records(records: RecordDict) -> Message:
    try:
        arrays = records["arrays"].to_torch_state_dict() if "arrays" in records else {}
        config = dict(records["config"]) if "config" in records else {}
    except Exception as err:
        raise InvalidMessage(f"unreadable Flower records: {type(err).__name__}: {err}") from None
    return Message(arrays=dict(arrays), config=config)


def state_to_bytes(state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


class UnsafeClientState(ValueError):
    """A node's stored client state names something that is not fedtailor state; it is not loaded."""


def state_from_bytes(blob: bytes) -> Any:
    """The client state :func:`state_to_bytes` wrote; :class:`UnsafeClientState` for bytes that would run code
    (or name anything but tensors, fedtailor's state classes and plain data)."""
    try:
        return load_state(blob)
    except UnsafeGlobal as err:
        raise UnsafeClientState(
            f"the client state in this node's context.state ({STATE_KEY!r}) refers to {err.name!r}, which no "
            "fedtailor client state holds; it was not written by fedtailor (or was altered) and is not "
            "loaded. Restart the SuperNode with a fresh state."
        ) from None
