"""A Flower ``ServerApp`` and ``ClientApp`` for every fedtailor method: thin adapters around the same
``configure_*`` / ``validate_reply`` / ``aggregate_*`` and ``client_*`` halves the in-process loop drives.

Run config keys (``flwr run . FEDERATION -c 'key=value ...'``): ``config`` (a fedtailor config file; default
the quick start), ``set`` (``;``-separated ``key=value`` overrides, as ``--set``), ``out`` (a folder the server
writes ``results.json`` into), ``allow`` (settings that void the guarantee and are refused otherwise:
``simulation-randomness``, ``diagnostics``, ``unpadded``). Node config: ``partition-id`` (which client of the
partition the node is), ``allow`` (the same names: a node refuses them unless its own operator allows them),
``config-sha256`` (optional: the digest of the only resolved config the node serves).

Both halves build the run from the same config (:func:`fedtailor.experiment.build_setup`): the server uses the
method and the schedule, a node uses only its own client's records and keeps its persistent client state in
``context.state`` between messages (a Deployment Engine node starts a fresh process per message).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid, ServerApp

from fedtailor.fl.checkpoint import load_checkpoint, open_private
from fedtailor.fl.loop import evaluate_client, run_federated
from fedtailor.fl.records import RequestRefused
from fedtailor.flower.binding import NodeBinding, ReplyView
from fedtailor.flower.records import STATE_KEY, from_records, state_from_bytes, state_to_bytes, to_records

log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def _build(config: str, sets: str) -> tuple[Any, Any]:
    from fedtailor.allocator import keep_freed_memory
    from fedtailor.blas import single_thread_numpy_blas
    from fedtailor.config import default_config, load_config
    from fedtailor.experiment import build_method, build_setup

    keep_freed_memory()  # as `fedtailor run` does, in the ServerApp's and each ClientApp's process
    single_thread_numpy_blas()
    cfg = load_config(config or default_config(), [s for s in sets.split(";") if s.strip()])
    setup = build_setup(cfg)
    return setup, build_method(setup)


def _run_config(context: Context) -> tuple[str, str]:
    rc = context.run_config
    return str(rc.get("config", "")), str(rc.get("set", ""))


# ----- server -------------------------------------------------------------------------------------------
server_app = ServerApp()

#: Settings that void a deployment's guarantee (``Method.deployment_risks``), refused by the ServerApp unless
#: the run config's ``allow`` key names them (comma-separated), e.g. ``-c "allow='simulation-randomness'"``.
ALLOW_KEY = "allow"
#: Run config key: stop after this many rounds in total (0: run them all), with a checkpoint, as ``--stop-after``.
STOP_KEY = "stop-after"
#: Node config key: the SHA-256 of the resolved config the node's operator approved (``fedtailor.config.
#: config_digest``); with it the node refuses any other run config, whoever starts the run.
PIN_KEY = "config-sha256"


def refuse_unsafe(method: Any, allowed: str) -> None:
    """Raise unless every risky setting of ``method`` (simulation randomness, diagnostics, unpadded messages) is
    named in ``allowed``: a deployment never derives its noise from a public seed or sends diagnostics by
    default."""
    names = {a.strip() for a in allowed.split(",") if a.strip()}
    risks = {k: v for k, v in method.deployment_risks().items() if k not in names}
    if risks:
        why = "; ".join(f"{k}: {v}" for k, v in risks.items())
        raise RuntimeError(
            f"refused to deploy: {why}. Change the config, or accept it explicitly with the run "
            f"config key {ALLOW_KEY}='{','.join(risks)}'."
        )


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    setup, method = _build(*_run_config(context))
    refuse_unsafe(method, str(context.run_config.get(ALLOW_KEY, "")))
    binding = _bind_nodes(grid, len(setup.clients))
    dead: set[int] = set()  # nodes that failed once are not asked again in this run (their clients are "lost")

    def exchange(kind: str, msgs: dict[int, Any]) -> dict[int, Any]:
        out = {
            cid: FlowerMessage(
                content=_with_cid(to_records(m), cid, kind), dst_node_id=binding.node_of[cid], message_type=kind
            )
            for cid, m in msgs.items()
            if binding.node_of[cid] not in dead
        }
        views, answered = [], set()
        for reply in grid.send_and_receive(list(out.values())):
            if reply.has_error():  # e.g. NODE_UNAVAILABLE once a killed node misses its heartbeats
                log.warning("%s: a node failed (%s); its client is left out from now on", kind, reply.error.reason)
                continue
            answered.add(reply.metadata.src_node_id)
            views.append(_view(kind, reply))
        sent = {m.metadata.message_id: cid for cid, m in out.items()}
        replies, _ = binding.match(sent, views)
        dead.update({m.metadata.dst_node_id for m in out.values()} - answered)  # no reply: lost from now on
        return replies

    rc = context.run_config
    out, stop_after = str(rc.get("out", "")), int(rc.get(STOP_KEY, 0)) or None
    if not out:
        drive(method, setup, exchange)
        return
    from fedtailor.report import report
    from fedtailor.runner import run_experiment

    run_dir = Path(out)
    resume = (run_dir / "checkpoint.pt").exists()  # a ServerApp restarted on its run directory resumes
    run_experiment(
        setup.cfg,
        run_dir,
        resume=resume,
        progress=False,
        stop_after=stop_after,
        built=(setup, method),
        transport=Remote(exchange),
        on_round=lambda r: flwr_log(INFO, "round %s: %s", r["round"], _shown(r)),
    )
    with open_private(run_dir / "server_state.pt") as f:  # the final server state; it holds the key ring
        torch.save(load_checkpoint(run_dir / "checkpoint.pt", setup.schedule).server, f)
    flwr_log(INFO, "%s", report(run_dir, plots=True))


def _shown(record: dict[str, Any]) -> str:
    """A round's record as one log line: its numbers, and the clients lost if any."""
    parts = [
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in record.items()
        if k not in ("round", "clients") and not isinstance(v, list)
    ]
    return ", ".join(parts + ([f"lost {record['lost']}"] if record.get("lost") else []))


#: The driver's message kinds as Flower message types.
FLOWER_KINDS = {"setup": "query.setup", "fit": "train", "evaluate": "evaluate"}


class Remote:
    """Clients on Flower nodes for the federation driver (:class:`fedtailor.fl.loop.Transport`), reached
    through ``exchange(flower_kind, {cid: Message}) -> {cid: reply}``; their states live on the nodes, so a
    checkpoint holds the server's side only."""

    trusted = False

    def __init__(self, exchange: Any) -> None:
        self._exchange = exchange

    def exchange(self, kind: str, msgs: dict[int, Any]) -> Any:
        yield from self._exchange(FLOWER_KINDS[kind], msgs).items()

    def states(self) -> dict[int, Any]:
        return {}

    def restore(self, states: dict[int, Any]) -> None:
        """Nothing to restore: the nodes keep their clients' states."""


def _view(kind: str, reply: FlowerMessage) -> ReplyView:
    """A reply as the binding reads it; content that cannot be read becomes None (rejected by the driver)."""
    claimed = None
    try:
        claimed = reply.content["meta"]["cid"] if "meta" in reply.content else None
    except Exception:
        claimed = "unreadable"
    try:
        content: Any = from_records(reply.content) if kind != "evaluate" else dict(reply.content["config"])
    except Exception as err:
        log.warning("%s: unreadable reply from node %s: %s", kind, reply.metadata.src_node_id, err)
        content = None
    return ReplyView(
        reply_to=reply.metadata.reply_to_message_id,
        src_node=reply.metadata.src_node_id,
        claimed_cid=claimed,
        content=content,
    )


def drive(method: Any, setup: Any, exchange: Any) -> tuple[Any, list[dict[str, Any]], dict[int, dict[str, float]]]:
    """A whole run through ``exchange(kind, {cid: Message}) -> {cid: reply}`` (``kind`` is Flower's
    ``query.setup``, ``train`` or ``evaluate``), driven by the one federation driver
    (:func:`fedtailor.fl.loop.run_federated` with a :class:`Remote` transport): the same checks, records, finite
    checks and evaluation as every run. Returns (server state, per-round history, per-client evaluation)."""
    result = run_federated(method, setup.clients, setup.schedule, transport=Remote(exchange), progress=False)
    return result.state.server, result.history, result.evaluation


def drive_through_records(method: Any, setup: Any) -> tuple[Any, list[dict[str, Any]], dict[int, Any]]:
    """A whole run of :func:`drive` with the clients in this process, every message crossing the Flower records
    and every client state crossing bytes as on real nodes: the Flower path without a SuperLink (tests, and a
    quick check of a new method's records)."""
    states: dict[int, bytes] = {}

    def exchange(kind: str, msgs: dict[int, Any]) -> dict[int, Any]:
        out = {}
        for cid, msg in msgs.items():
            state = state_from_bytes(states[cid]) if cid in states else method.init_client(cid)
            reply, state = handle(kind, from_records(to_records(msg)), state, method, setup.clients[cid])
            states[cid] = state_to_bytes(state)
            out[cid] = reply if kind == "evaluate" else from_records(to_records(reply))
        return out

    return drive(method, setup, exchange)


def _with_cid(records: RecordDict, cid: int, kind: str) -> RecordDict:
    records["meta"] = ConfigRecord({"cid": cid, "kind": kind})
    return records


def _bind_nodes(grid: Grid, clients: int) -> NodeBinding:
    """Client id -> node id, from each node's ``partition-id`` (asked once, at the start; every client needs
    exactly one node, :meth:`NodeBinding.from_claims`)."""
    import time

    deadline = time.time() + 120
    while True:
        ids = list(grid.get_node_ids())
        if len(ids) >= clients or time.time() > deadline:
            break
        time.sleep(1)
    asks = [
        FlowerMessage(
            content=RecordDict({"meta": ConfigRecord({"kind": "query.partition"})}),
            dst_node_id=n,
            message_type="query.partition",
        )
        for n in ids
    ]
    claims = []
    for reply in grid.send_and_receive(asks):
        if not reply.has_error():
            try:
                claims.append((reply.metadata.src_node_id, reply.content["meta"]["partition"]))
            except Exception:
                log.warning("node %s gave no readable partition id", reply.metadata.src_node_id)
    return NodeBinding.from_claims(claims, clients)


# ----- client -------------------------------------------------------------------------------------------
client_app = ClientApp()


def _client(context: Context) -> tuple[Any, Any, int]:
    from fedtailor.config import config_digest

    setup, method = _build(*_run_config(context))
    pin = str(context.node_config.get(PIN_KEY, ""))
    if pin and pin != config_digest(setup.cfg):  # the node serves only the run its operator approved
        raise RequestRefused(f"the run's config digest {config_digest(setup.cfg)} is not the pinned {pin}.")
    cid = int(context.node_config["partition-id"])
    return setup, method, cid


def _load_state(context: Context, method: Any, cid: int) -> Any:
    if STATE_KEY in context.state:
        return state_from_bytes(context.state[STATE_KEY]["blob"])
    return method.init_client(cid)


def _save_state(context: Context, state: Any) -> None:
    context.state[STATE_KEY] = ConfigRecord({"blob": state_to_bytes(state)})


def _reply(msg: FlowerMessage, reply: Any, cid: int) -> FlowerMessage:
    content = to_records(reply)
    content["meta"] = ConfigRecord({"cid": cid})
    return FlowerMessage(content=content, reply_to=msg)


@client_app.query("partition")
def client_partition(msg: FlowerMessage, context: Context) -> FlowerMessage:
    cid = int(context.node_config["partition-id"])
    return FlowerMessage(content=RecordDict({"meta": ConfigRecord({"partition": cid})}), reply_to=msg)


def handle(kind: str, msg: Any, state: Any, method: Any, data: Any) -> tuple[Any, Any]:
    """A client's side of one message (transport-free): ``(reply or metrics, new state)``."""
    if kind == "query.setup":
        return method.client_setup(msg, state, data)
    if kind == "train":
        return method.client_fit(msg, state, data)
    if kind == "evaluate":
        return evaluate_client(method, msg, state, data), state
    raise ValueError(f"unknown message kind {kind!r}.")


class ClientFailed(RuntimeError):
    """What the server learns of a failure on a node: that it happened, nothing of why (the reason, which may
    hold a function of the client's data such as an exact message length, stays in the node's own log)."""


def _on_node(kind: str, msg: FlowerMessage, context: Context) -> FlowerMessage:
    try:
        setup, method, cid = _client(context)
        refuse_unsafe(method, str(context.node_config.get(ALLOW_KEY, "")))  # the node's own operator decides
        out, state = handle(
            kind, from_records(msg.content), _load_state(context, method, cid), method, setup.clients[cid]
        )
    except Exception:
        log.exception("client failed on a %s message", kind)
        raise ClientFailed(
            f"the client could not answer this {kind} message; the reason is in the node's log"
        ) from None
    _save_state(context, state)
    if kind == "evaluate":
        content = RecordDict(
            {"config": ConfigRecord({k: float(v) for k, v in out.items()}), "meta": ConfigRecord({"cid": cid})}
        )
        return FlowerMessage(content=content, reply_to=msg)
    return _reply(msg, out, cid)


@client_app.query("setup")
def client_setup(msg: FlowerMessage, context: Context) -> FlowerMessage:
    return _on_node("query.setup", msg, context)


@client_app.train()
def client_train(msg: FlowerMessage, context: Context) -> FlowerMessage:
    return _on_node("train", msg, context)


@client_app.evaluate()
def client_evaluate(msg: FlowerMessage, context: Context) -> FlowerMessage:
    return _on_node("evaluate", msg, context)
