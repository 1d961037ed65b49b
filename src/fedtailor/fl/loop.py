"""The in-process federated loop: one driver for every :class:`~fedtailor.fl.method.Method`.

Round ``t`` (1-based) sends ``configure_fit`` messages to the clients ``schedule[t-1]``, runs their
``client_fit`` with their persistent state, validates the replies (a rejected reply is dropped, logged and
counted; the server state is untouched), and aggregates. Every ``eval_every`` rounds and at the end, every
client is evaluated (per-client metrics; the summary averages within a client first, then over clients).

Randomness comes from explicit keys (round, client), never from a running generator, so a run resumed from a
checkpoint reproduces the uninterrupted run exactly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fedtailor.fl.method import Method
from fedtailor.fl.records import (
    Abstained,
    ClientData,
    InvalidMessage,
    Message,
    Metrics,
    RoundRejected,
    check_diverged,
    check_metrics,
)
from fedtailor.safeload import UnsafeGlobal, vetted_globals

log = logging.getLogger(__name__)

RoundCallback = Callable[[dict[str, Any]], None]


@dataclass
class LoopState:
    """Everything needed to continue a run: what a checkpoint holds."""

    round: int
    server: Any
    clients: dict[int, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RunResult:
    state: LoopState
    evaluation: dict[int, Metrics]

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.state.history


def summarize(evaluation: Mapping[int, Metrics], clients: Mapping[int, ClientData]) -> dict[str, float]:
    """Average per-client metrics over seen and over unseen (Future) clients: within a client first, then
    over clients (each client counts once, whatever its number of records)."""
    out: dict[str, float] = {}
    for group, members in (("seen", [c for c in evaluation if clients[c].seen]),
                           ("future", [c for c in evaluation if not clients[c].seen])):
        if not members:
            continue
        keys = sorted({k for c in members for k in evaluation[c] if k != "num_examples"})
        for k in keys:
            vals = [evaluation[c][k] for c in members if k in evaluation[c]]
            out[f"{group}/{k}"] = float(np.mean(vals))
    return out


def evaluate_clients(method: Method, state: LoopState, clients: Mapping[int, ClientData]) -> dict[int, Metrics]:
    """Run the evaluate phase on every client that has evaluation data (their persistent state is read, not
    changed)."""
    replies = {}
    for cid in sorted(c for c in clients if clients[c].eval is not None):
        msg = method.configure_evaluate(state.server, cid)
        replies[cid] = method.client_evaluate(msg, state.clients.get(cid, method.init_client(cid)), clients[cid])
    return accept_evaluation(replies, asked=set(replies), finite=False)  # non-finite: divergence, reported


def accept_evaluation(replies: Mapping[Any, Any], *, asked: set[int], finite: bool = True) -> dict[int, Metrics]:
    """The evaluation replies the server uses: from a client that was asked, each a dict of numeric metrics
    (finite unless ``finite`` is False) with a positive ``num_examples``
    (:func:`~fedtailor.fl.records.check_metrics`); any other is dropped and logged."""
    out = {}
    for cid, metrics in replies.items():
        try:
            if isinstance(cid, bool) or not isinstance(cid, int) or cid not in asked:
                raise InvalidMessage(f"client {cid!r} was not asked for an evaluation.")
            out[cid] = check_metrics(metrics, finite=finite)
        except InvalidMessage as err:
            log.warning("rejected evaluation reply of client %r: %s", cid, err)
    return out


def _schedule_digest(schedule: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(schedule, dtype=np.int64).tobytes()).hexdigest()[:16]


def save_checkpoint(path: Path, state: LoopState, schedule: np.ndarray) -> None:
    """Atomically write the loop state (temp file + rename: a crash mid-write never corrupts the last one)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open_private(tmp) as f:  # it may hold decoding keys (docs/privacy.md): owner-only
        torch.save({"format": 1, "schedule": _schedule_digest(schedule), "state": state}, f)
    os.replace(tmp, path)


def open_private(path: Path):
    """``path`` opened for writing with mode 0600 from its creation (files that hold keys: checkpoints, the
    Flower server state); an existing file is truncated and set to 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "wb")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not belong to this run."""


class RunInterrupted(Exception):
    """Ctrl-C during a run; ``checkpoint_round`` is where ``--resume`` continues from (0: from the start)."""

    def __init__(self, round: int, checkpoint_round: int) -> None:
        super().__init__(f"interrupted during round {round}")
        self.round, self.checkpoint_round = round, checkpoint_round
        self.run_dir: Path | None = None  # set by the runner when there is a checkpoint to resume from


def _checkpoint_globals(path: Path) -> list[Any]:
    """The classes a checkpoint's pickle names, each vetted (:func:`fedtailor.safeload.vetted_globals`):
    anything but fedtailor's state classes, safe builtins and numpy's array machinery is refused before
    unpickling."""
    try:
        return vetted_globals(path)
    except UnsafeGlobal as err:
        raise CheckpointError(
            f"checkpoint {path} refers to {err.name!r}, which no fedtailor checkpoint holds; it was not written "
            "by fedtailor (or was altered) and is not loaded. Delete it to restart the run from round 0, or "
            "start the run in a new directory with --out.") from None


def load_checkpoint(path: Path, schedule: np.ndarray) -> LoopState:
    """Read and check a checkpoint; a truncated, empty or foreign file is a :class:`CheckpointError`. Only
    tensors and fedtailor's state classes are unpickled (``weights_only=True``): a crafted file cannot run code."""
    path = Path(path)
    try:
        allowed = _checkpoint_globals(path)
        with torch.serialization.safe_globals(allowed):
            blob = torch.load(path, weights_only=True)  # tensors return to the device they were saved from
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to unpickle means the same thing to the user
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({type(err).__name__}: {str(err)[:80]}); it is damaged or not a "
            "fedtailor checkpoint. Delete it to restart the run from round 0 (the run directory is otherwise "
            "kept), or start the run in a new directory with --out."
        ) from None
    if not isinstance(blob, dict) or not isinstance(blob.get("state"), LoopState):
        raise CheckpointError(f"checkpoint {path} does not hold a fedtailor loop state; delete it to restart the "
                              "run from round 0, or start the run in a new directory with --out.")
    if blob.get("format") != 1 or blob.get("schedule") != _schedule_digest(schedule):
        raise CheckpointError(
            f"checkpoint {path} was written for a different schedule or format; "
            "resume with the same config and seed, or start a fresh run directory."
        )
    return blob["state"]


@dataclass
class Verdicts:
    """What the server made of a phase's replies: the reason of each rejection and the abstentions."""

    rejected: dict[int, str] = field(default_factory=dict)
    abstained: list[int] = field(default_factory=list)

    def check(self, rnd: int, accepted: int) -> None:
        """A round in which replies came and every one was rejected is an error with the reasons."""
        if self.rejected and not accepted and not self.abstained:
            reasons = "; ".join(f"client {c}: {r}" for c, r in sorted(self.rejected.items())[:5])
            raise RoundRejected(f"round {rnd}: every reply was rejected, so the round changes nothing and the run "
                                f"stops ({reasons}).")


def accept(method: Method, server: Any, phase: str, rnd: int, cid: int, reply: Any, *, asked: set[int],
           verdicts: Verdicts) -> bool:
    """Whether the server takes ``reply`` of ``cid``: a client that was asked, a :class:`Message`, and the
    method's ``validate_reply``. Every failure while checking it, of any kind, rejects that reply alone (logged,
    recorded in ``verdicts``); the server state is what it was (docs/privacy.md, "What the server accepts")."""
    try:
        if cid not in asked:
            raise InvalidMessage(f"client {cid!r} was not asked for a {phase} reply in round {rnd}.")
        if not isinstance(reply, Message):
            raise InvalidMessage(f"a reply must be a message, got {type(reply).__name__}.")
        method.validate_reply(server, phase, rnd, cid, reply)
    except Abstained:
        verdicts.abstained.append(cid)
        return False
    except Exception as err:  # noqa: BLE001 - a hostile reply must not crash the server, whatever it triggers
        reason = str(err) if isinstance(err, InvalidMessage) else f"{type(err).__name__} while checking it"
        log.warning("round %d: rejected %s reply from client %s: %s", rnd, phase, cid, reason)
        verdicts.rejected[cid] = reason
        return False
    return True


def run_federated(
    method: Method,
    clients: Mapping[int, ClientData],
    schedule: np.ndarray,
    *,
    eval_every: int = 0,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 10,
    on_round: RoundCallback | None = None,
    progress: bool = True,
    stop_after: int | None = None,
) -> RunResult:
    """Drive ``method`` over ``schedule`` (shape (rounds, per_round) of client ids).

    ``checkpoint``: a file; if it exists the run resumes from it, and it is rewritten every
    ``checkpoint_every`` rounds and at the end. ``on_round`` receives each round's metrics record.
    ``stop_after``: stop (with a checkpoint) after that many rounds in total, e.g. to test resumption.
    """
    schedule = np.asarray(schedule, dtype=np.int64)
    if schedule.ndim != 2:
        raise ValueError(f"schedule must have shape (rounds, per_round), got {schedule.shape}.")
    unknown = set(np.unique(schedule).tolist()) - set(clients)
    if unknown:
        raise ValueError(f"schedule names clients without data: {sorted(unknown)[:10]}.")
    ckpt = Path(checkpoint) if checkpoint is not None else None
    if ckpt is not None and ckpt.exists():
        state = load_checkpoint(ckpt, schedule)
        log.info("resumed from %s at round %d", ckpt, state.round)
    else:
        state = start(method, clients)

    rounds = schedule.shape[0]
    last = rounds if stop_after is None else min(rounds, stop_after)
    bar = tqdm(total=last, initial=state.round, disable=not progress, desc=method.name, unit="round", leave=False)
    shown: dict[str, str] = {}  # the latest accuracies and loss, kept on the bar between evaluations
    final: dict[int, Metrics] | None = None  # an evaluation made at the last round is not repeated
    saved_round = state.round if ckpt is not None and ckpt.exists() else 0
    rnd = state.round
    try:
        for rnd in range(state.round + 1, last + 1):
            record = _fit_round(method, state, clients, rnd, schedule[rnd - 1])
            check_diverged(record, rnd, "training")
            if eval_every and (rnd % eval_every == 0 or rnd == rounds):
                evaluation = evaluate_clients(method, state, clients)
                record.update(summarize(evaluation, clients))
                check_diverged(record, rnd, "evaluation")
                final = evaluation if rnd == last else None
            state.round = rnd
            state.history.append(record)
            if on_round is not None:
                on_round(record)
            shown.update({k: f"{v:.3g}" for k, v in record.items() if k.endswith("accuracy") or k == "loss"})
            bar.set_postfix(shown, refresh=False)
            bar.update(1)
            if ckpt is not None and (rnd % checkpoint_every == 0 or rnd == last):
                save_checkpoint(ckpt, state, schedule)
                saved_round = rnd
    except KeyboardInterrupt:
        raise RunInterrupted(rnd, saved_round) from None
    finally:
        bar.close()
    evaluation = final if final is not None else evaluate_clients(method, state, clients)
    check_diverged(summarize(evaluation, clients), state.round, "the final evaluation")
    return RunResult(state=state, evaluation=evaluation)


def start(method: Method, clients: Mapping[int, ClientData]) -> LoopState:
    """The state before round 1: the initial server state after the one-shot setup exchange (if any)."""
    state = LoopState(round=0, server=method.init_server())
    replies: dict[int, Message] = {}
    msgs = {cid: m for cid in sorted(clients) if (m := method.configure_setup(state.server, cid)) is not None}
    verdicts = Verdicts()
    for cid, msg in msgs.items():
        reply, state.clients[cid] = method.client_setup(msg, method.init_client(cid), clients[cid])
        if accept(method, state.server, "setup", 0, cid, reply, asked=set(msgs), verdicts=verdicts):
            replies[cid] = reply
    verdicts.check(0, len(replies))
    if replies:
        state.server = method.aggregate_setup(state.server, replies)
    return state


def _fit_round(
    method: Method, state: LoopState, clients: Mapping[int, ClientData], rnd: int, selected: np.ndarray
) -> dict[str, Any]:
    t0 = time.perf_counter()
    if method.streaming:
        return _fit_round_streaming(method, state, clients, rnd, selected, t0)
    replies: dict[int, Message] = {}
    uplink = 0
    order = [int(c) for c in selected]
    msgs = {cid: method.configure_fit(state.server, rnd, cid) for cid in order}
    prev = {cid: state.clients[cid] if cid in state.clients else method.init_client(cid) for cid in order}
    results = method.client_fit_many(msgs, prev, {cid: clients[cid] for cid in order})
    verdicts = Verdicts()
    for cid in order:
        reply, state.clients[cid] = results[cid]  # the client keeps its own state
        if accept(method, state.server, "fit", rnd, cid, reply, asked=set(order), verdicts=verdicts):
            replies[cid] = reply
            uplink += reply.nbytes()
    verdicts.check(rnd, len(replies))
    record = _round_record(rnd, selected, verdicts, uplink)
    if replies:
        state.server, metrics = method.aggregate_fit(state.server, rnd, replies)
        record.update(metrics)
    record["seconds"] = time.perf_counter() - t0
    return record


def _round_record(rnd: int, selected: np.ndarray, verdicts: Verdicts, uplink: int) -> dict[str, Any]:
    """A round's record: who was asked, how many replies were rejected or abstained, the uplink bytes of the
    accepted replies."""
    record: dict[str, Any] = {"round": rnd, "clients": [int(c) for c in selected],
                              "rejected": len(verdicts.rejected), "uplink_bytes": uplink}
    if verdicts.abstained:
        record["abstained"] = len(verdicts.abstained)
    return record


def _fit_round_streaming(method: Method, state: LoopState, clients: Mapping[int, ClientData], rnd: int,
                         selected: np.ndarray, t0: float) -> dict[str, Any]:
    """A round of a streaming method: each client's reply is validated and folded in before the next runs."""
    acc, accepted, uplink = None, 0, 0
    order = [int(c) for c in selected]
    verdicts = Verdicts()
    for cid in order:
        msg = method.configure_fit(state.server, rnd, cid)
        prev = state.clients[cid] if cid in state.clients else method.init_client(cid)
        reply, state.clients[cid] = method.client_fit(msg, prev, clients[cid])
        if accept(method, state.server, "fit", rnd, cid, reply, asked=set(order), verdicts=verdicts):
            acc = method.fold_fit(state.server, rnd, acc, cid, reply)
            accepted += 1
            uplink += reply.nbytes()
        del reply, msg
    verdicts.check(rnd, accepted)
    record = _round_record(rnd, selected, verdicts, uplink)
    if accepted:
        state.server, metrics = method.finish_fit(state.server, rnd, acc)
        record.update(metrics)
    record["seconds"] = time.perf_counter() - t0
    return record
