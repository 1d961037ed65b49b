"""Which node serves which client, fixed when a Flower run starts, and the replies the server accepts (no Flower
import: the logic is tested without a running app).

A node says once, at the start, which partition it holds (``partition-id`` of its node config). From then on a
client id is bound to that node's id (``src_node_id``, which Flower sets from the connection; with node
authentication it is bound to the node's registered key). A reply is accepted only as the answer of the node a
message was sent to, for the client that message was for: the client id a reply carries in its own ``meta`` is
never trusted, only compared. Everything else (a reply to no message, from another node, claiming another
client, a second reply for one client) is refused and logged, and leaves the server state as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class BindingError(RuntimeError):
    """The nodes of a run do not serve its clients one to one (a partition claimed twice, or none serving one)."""


@dataclass(frozen=True)
class ReplyView:
    """What the server reads of one Flower reply: the id of the message it answers, the node that sent it, the
    client id it claims in its ``meta`` record (None if absent) and its content."""

    reply_to: str
    src_node: int
    claimed_cid: Any
    content: Any


@dataclass(frozen=True)
class NodeBinding:
    """Client id -> node id for the whole run."""

    node_of: Mapping[int, int]

    @classmethod
    def from_claims(cls, claims: Iterable[tuple[int, Any]], clients: int) -> NodeBinding:
        """The binding from each node's answer ``(node id, claimed partition)`` to the partition query. A claim
        that is not an int in ``[0, clients)`` is ignored (that node gets no work); a partition claimed by two
        nodes, or served by none, stops the run before anything is sent."""
        node_of: dict[int, int] = {}
        for node, part in claims:
            if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < clients:
                log.warning(
                    "node %s claims partition %r, which is not a client of this run (0..%d): ignored",
                    node,
                    part,
                    clients - 1,
                )
                continue
            if part in node_of and node_of[part] != node:
                raise BindingError(
                    f"nodes {node_of[part]} and {node} both claim partition {part}; give each "
                    "SuperNode its own --node-config 'partition-id=<client>'."
                )
            node_of[part] = node
        if len(set(node_of.values())) != len(node_of):
            raise BindingError("one node claims several partitions; start one SuperNode per client.")
        missing = sorted(set(range(clients)) - set(node_of))
        if missing:
            raise BindingError(
                f"no node serves clients {missing}: start one SuperNode per client with "
                "--node-config 'partition-id=<client>'."
            )
        return cls(node_of=dict(node_of))

    def match(self, sent: Mapping[str, int], replies: Iterable[ReplyView]) -> tuple[dict[int, Any], list[str]]:
        """The replies the server takes, by client id, and the reasons for those it refused. ``sent`` maps the
        id of every message of this exchange to the client it was for."""
        accepted: dict[int, Any] = {}
        refused: list[str] = []
        for r in replies:
            cid = sent.get(r.reply_to)
            if cid is None:
                refused.append(f"node {r.src_node} sent a reply to no message of this exchange")
            elif r.src_node != self.node_of.get(cid):
                refused.append(
                    f"node {r.src_node} answered the message for client {cid}, which node "
                    f"{self.node_of.get(cid)} serves"
                )
            elif r.claimed_cid is not None and (isinstance(r.claimed_cid, bool) or r.claimed_cid != cid):
                refused.append(f"node {r.src_node} serves client {cid} but its reply claims client {r.claimed_cid!r}")
            elif cid in accepted:
                refused.append(f"node {r.src_node} sent a second reply for client {cid}")
            else:
                accepted[cid] = r.content
                continue
        for reason in refused:
            log.warning("refused a reply: %s", reason)
        return accepted, refused
