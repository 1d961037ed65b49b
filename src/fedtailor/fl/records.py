"""Typed records that cross the client/server boundary, and the data a client holds.

A :class:`Message` is a plain record — named arrays plus scalar/bytes config — that could cross a network even
when the loop runs in one process (Flower's ``RecordDict`` has the same shape). The server validates every
reply with the helpers here before it touches its state.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Scalar = int | float | str | bool | bytes
Metrics = dict[str, float]


class TrainingDiverged(ValueError):
    """Training produced a non-finite loss or metric, or a finite loss past :data:`LOSS_LIMIT`: the run stops
    instead of reporting garbage (:func:`check_diverged`). ``fedtailor run`` then exits with :attr:`EXIT_STATUS`,
    which ``fedtailor reproduce`` records as the run's outcome (a tuning grid's largest step may diverge)."""

    EXIT_STATUS = 3
    HINT = (
        "the run diverged and is stopped (no results are written). Usual causes: a learning rate too large "
        "for the model (method.lr), or in a private run noise far above the signal (a very small "
        "method.privacy.epsilon, hence a huge sigma)."
    )

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: {self.HINT}")


#: A loss above this is divergence even when finite. Every loss fedtailor reports is a mean over records of a
#: cross-entropy (about log(classes) at the start: 2.3 for 10 classes, 4.6 for 100) or a DPO loss (log 2 at
#: the start); a mean above 10^6 needs logits about 10^6 apart, which only an exploding model has (FedPer at
#: lr 1e6 reaches 8e24 in its first round). Keys: ``loss`` and any key ending in ``loss`` (``seen/loss``).
LOSS_LIMIT = 1e6


def diverged_keys(record: Mapping[str, Any]) -> list[str]:
    """The keys of a round's record (or an evaluation summary) that show divergence: non-finite floats, and
    losses (``loss``, ``*loss``) above :data:`LOSS_LIMIT`."""
    bad = []
    for k, v in record.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            continue
        if not math.isfinite(v) or (k.endswith("loss") and v > LOSS_LIMIT):
            bad.append(k)
    return sorted(bad)


def check_diverged(record: Mapping[str, Any], rnd: int, phase: str) -> None:
    """Raise :class:`TrainingDiverged` naming the round, the phase (``"training"``, ``"evaluation"``) and each
    value of :func:`diverged_keys`; the drop-in rule for a driver's check of a round's record."""
    bad = diverged_keys(record)
    if bad:
        what = ", ".join(f"{k} = {float(record[k]):.3g}" for k in bad)
        finite = any(math.isfinite(record[k]) for k in bad)
        limit = f" (a loss above {LOSS_LIMIT:.0e} is divergence)" if finite else ""
        raise TrainingDiverged(f"round {rnd}: {phase} gave {what}{limit}")


class InvalidMessage(ValueError):
    """A reply that the server rejects (wrong shape, dtype, non-finite values, missing fields, bad bytes)."""


class Abstained(InvalidMessage):
    """A client's fixed-size abstention in place of a release it could not send at the fixed size: not
    aggregated, charged as the release it replaces, and counted apart from rejections."""


class RequestRefused(ValueError):
    """A client refuses what the server asks of it (a noise scale below its own calibration, a round it has
    already released for or is not scheduled in, another message size): nothing is released."""


class RoundRejected(ValueError):
    """Every reply of a round was rejected: the run stops with the reasons instead of a silent round."""


#: Largest magnitude a received float may have: the square of anything larger overflows float32, so no norm or
#: mean of it is meaningful (no trained model comes near it; a hostile 1e30 does).
MAX_MAGNITUDE = 2.0**64


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

    def array(
        self, name: str, *, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None, finite: bool = True
    ) -> torch.Tensor:
        """The array ``name``, checked: present, a tensor of ``shape`` and exactly ``dtype``, finite and below
        :data:`MAX_MAGNITUDE` if floating. Raises InvalidMessage."""
        if name not in self.arrays:
            raise InvalidMessage(f"message lacks array {name!r} (has {sorted(self.arrays)[:5]}).")
        t = self.arrays[name]
        if not isinstance(t, torch.Tensor):
            raise InvalidMessage(f"array {name!r} is a {type(t).__name__}, expected a tensor.")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise InvalidMessage(f"array {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}.")
        if dtype is not None and t.dtype != dtype:
            raise InvalidMessage(f"array {name!r} has dtype {t.dtype}, expected {dtype}.")
        if finite and t.is_floating_point() and t.numel():
            # one pass, no copy: NaN propagates to both extremes, an infinity is one of them
            low, high = (float(v) for v in torch.aminmax(t))
            if not (math.isfinite(low) and math.isfinite(high)):
                raise InvalidMessage(f"array {name!r} contains NaN or infinite values.")
            if max(-low, high) > MAX_MAGNITUDE:
                raise InvalidMessage(f"array {name!r} holds values beyond {MAX_MAGNITUDE:.3g} in magnitude.")
        return t

    def only(
        self, *, arrays: set[str] | frozenset[str] = frozenset(), config: set[str] | frozenset[str] = frozenset()
    ) -> None:
        """Refuse any array or config key outside the given sets (a reply carries what was asked, nothing
        else). Raises InvalidMessage."""
        extra = sorted(set(self.arrays) - set(arrays)) + sorted(set(self.config) - set(config))
        if extra:
            raise InvalidMessage(f"reply carries unexpected fields {extra[:5]}.")

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


def check_weight(reply: Message, cid: int, sizes: dict[int, int] | None) -> int:
    """A reply's ``num_examples`` as an aggregation weight: a positive int, at most the client's number of
    training records when the server knows them (``sizes``: the partition, public to the server), so that no
    reply can claim more weight than its client holds. Raises InvalidMessage."""
    n = reply.value("num_examples", int)
    cap = None if sizes is None else sizes.get(cid)
    if sizes is not None and cap is None:
        raise InvalidMessage(f"client {cid} is not a client of this run.")
    if n <= 0 or (cap is not None and n > cap):
        raise InvalidMessage(f"num_examples must lie in [1, {cap}] (the client's number of records), got {n}.")
    return n


def check_metrics(metrics: object, *, finite: bool = True) -> Metrics:
    """An evaluation reply as the server may use it: a dict of metric names to numbers (finite ones unless
    ``finite`` is False: the run's own clients, whose non-finite metrics mean divergence, which the driver then
    reports) that includes a positive ``num_examples``. Raises InvalidMessage."""
    if not isinstance(metrics, dict) or not metrics:
        raise InvalidMessage(f"an evaluation reply must be a dict of metrics, got {type(metrics).__name__}.")
    out: Metrics = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidMessage(f"evaluation metric {k!r} must be a number, got {v!r}.")
        if finite and not math.isfinite(v):
            raise InvalidMessage(f"evaluation metric {k!r} must be finite, got {v!r}.")
        if finite and abs(v) > MAX_MAGNITUDE:
            raise InvalidMessage(f"evaluation metric {k!r} = {v!r} is beyond {MAX_MAGNITUDE:.3g} in magnitude.")
        out[k] = float(v)
    if out.get("num_examples", 0.0) <= 0:
        raise InvalidMessage("an evaluation reply must report a positive num_examples.")
    return out


@dataclass
class ClientData:
    """What one client holds. For image tasks ``train``/``eval`` are (x, y) tensor pairs and ``context`` an x
    tensor; other methods (e.g. preference data) put their own records here. ``val``: validation records held
    out of the training records besides ``eval`` (``data.validation_mode = "alongside"``); the client's
    evaluation reply then also holds its metrics on them (:func:`fedtailor.fl.loop.evaluate_client`)."""

    cid: int
    seen: bool
    train: Any = None
    eval: Any = None
    context: Any = None
    val: Any = None
