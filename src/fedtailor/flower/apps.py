"""A Flower ``ServerApp`` and ``ClientApp`` for every fedtailor method: thin adapters around the same
``configure_*`` / ``validate_reply`` / ``aggregate_*`` and ``client_*`` halves the in-process loop drives.

Run config keys (``flwr run . FEDERATION -c 'key=value ...'``): ``config`` (a fedtailor config file; default
the quick start), ``set`` (``;``-separated ``key=value`` overrides, as ``--set``), ``out`` (a folder the server
writes ``results.json`` into). Node config: ``partition-id`` (which client of the partition the node is).

Both halves build the run from the same config (:func:`fedtailor.experiment.build_setup`): the server uses the
method and the schedule, a node uses only its own client's records and keeps its persistent client state in
``context.state`` between messages (a Deployment Engine node starts a fresh process per message).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedtailor.fl.records import InvalidMessage
from fedtailor.flower.records import STATE_KEY, from_records, state_from_bytes, state_to_bytes, to_records

log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def _build(config: str, sets: str) -> tuple[Any, Any]:
    from fedtailor.cli.run import default_config
    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup

    cfg = load_config(config or default_config(), [s for s in sets.split(";") if s.strip()])
    setup = build_setup(cfg)
    return setup, build_method(setup)


def _run_config(context: Context) -> tuple[str, str]:
    rc = context.run_config
    return str(rc.get("config", "")), str(rc.get("set", ""))


# ----- server -------------------------------------------------------------------------------------------
server_app = ServerApp()


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    setup, method = _build(*_run_config(context))
    nodes = _nodes_by_partition(grid, len(setup.clients))
    dead: set[int] = set()  # nodes that failed once are not asked again in this run (their clients are "lost")

    def exchange(kind: str, msgs: dict[int, Any]) -> dict[int, Any]:
        out = [FlowerMessage(content=_with_cid(to_records(m), cid, kind), dst_node_id=nodes[cid], message_type=kind)
               for cid, m in msgs.items() if nodes[cid] not in dead]
        replies = {}
        answered: set[int] = set()
        for reply in grid.send_and_receive(out):
            if reply.has_error():  # e.g. NODE_UNAVAILABLE once a killed node misses its heartbeats
                log.warning("%s: a node failed (%s); its client is left out from now on", kind, reply.error.reason)
                continue
            answered.add(reply.metadata.src_node_id)
            cid = int(reply.content["meta"]["cid"])
            try:
                replies[cid] = from_records(reply.content) if kind != "evaluate" else dict(reply.content["config"])
            except InvalidMessage as err:
                log.warning("%s: unreadable reply of client %d: %s", kind, cid, err)
        dead.update({m.metadata.dst_node_id for m in out} - answered)  # an error or no reply: lost from now on
        return replies

    server, history, evaluation = drive(method, setup, exchange)
    out = context.run_config.get("out")
    if out:
        _write(Path(str(out)), method, setup, server, history, evaluation)


def drive(method: Any, setup: Any, exchange: Any) -> tuple[Any, list[dict[str, Any]], dict[int, dict[str, float]]]:
    """The server's side of a whole run, with the transport abstracted: ``exchange(kind, {cid: Message})``
    returns the replies that came back (``kind`` is ``query.setup``, ``train`` or ``evaluate``). Replies are
    validated as in the in-process loop; clients that did not answer are recorded per round as ``lost``."""
    from fedtailor.fl.loop import LoopState

    state = LoopState(round=0, server=method.init_server())

    def accepted(phase: str, rnd: int, replies: dict[int, Any]) -> dict[int, Any]:
        ok = {}
        for cid, reply in replies.items():
            try:
                method.validate_reply(state.server, phase, rnd, cid, reply)
                ok[cid] = reply
            except InvalidMessage as err:
                log.warning("round %d: rejected %s reply from client %d: %s", rnd, phase, cid, err)
        return ok

    setup_msgs = {cid: m for cid in sorted(setup.clients) if (m := method.configure_setup(state.server, cid)) is not None}
    if setup_msgs:
        replies = accepted("setup", 0, exchange("query.setup", setup_msgs))
        if replies:
            state.server = method.aggregate_setup(state.server, replies)
    history = []
    for rnd in range(1, len(setup.schedule) + 1):
        cids = [int(c) for c in setup.schedule[rnd - 1]]
        came = exchange("train", {c: method.configure_fit(state.server, rnd, c) for c in cids})
        replies = accepted("fit", rnd, came)
        record: dict[str, Any] = {"round": rnd, "clients": cids, "lost": sorted(set(cids) - set(came)),
                                  "rejected": len(came) - len(replies)}
        if replies:
            state.server, metrics = method.aggregate_fit(state.server, rnd, replies)
            record.update(metrics)
        history.append(record)
        state.round = rnd
    evaluation = exchange("evaluate", {c: method.configure_evaluate(state.server, c) for c in sorted(setup.clients)
                                       if setup.clients[c].eval is not None})
    return state.server, history, evaluation


def _write(out: Path, method: Any, setup: Any, server: Any, history: list, evaluation: dict) -> None:
    import torch

    from fedtailor.fl.loop import summarize
    from fedtailor.runner import write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {
        "summary": summarize(evaluation, setup.clients), "history": history,
        "per_client": {str(c): m for c, m in sorted(evaluation.items())}, "method_summary": method.summary(server)})
    torch.save(server, out / "server_state.pt")


def _with_cid(records: RecordDict, cid: int, kind: str) -> RecordDict:
    records["meta"] = ConfigRecord({"cid": cid, "kind": kind})
    return records


def _nodes_by_partition(grid: Grid, clients: int) -> dict[int, int]:
    """Client id -> node id, from each node's ``partition-id`` (asked once; every client needs a node)."""
    import time

    deadline = time.time() + 120
    while True:
        ids = list(grid.get_node_ids())
        if len(ids) >= clients or time.time() > deadline:
            break
        time.sleep(1)
    asks = [FlowerMessage(content=RecordDict({"meta": ConfigRecord({"kind": "query.partition"})}), dst_node_id=n,
                          message_type="query.partition") for n in ids]
    mapping = {}
    for reply in grid.send_and_receive(asks):
        if not reply.has_error():
            mapping[int(reply.content["meta"]["partition"])] = reply.metadata.src_node_id
    missing = sorted(set(range(clients)) - set(mapping))
    if missing:
        raise RuntimeError(f"no node serves clients {missing}: start one SuperNode per client with "
                           "--node-config 'partition-id=<client>'.")
    return mapping


# ----- client -------------------------------------------------------------------------------------------
client_app = ClientApp()


def _client(context: Context) -> tuple[Any, Any, int]:
    setup, method = _build(*_run_config(context))
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
        return method.client_evaluate(msg, state, data), state
    raise ValueError(f"unknown message kind {kind!r}.")


def _on_node(kind: str, msg: FlowerMessage, context: Context) -> FlowerMessage:
    setup, method, cid = _client(context)
    out, state = handle(kind, from_records(msg.content), _load_state(context, method, cid), method, setup.clients[cid])
    _save_state(context, state)
    if kind == "evaluate":
        content = RecordDict({"config": ConfigRecord({k: float(v) for k, v in out.items()}),
                              "meta": ConfigRecord({"cid": cid})})
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
