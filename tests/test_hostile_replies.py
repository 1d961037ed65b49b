"""No reply crashes the server, and a rejected reply changes nothing, for every registered method.

A property test (hypothesis) takes a valid reply of each method (setup and fit phase) and mutates it: another
dtype, another shape, an extra or a missing key, NaN or inf, a huge value, a config value of the wrong type,
flipped payload bytes, or the id of a client that was not asked. Each mutant must be rejected by
:func:`fedtailor.fl.loop.accept`, the check both drivers (the in-process loop and the Flower ServerApp) run,
with the server state equal to before. The one deliberate exception: compact adaptation's ledger records a
release that reached the server even when it is rejected (it left the client), at most once per request.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtailor.config import load_config
from fedtailor.experiment import METHOD_BUILDERS, build_method, build_setup
from fedtailor.fl.loop import Verdicts, accept, accept_evaluation, start
from fedtailor.fl.records import Message
from fedtailor.fl.registry import fedlag_bases, methods
from fedtailor.privacy.ledger import PrivacyLedger

IMAGE = [
    'data.dataset="digits"',
    "data.num_clients=4",
    "data.num_unseen=0",
    "data.context_size=0",
    "data.eval_fraction=0.25",
    "federation.rounds=2",
    "federation.clients_per_round=2",
    'method.model="mlp"',
]
COMPACT = [
    'data.dataset="mnist-5k"',
    "data.num_clients=5",
    "data.num_unseen=1",
    "data.context_size=60",
    "federation.rounds=2",
    "federation.clients_per_round=2",
    "method.coef_dim=256",
    "method.hidden_dim=8",
    "method.privacy.batch_size=60",
    "method.privacy.epsilon=8",
]
CONFIGS: dict[str, list[str]] = {
    **{n: [*IMAGE, f'method.name="{n}"'] for n in fedlag_bases()},  # every registered base
    "fedlag+fedper": [*IMAGE, 'method.name="fedper"', "method.fedlag.top_k=1", "method.fedlag.warmup=1"],
    "compact dg-fp32 secure": [*COMPACT, 'method.variant="ours-dg"'],
    "compact lrsuq simulation": [*COMPACT, 'method.variant="ours-lrsuq"', 'method.privacy.randomness="simulation"'],
    "compact ppr secure": [*COMPACT, 'method.variant="ours-ppr"'],
}
DPO = tuple(s.name for s in methods() if s.data == "preferences")
PRIVATE_DPO = "pfeddpo record_dp"  # pair-level DP-SGD: the reply is the base and the pair count alone


@dataclasses.dataclass
class Case:
    method: Any
    server: Any
    phase: str
    rnd: int
    cid: int
    asked: set[int]
    reply: Message
    outsider: int  # a client that was not asked


def _image_case(name: str, phase: str) -> Case:
    setup = build_setup(load_config(None, CONFIGS[name]))
    method = build_method(setup)
    state = start(method, setup.clients)
    if phase == "setup":
        cids = [c for c in sorted(setup.clients) if method.configure_setup(method.init_server(), c) is not None]
        assert cids, f"{name} has no setup phase"
        server = method.init_server()
        cid = cids[0]
        reply, _ = method.client_setup(method.configure_setup(server, cid), method.init_client(cid), setup.clients[cid])
        return Case(method, server, "setup", 0, cid, set(cids), reply, outsider=max(setup.clients) + 7)
    rnd, cid = 1, int(setup.schedule[0, 0])
    msg = method.configure_fit(state.server, rnd, cid)
    reply, _ = method.client_fit(msg, state.clients.get(cid, method.init_client(cid)), setup.clients[cid])
    asked = {int(c) for c in setup.schedule[0]}
    outsider = next(c for c in sorted(setup.clients) if c not in asked)
    return Case(method, state.server, "fit", rnd, cid, asked, reply, outsider)


def _dpo_case(name: str, phase: str) -> Case:
    pytest.importorskip("peft")
    from fedtailor.lm.model import tiny_llama
    from fedtailor.methods.dpo.pfeddpo import CentralizedDPO, PFedDPO
    from fedtailor.methods.dpo.pfeddpo_test import _clients

    clients = _clients(n=3)
    sizes = {c: len(d.train["chosen_ids"]) for c, d in clients.items()}
    private = {}
    if name == PRIVATE_DPO:
        from fedtailor.methods.pfl.local import RecordDPConfig

        dp = RecordDPConfig(epsilon=8.0, randomness="simulation")
        private = {"record_dp": dp, "schedule": np.tile(np.arange(2), (2, 1))}
    args = {
        "model": tiny_llama(seed=3),
        "beta": 0.5,
        "lr": 3e-3,
        "local_steps": 1,
        "batch_size": 4,
        "grad_clip": 1.0,
        "seed": 0,
        "rounds": 2,
        "train_sizes": sizes,
        "diagnostics_every": 1 if name == "pfeddpo" else 0,
        **private,
    }
    method = (
        CentralizedDPO(pair_length=16, **args)
        if name == "dpo-central"
        else PFedDPO(personal=name in ("pfeddpo", PRIVATE_DPO), lora_rank=2, lora_alpha=4, **args)
    )
    state = start(method, {0: clients[0], 1: clients[1]})
    if phase == "setup":
        server = method.init_server()
        reply, _ = method.client_setup(method.configure_setup(server, 0), None, clients[0])
        return Case(method, server, "setup", 0, 0, {0, 1}, reply, outsider=2)
    reply, _ = method.client_fit(method.configure_fit(state.server, 1, 0), state.clients.get(0), clients[0])
    return Case(method, state.server, "fit", 1, 0, {0, 1}, reply, outsider=2)


_CASES: dict[tuple[str, str], Case] = {}


def case(name: str, phase: str) -> Case:
    if (name, phase) not in _CASES:
        _CASES[(name, phase)] = (_dpo_case if name in (*DPO, PRIVATE_DPO) else _image_case)(name, phase)
    return _CASES[(name, phase)]


# ----- mutations --------------------------------------------------------------------------------------------
def _other_type(v: Any) -> list[Any]:
    options = ["many", None, [1], b"\x00", True, 3.5, 7, float("nan")]
    return [o for o in options if type(o) is not type(v)]


def mutations(reply: Message) -> list[tuple[str, Callable[[Message], Message]]]:
    """Every mutation of ``reply`` that a validator must refuse, by name."""
    out: list[tuple[str, Callable[[Message], Message]]] = []
    arrays, config = reply.arrays, reply.config

    def with_array(name: str, t: Any) -> Callable[[Message], Message]:
        return lambda r: Message(arrays={**r.arrays, name: t}, config=dict(r.config))

    def with_config(name: str, v: Any) -> Callable[[Message], Message]:
        return lambda r: Message(arrays=dict(r.arrays), config={**r.config, name: v})

    for name, t in list(arrays.items())[:6]:  # a few arrays of each reply (the LM's are many)
        out.append((f"dtype {name}", with_array(name, t.double() if t.dtype != torch.float64 else t.float())))
        out.append((f"shape {name}", with_array(name, t.reshape(-1)[:-1] if t.numel() > 1 else t.reshape(1, 1, -1))))
        out.append(
            (
                f"missing {name}",
                lambda r, n=name: Message(arrays={k: v for k, v in r.arrays.items() if k != n}, config=dict(r.config)),
            )
        )
        if t.is_floating_point():
            for bad in (float("nan"), float("inf"), -float("inf"), 1e30):
                m = t.clone().reshape(-1)
                m[0] = bad
                out.append((f"{bad} in {name}", with_array(name, m.reshape(t.shape))))
        else:
            m = t.clone().reshape(-1)
            m[0] = -1
            out.append((f"-1 in {name}", with_array(name, m.reshape(t.shape))))
    for name, v in config.items():
        out.append(
            (
                f"missing config {name}",
                lambda r, n=name: Message(arrays=dict(r.arrays), config={k: x for k, x in r.config.items() if k != n}),
            )
        )
        for o in _other_type(v):
            out.append((f"config {name} = {o!r}", with_config(name, o)))
        if name == "payload":  # a flipped secret is just another secret; a flipped release fails its checks
            for i in (0, len(v) // 2, len(v) - 1):
                flipped = bytearray(v)
                flipped[i] ^= 0x5A
                out.append((f"flip byte {i} of {name}", with_config(name, bytes(flipped))))
        if isinstance(v, bytes) and v:
            out.append((f"truncated {name}", with_config(name, v[:-1])))
        if name == "num_examples":
            out.append(("num_examples 1e15", with_config(name, 10**15)))
            out.append(("num_examples 0", with_config(name, 0)))
    out.append(("extra array", with_array("evil", torch.zeros(3))))
    out.append(("extra config", with_config("evil", 1.0)))
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, PrivacyLedger):
        return a.to_json() == b.to_json()
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _without_ledger(server: Any) -> Any:
    if hasattr(server, "ledger"):
        return dataclasses.replace(server, ledger=None)
    return server


NAMES = [*CONFIGS, *DPO, PRIVATE_DPO]
# the methods with a setup exchange: compact adaptation (contexts, codec secrets) and the DPO methods
CASES = [(n, "fit") for n in NAMES] + [(n, "setup") for n in NAMES if n.startswith("compact") or n in DPO]


@pytest.mark.parametrize(("name", "phase"), CASES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_reply_is_rejected_and_changes_nothing(name, phase, data):
    c = case(name, phase)
    options = mutations(c.reply)
    label, mutate = data.draw(st.sampled_from(options + [("another client's id", lambda r: r)]), label="mutation")
    cid = c.outsider if label == "another client's id" else c.cid
    reply = mutate(c.reply)
    before = copy.deepcopy(c.server)
    ledger = getattr(before, "ledger", None)  # the private methods' (pFedDPO's is None without record_dp)
    releases = len(ledger.releases) if ledger is not None else 0
    verdicts = Verdicts()
    assert not accept(c.method, c.server, c.phase, c.rnd, cid, reply, asked=c.asked, verdicts=verdicts), label
    assert cid in verdicts.rejected, label
    assert _equal(_without_ledger(c.server), _without_ledger(before)), label
    if ledger is not None:  # a release that reached the server is charged once, and no other
        new = c.server.ledger.releases[releases:]
        assert len(new) <= 1 and all(r.client == cid == c.cid for r in new), label


@pytest.mark.parametrize(("name", "phase"), CASES)
def test_the_unmutated_reply_is_accepted(name, phase):
    """The property above is not vacuous: the valid reply passes the same check."""
    c = case(name, phase)
    server = copy.deepcopy(c.server)
    method = c.method
    assert accept(method, server, c.phase, c.rnd, c.cid, c.reply, asked=c.asked, verdicts=Verdicts())


def test_every_registered_method_is_covered():
    covered = {n.split()[0].split("+")[-1] for n in NAMES}
    assert set(METHOD_BUILDERS) <= covered, sorted(set(METHOD_BUILDERS) - covered)


@given(
    cid=st.one_of(st.integers(1, 9), st.integers(-3, -1), st.text(max_size=3), st.none(), st.just(True)),
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=3),
        st.none(),
        st.lists(st.integers(), max_size=2),
        st.booleans(),
        st.integers(-(10**20), 10**20),
    ),
)
@settings(max_examples=200, deadline=None)
def test_evaluation_replies_are_type_checked(cid, value):
    """A bogus id or a value that is not a finite number is dropped; the rest of the evaluation is kept."""
    replies = {0: {"accuracy": 0.5, "num_examples": 10.0}, cid: {"accuracy": value, "num_examples": 10.0}}
    out = accept_evaluation(replies, asked={0, 1})
    assert out[0] == {"accuracy": 0.5, "num_examples": 10.0}
    good = (
        isinstance(cid, int)
        and not isinstance(cid, bool)
        and cid in (0, 1)
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and abs(value) <= 2.0**64
    )
    assert (cid in out and cid != 0) == (good and cid == 1)
    for metrics in out.values():
        assert all(isinstance(v, float) and np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("driver", ["in-process", "flower"])
@pytest.mark.parametrize("name", ["fedavg", "compact lrsuq simulation"])
def test_both_drivers_reject_a_hostile_reply_and_aggregate_the_rest(driver, name):
    """One of a round's two replies is replaced by a float64 copy (it used to pass validation and crash the
    aggregation): both drivers record it as rejected, keep running, and end where a run without that client's
    reply ends."""
    from fedtailor.fl.loop import run_federated

    def poisoned(method, bad):
        fit = method.client_fit

        def client_fit(msg, state, data):
            reply, state = fit(msg, state, data)
            if data.cid == bad:
                arrays = {k: v.double() for k, v in reply.arrays.items()}
                config = (
                    {**reply.config, "payload": reply.config["payload"][:-1]}
                    if "payload" in reply.config
                    else reply.config
                )
                reply = Message(arrays=arrays, config=config)
            return reply, state

        method.client_fit = client_fit
        method.vectorize = False  # one client at a time, through client_fit
        return method

    setup = build_setup(load_config(None, [*CONFIGS[name], "federation.rounds=1"]))
    bad = int(setup.schedule[0, 0])
    if driver == "in-process":
        result = run_federated(poisoned(build_method(setup), bad), setup.clients, setup.schedule, progress=False)
        history, server = result.history, result.state.server
    else:
        pytest.importorskip("flwr")
        from fedtailor.flower.apps import drive, handle

        method, states = poisoned(build_method(setup), bad), {}

        def exchange(kind, msgs):
            out = {}
            for cid, msg in msgs.items():
                out[cid], states[cid] = handle(
                    kind, msg, states.get(cid, method.init_client(cid)), method, setup.clients[cid]
                )
            return out

        server, history, _ = drive(method, setup, exchange)
    assert history[0]["rejected"] == 1
    alone = run_federated(build_method(setup), setup.clients, setup.schedule[:, 1:], progress=False).state.server
    for k, v in (server.params if hasattr(server, "params") else server.omega).items():
        torch.testing.assert_close(v, (alone.params if hasattr(alone, "params") else alone.omega)[k])
