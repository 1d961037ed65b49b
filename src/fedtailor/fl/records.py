"""Typed records that cross the client/server boundary, and the data a client holds.

A :class:`Message` is a plain record — named arrays plus scalar/bytes config — that could cross a network even
when the loop runs in one process (Flower's ``RecordDict`` has the same shape). The server validates every
reply with the helpers here before it touches its state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

Scalar = int | float | str | bool | bytes
Metrics = dict[str, float]


class TrainingDiverged(ValueError):
    """Training produced a non-finite loss or metric: the run stops instead of reporting garbage."""

    HINT = ("the run diverged and is stopped (no results are written). Usual causes: a learning rate too large "
            "for the model (method.lr), or in a private run noise far above the signal (a very small "
            "method.privacy.epsilon, hence a huge sigma).")

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: {self.HINT}")


class InvalidMessage(ValueError):
    """A reply that the server rejects (wrong shape, dtype, non-finite values, missing fields, bad bytes)."""


@dataclass
class Message:
    """Named tensors (``arrays``) and scalars or byte strings (``config``)."""

    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict[str, Scalar] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Payload size in bytes: tensor storage plus byte/str config values (the cost on a wire)."""
        n = sum(t.numel() * t.element_size() for t in self.arrays.values())
        for v in self.config.values():
            n += len(v) if isinstance(v, (bytes, str)) else 8
        return n

    def array(self, name: str, *, shape: tuple[int, ...] | None = None, finite: bool = True) -> torch.Tensor:
        """The array ``name``, checked: present, a floating tensor of ``shape``, finite. Raises InvalidMessage."""
        if name not in self.arrays:
            raise InvalidMessage(f"message lacks array {name!r} (has {sorted(self.arrays)}).")
        t = self.arrays[name]
        if not isinstance(t, torch.Tensor):
            raise InvalidMessage(f"array {name!r} is a {type(t).__name__}, expected a tensor.")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise InvalidMessage(f"array {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}.")
        if finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InvalidMessage(f"array {name!r} contains NaN or infinite values.")
        return t

    def value(self, name: str, kind: type | tuple[type, ...]) -> Any:
        """The config value ``name`` of type ``kind`` (finite if a float). Raises InvalidMessage."""
        if name not in self.config:
            raise InvalidMessage(f"message lacks config value {name!r} (has {sorted(self.config)}).")
        v = self.config[name]
        if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise InvalidMessage(f"config value {name!r} is a bool, expected {kind}.")
        if not isinstance(v, kind):
            raise InvalidMessage(f"config value {name!r} is {type(v).__name__}, expected {kind}.")
        if isinstance(v, float) and not math.isfinite(v):
            raise InvalidMessage(f"config value {name!r} is not finite: {v}.")
        return v


@dataclass
class ClientData:
    """What one client holds. For image tasks ``train``/``eval`` are (x, y) tensor pairs and ``context`` an x
    tensor; other methods (e.g. preference data) put their own records here."""

    cid: int
    seen: bool
    train: Any = None
    eval: Any = None
    context: Any = None
