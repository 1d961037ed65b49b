"""fedtailor :class:`~fedtailor.fl.records.Message` <-> Flower ``RecordDict``, losslessly.

Arrays travel in an ``ArrayRecord`` named ``"arrays"`` (torch tensors with their dtype and shape), config
values in a ``ConfigRecord`` named ``"config"`` (int, float, str, bool and bytes as they are). A client's
persistent state is kept in its node's ``context.state`` as bytes (``torch.save`` of the state object)."""

from __future__ import annotations

import io
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedtailor.fl.records import InvalidMessage, Message

STATE_KEY = "fedtailor-client-state"


def to_records(msg: Message) -> RecordDict:
    arrays = ArrayRecord(torch_state_dict={k: v.detach().cpu().contiguous() for k, v in msg.arrays.items()})
    return RecordDict({"arrays": arrays, "config": ConfigRecord(dict(msg.config))})


def from_records(records: RecordDict) -> Message:
    try:
        arrays = records["arrays"].to_torch_state_dict() if "arrays" in records else {}
        config = dict(records["config"]) if "config" in records else {}
    except Exception as err:  # noqa: BLE001 - a malformed record from the network
        raise InvalidMessage(f"unreadable Flower records: {type(err).__name__}: {err}") from None
    return Message(arrays=dict(arrays), config=config)


def state_to_bytes(state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def state_from_bytes(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)  # written by this node itself, never by the server
