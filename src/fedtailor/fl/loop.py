"""The federation driver: one server loop for every :class:`~fedtailor.fl.method.Method` and every transport.

Round ``t`` (1-based) sends ``configure_fit`` messages to the clients ``schedule[t-1]`` through a
:class:`Transport`, checks each reply as it arrives (:func:`accept`: a rejected reply is dropped, logged and
counted; the server state is untouched), folds it in (``fold_fit``) and makes the new server state
(``finish_fit``). Every ``eval_every`` rounds and at the end, every client is evaluated (per-client metrics; the
summary averages within a client first, then over clients, with the spread over clients: :func:`summarize`).
The transport is the only thing that differs between running the clients in this process (:class:`InProcess`,
the default) and on Flower nodes (``fedtailor.flower.apps``): the setup phase, the checks, the finite checks,
``eval_every``, the round records (who was lost, who was rejected), checkpoints and resumption are written once,
here.

Randomness comes from explicit keys (round, client), never from a running generator, so a run resumed from a
checkpoint reproduces the uninterrupted run exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from scipy.special import stdtrit
from tqdm.auto import tqdm

from fedtailor.fl.checkpoint import LoopState, load_checkpoint, save_checkpoint
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

log = logging.getLogger(__name__)

RoundCallback = Callable[[dict[str, Any]], None]


@dataclass
class RunResult:
    state: LoopState
    evaluation: dict[int, Metrics]

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.state.history


#: The client groups of an evaluation summary: name -> which clients it holds. ``all`` is every evaluated client.
GROUPS: dict[str, Callable[[ClientData], bool]] = {
    "seen": lambda c: c.seen,
    "future": lambda c: not c.seen,
    "all": lambda c: True,
}

#: The prefix of the metrics a client reports on its validation records (:func:`evaluate_client`).
VALIDATION = "val_"


def client_statistics(values: Sequence[float]) -> dict[str, float]:
    """The distribution over clients of one metric (one value per client), keyed by the suffix that follows
    ``GROUP/METRIC`` in a summary: ``""`` the mean, ``"/std"`` the sample standard deviation (ddof 1),
    ``"/p10"`` the 10th percentile (numpy's linear interpolation between order statistics), and
    ``"/ci95_lo"``, ``"/ci95_hi"`` a 95% interval for the mean over clients by Student's t on the client values
    (mean +- t(0.975, n - 1) * std / sqrt(n); no resampling, so it is deterministic), ``"/n"`` the number of
    clients n. With one client there is no spread: std and the interval are left out."""
    v = np.asarray(values, dtype=np.float64)
    out = {"": float(v.mean()), "/p10": float(np.percentile(v, 10)), "/n": v.size}
    if v.size > 1:
        std = float(v.std(ddof=1))
        half = float(stdtrit(v.size - 1, 0.975)) * std / math.sqrt(v.size)
        out.update({"/std": std, "/ci95_lo": out[""] - half, "/ci95_hi": out[""] + half})
    return out


def summarize(
    evaluation: Mapping[int, Metrics],
    clients: Mapping[int, ClientData],
    *,
    groups: Mapping[str, Callable[[ClientData], bool]] = GROUPS,
) -> dict[str, float]:
    """Per-client metrics summarized over each group of clients (:data:`GROUPS`: seen, unseen (Future) and all
    evaluated clients; a group without evaluated clients is left out). Each client counts once, whatever its
    number of records (its metrics are already means over its records). For every metric ``M`` of a group
    ``G``: ``G/M`` the mean over the group's clients that report ``M``, and ``G/M/std``, ``G/M/p10``,
    ``G/M/ci95_lo``, ``G/M/ci95_hi`` and ``G/M/n`` (:func:`client_statistics`)."""
    out: dict[str, float] = {}
    for group, member in groups.items():
        members = [c for c in evaluation if member(clients[c])]
        if not members:
            continue
        keys = sorted({k for c in members for k in evaluation[c] if not k.endswith("num_examples")})
        for k in keys:
            stats = client_statistics([evaluation[c][k] for c in members if k in evaluation[c]])
            out.update({f"{group}/{k}{suffix}": v for suffix, v in stats.items()})
    return out


def chosen_rounds(
    history: Sequence[Mapping[str, Any]], *, group: str = "seen", metric: str = "accuracy"
) -> dict[str, Any]:
    """The best and the validation-chosen round of a run, from its per-round records (those with an evaluation
    summary, every ``eval_every`` rounds; empty when there is none).

    ``best_round``: the round with the highest ``GROUP/METRIC`` (by default the mean test accuracy over seen
    clients), and ``best/KEY`` every evaluation figure of that round: optimistic, the round is picked on the very
    numbers it reports. ``chosen_round``: the round with the highest ``GROUP/val_METRIC`` (the same mean on the
    clients' validation records, ``data.validation_mode = "alongside"``), and ``chosen/KEY`` the figures of that
    round, its test metrics included: an honest choice of round. Ties go to the earliest round."""
    out: dict[str, Any] = {}
    keep = tuple(f"{g}/" for g in GROUPS)
    for label, key in (("best", f"{group}/{metric}"), ("chosen", f"{group}/{VALIDATION}{metric}")):
        records = [r for r in history if isinstance(r.get(key), (int, float))]
        if records:
            top = records[int(np.argmax([r[key] for r in records]))]
            out[f"{label}_round"] = top["round"]
            out.update({f"{label}/{k}": v for k, v in top.items() if k.startswith(keep)})
    return out


def evaluate_client(method: Method, msg: Message, state: Any, data: ClientData) -> Metrics:
    """A client's evaluation reply: the method's metrics on its evaluation records and, when it also holds
    validation records (``data.val``), the same metrics on those with the prefix ``val_``. The validation pass
    sees the validation records alone (``train`` None), so what a method measures on the training records
    (pFedDPO's ``train_accuracy``) is neither computed twice nor reported as a validation figure."""
    metrics = dict(method.client_evaluate(msg, state, data))
    if data.val is not None:
        val = method.client_evaluate(msg, state, dataclasses.replace(data, eval=data.val, val=None, train=None))
        metrics.update({VALIDATION + k: v for k, v in val.items()})
    return metrics


class Transport(Protocol):
    """How the server's messages reach the clients and their replies come back.

    ``exchange(kind, msgs)`` sends ``msgs`` (client id -> message; ``kind`` is ``"setup"``, ``"fit"`` or
    ``"evaluate"``) and yields ``(client id, reply)`` as the replies come; a client that does not answer is
    absent (``lost``). A transport may yield a fit reply before the next client runs, so that the driver folds
    it in first (streaming methods). ``trusted``: the replies come from this run's own client code (in
    process), so a non-finite evaluation means divergence; from a remote node it is refused. ``states()``: the
    client states a checkpoint keeps (empty when they live on the nodes), ``restore`` sets them on resume."""

    trusted: bool

    def exchange(self, kind: str, msgs: dict[int, Message]) -> Iterator[tuple[int, Any]]: ...

    def states(self) -> dict[int, Any]: ...

    def restore(self, states: dict[int, Any]) -> None: ...


class InProcess:
    """The clients in this process: each client's half of the method runs on its own records, with its
    persistent state kept here (and in checkpoints). Fit replies of a streaming method are yielded one client at
    a time, before the next client runs; the others run a round's clients together (``client_fit_many``)."""

    trusted = True

    def __init__(self, method: Method, clients: Mapping[int, ClientData], states: dict[int, Any] | None = None) -> None:
        self.method, self.clients = method, clients
        self.client_states: dict[int, Any] = {} if states is None else states

    def states(self) -> dict[int, Any]:
        return self.client_states

    def restore(self, states: dict[int, Any]) -> None:
        self.client_states.clear()
        self.client_states.update(states)

    def _state(self, cid: int) -> Any:
        return self.client_states[cid] if cid in self.client_states else self.method.init_client(cid)

    def exchange(self, kind: str, msgs: dict[int, Message]) -> Iterator[tuple[int, Any]]:
        m, data = self.method, self.clients
        if kind == "setup":
            for cid, msg in msgs.items():
                reply, self.client_states[cid] = m.client_setup(msg, m.init_client(cid), data[cid])
                yield cid, reply
        elif kind == "evaluate":
            for cid, msg in msgs.items():
                yield cid, evaluate_client(m, msg, self._state(cid), data[cid])
        elif kind == "fit" and m.streaming:  # one client at a time: its reply is folded before the next runs
            for cid, msg in msgs.items():
                reply, self.client_states[cid] = m.client_fit(msg, self._state(cid), data[cid])
                yield cid, reply
                del reply
        elif kind == "fit":
            results = m.client_fit_many(msgs, {cid: self._state(cid) for cid in msgs}, {cid: data[cid] for cid in msgs})
            for cid in msgs:
                reply, self.client_states[cid] = results[cid]  # the client keeps its own state
                yield cid, reply
        else:
            raise ValueError(f"unknown message kind {kind!r}.")


def evaluate_clients(
    method: Method, state: LoopState, clients: Mapping[int, ClientData], transport: Transport | None = None
) -> dict[int, Metrics]:
    """The evaluate phase on every client that has evaluation data (their persistent state is read, not
    changed); replies are type-checked (:func:`accept_evaluation`)."""
    transport = transport or InProcess(method, clients, state.clients)
    asked = [c for c in sorted(clients) if clients[c].eval is not None]
    msgs = {cid: method.configure_evaluate(state.server, cid) for cid in asked}
    # in process a non-finite metric is divergence, which the driver reports; a node's is refused
    return accept_evaluation(dict(transport.exchange("evaluate", msgs)), asked=set(asked), finite=not transport.trusted)


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


class RunInterrupted(Exception):
    """Ctrl-C during a run; ``checkpoint_round`` is where ``--resume`` continues from (0: from the start)."""

    def __init__(self, round: int, checkpoint_round: int) -> None:
        super().__init__(f"interrupted during round {round}")
        self.round, self.checkpoint_round = round, checkpoint_round
        self.run_dir: Path | None = None  # set by the runner when there is a checkpoint to resume from


@dataclass
class Verdicts:
    """What the server made of a phase's replies: the reason of each rejection and the abstentions."""

    rejected: dict[int, str] = field(default_factory=dict)
    abstained: list[int] = field(default_factory=list)

    def check(self, rnd: int, accepted: int) -> None:
        """A round in which replies came and every one was rejected is an error with the reasons."""
        if self.rejected and not accepted and not self.abstained:
            reasons = "; ".join(f"client {c}: {r}" for c, r in sorted(self.rejected.items())[:5])
            raise RoundRejected(
                f"round {rnd}: every reply was rejected, so the round changes nothing and the run stops ({reasons})."
            )


def accept(
    method: Method, server: Any, phase: str, rnd: int, cid: int, reply: Any, *, asked: set[int], verdicts: Verdicts
) -> bool:
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
    except Exception as err:
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
    transport: Transport | None = None,
) -> RunResult:
    """Drive ``method`` over ``schedule`` (shape (rounds, per_round) of client ids) through ``transport``
    (default: :class:`InProcess` on ``clients``; the server reads of ``clients`` only who is seen and who has
    evaluation records).

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
    transport = transport or InProcess(method, clients)
    if ckpt is not None and ckpt.exists():
        state = load_checkpoint(ckpt, schedule)
        transport.restore(state.clients)
        log.info("resumed from %s at round %d", ckpt, state.round)
    else:
        state = start(method, clients, transport)

    rounds = schedule.shape[0]
    last = rounds if stop_after is None else min(rounds, stop_after)
    bar = tqdm(total=last, initial=state.round, disable=not progress, desc=method.name, unit="round", leave=False)
    shown: dict[str, str] = {}  # the latest accuracies and loss, kept on the bar between evaluations
    final: dict[int, Metrics] | None = None  # an evaluation made at the last round is not repeated
    saved_round = state.round if ckpt is not None and ckpt.exists() else 0
    rnd = state.round
    try:
        for rnd in range(state.round + 1, last + 1):
            record = _fit_round(method, state, transport, rnd, schedule[rnd - 1])
            check_diverged(record, rnd, "training")
            if eval_every and (rnd % eval_every == 0 or rnd == rounds):
                evaluation = evaluate_clients(method, state, clients, transport)
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
                state.clients = transport.states()
                save_checkpoint(ckpt, state, schedule)
                saved_round = rnd
    except KeyboardInterrupt:
        raise RunInterrupted(rnd, saved_round) from None
    finally:
        bar.close()
        state.clients = transport.states()
    evaluation = final if final is not None else evaluate_clients(method, state, clients, transport)
    check_diverged(summarize(evaluation, clients), state.round, "the final evaluation")
    return RunResult(state=state, evaluation=evaluation)


def start(method: Method, clients: Mapping[int, ClientData], transport: Transport | None = None) -> LoopState:
    """The state before round 1: the initial server state after the one-shot setup exchange (if any)."""
    transport = transport or InProcess(method, clients)
    state = LoopState(round=0, server=method.init_server(), clients=transport.states())
    msgs = {cid: m for cid in sorted(clients) if (m := method.configure_setup(state.server, cid)) is not None}
    if not msgs:
        return state
    verdicts, replies = Verdicts(), {}
    for cid, reply in transport.exchange("setup", msgs):
        if accept(method, state.server, "setup", 0, cid, reply, asked=set(msgs), verdicts=verdicts):
            replies[cid] = reply
    verdicts.check(0, len(replies))
    if replies:
        state.server = method.aggregate_setup(state.server, replies)
    return state


def _fit_round(
    method: Method, state: LoopState, transport: Transport, rnd: int, selected: np.ndarray
) -> dict[str, Any]:
    """One round: each reply is checked and folded in as it arrives (a streaming method's transport yields it
    before the next client runs), then the new server state is made from the accepted replies."""
    t0 = time.perf_counter()
    order = [int(c) for c in selected]
    msgs = {cid: method.configure_fit(state.server, rnd, cid) for cid in order}
    acc, accepted, uplink, came = None, 0, 0, set()
    verdicts = Verdicts()
    for cid, reply in transport.exchange("fit", msgs):
        came.add(cid)
        size = reply.nbytes()  # as it came: validation may decode a codec's payload into the arrays it carries
        if accept(method, state.server, "fit", rnd, cid, reply, asked=set(order), verdicts=verdicts):
            acc = method.fold_fit(state.server, rnd, acc, cid, reply)
            accepted += 1
            uplink += size
        del reply
    del msgs
    verdicts.check(rnd, accepted)
    record: dict[str, Any] = {
        "round": rnd,
        "clients": order,
        "lost": sorted(set(order) - came),
        "rejected": len(verdicts.rejected),
        "uplink_bytes": uplink,
    }
    if verdicts.abstained:
        record["abstained"] = len(verdicts.abstained)
    if accepted:
        state.server, metrics = method.finish_fit(state.server, rnd, acc)
        record.update(metrics)
    record["seconds"] = time.perf_counter() - t0
    return record
