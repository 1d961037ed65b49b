"""A node is who its credentials say: the client <-> node binding of a Flower run, the replies it refuses, and a
node that lies about its partition changing nothing on the server."""

from __future__ import annotations

import copy

import pytest

from fedtailor.flower.binding import BindingError, NodeBinding, ReplyView


def test_the_binding_takes_each_partition_from_one_node_and_refuses_duplicates():
    binding = NodeBinding.from_claims([(11, 0), (12, 1), (13, "1"), (14, 7), (15, None), (16, True)], clients=2)
    assert binding.node_of == {0: 11, 1: 12}  # non-int and out-of-range claims get no work
    with pytest.raises(BindingError, match="both claim partition 1"):
        NodeBinding.from_claims([(11, 0), (12, 1), (13, 1)], clients=2)
    with pytest.raises(BindingError, match="no node serves clients \\[1\\]"):
        NodeBinding.from_claims([(11, 0)], clients=2)


def test_replies_are_taken_only_from_the_node_a_message_went_to():
    binding = NodeBinding(node_of={0: 11, 1: 12})
    sent = {"m0": 0, "m1": 1}
    replies = [
        ReplyView("m0", 11, 0, "honest 0"),
        ReplyView("m1", 11, 1, "node 11 answers for client 1"),  # another node's message
        ReplyView("m1", 12, 0, "claims client 0"),  # its own message, another client's id
        ReplyView("m9", 12, 1, "a reply to nothing sent"),
        ReplyView("m0", 11, 0, "a second reply"),
        ReplyView("m1", 12, True, "a bool as id"),
    ]
    accepted, refused = binding.match(sent, replies)
    assert accepted == {0: "honest 0"}
    assert len(refused) == 5
    accepted, refused = binding.match(sent, [ReplyView("m1", 12, None, "no meta")])  # the id is never needed
    assert accepted == {1: "no meta"} and not refused


def test_a_node_that_lies_about_its_partition_changes_nothing(monkeypatch):
    """Node 12 serves client 1 but answers the setup message as client 0 (compact adaptation in secure mode:
    the setup reply carries the codec secret and the context). Its reply is refused: client 0's key ring
    entry and context stay those of client 0's own node, and the ledger charges client 0 once."""
    pytest.importorskip("flwr")
    from fedtailor.flower.apps import drive
    from fedtailor.flower.records import from_records, to_records
    from fedtailor.methods.compact.privacy_test import SECURE, build

    setup, method = build(SECURE, "federation.rounds=1")
    binding = NodeBinding.from_claims([(100 + c, c) for c in setup.clients], clients=len(setup.clients))
    liar, victim = 100 + max(setup.clients), min(setup.clients)
    states: dict[int, object] = {}
    seen: dict[str, object] = {}

    def exchange(kind, msgs):
        views, sent = [], {}
        for cid, msg in msgs.items():
            reply, states[cid] = _answer(method, kind, msg, states.get(cid), setup.clients[cid])
            sent[f"{kind}-{cid}"] = cid
            views.append(ReplyView(f"{kind}-{cid}", binding.node_of[cid], cid, _wire(reply, kind)))
        if kind == "query.setup":  # the liar answers the victim's message with a reply of its own
            forged, _ = _answer(method, kind, msgs[victim], None, setup.clients[max(setup.clients)])
            views.insert(0, ReplyView(f"{kind}-{victim}", liar, victim, _wire(forged, kind)))
            seen["forged"] = forged
        accepted, refused = binding.match(sent, views)
        if kind == "query.setup":
            seen["refused"] = refused
        return accepted

    def _wire(reply, kind):
        return reply if kind == "evaluate" else from_records(to_records(reply))

    server, history, _ = drive(method, setup, exchange)
    assert len(seen["refused"]) == 1 and "answered the message for client" in seen["refused"][0]
    forged_secret = int.from_bytes(seen["forged"].config["codec_secret"], "little")
    assert server.codec_secrets[victim] == states[victim].codec_secret != forged_secret
    honest_ctx = copy.deepcopy(server.contexts[victim])
    assert not (seen["forged"].arrays["context"] == honest_ctx).all()
    assert sum(1 for r in server.ledger.releases if r.client == victim and r.mechanism == "context") == 1
    assert all(h["rejected"] == 0 for h in history)


def _answer(method, kind, msg, state, data):
    from fedtailor.flower.apps import handle

    state = state if state is not None else method.init_client(data.cid)
    return handle(kind, msg, state, method, data)
