"""LG-FedAvg and APFL: one round each against a hand computation on the tiny model of ``pfl_test``, the
vectorized path equal to the per-client one, and both under FedLAG on real data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedtailor.config import load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.loop import run_federated
from fedtailor.methods.pfl.apfl import ALPHA, APFL
from fedtailor.methods.pfl.fedlag import FedLAG
from fedtailor.methods.pfl.lgfedavg import LGFedAvg
from fedtailor.methods.pfl.local import PersonalState
from fedtailor.methods.pfl.local_test import LR, _data, _fit, _forward, _grad, _kw, _step

BODY, HEAD = ["body.weight", "body.bias"], ["fc.weight", "fc.bias"]


def test_lgfedavg_shares_only_the_head_and_each_client_keeps_its_body():
    method = LGFedAvg(**_kw())
    assert method.own_personal == set(BODY)
    server = method.init_server()
    gen = torch.Generator().manual_seed(5)
    replies, states = {}, {}
    for cid in (0, 1):
        msg = method.configure_fit(server, 1, cid)
        assert set(msg.arrays) == set(HEAD)  # the local representation is never sent
        own = {n: t + 0.3 * torch.randn(t.shape, generator=gen) for n, t in method.theta0.items()}
        data = _data(cid)
        replies[cid], states[cid] = method.client_fit(msg, PersonalState(params=own), data)
        method.validate_reply(server, "fit", 1, cid, replies[cid])
        x, y = data.train  # one full-batch step of the whole model from (own body, received head)
        start = {**own, **{n: server.params[n] for n in HEAD}}
        want = _step(start, _grad(lambda p, x=x, y=y: F.cross_entropy(_forward(p, x), y), start, BODY + HEAD))
        for n in want:
            torch.testing.assert_close(states[cid].params[n], want[n])
        assert set(replies[cid].arrays) == set(HEAD)
    new, _ = method.aggregate_fit(server, 1, replies)
    for n in HEAD:  # equal partition sizes: the plain mean
        torch.testing.assert_close(new.params[n], (replies[0].arrays[n] + replies[1].arrays[n]) / 2)
    for n in BODY:
        assert torch.equal(new.params[n], server.params[n])  # never averaged


def _apfl_by_hand(w, v, alpha, x, y):
    """One APFL step (Algorithm 1) from (w, v, alpha) on the batch (x, y)."""
    names = list(w)
    mixed = {n: alpha * v[n] + (1 - alpha) * w[n] for n in names}
    g_w = _grad(lambda p: F.cross_entropy(_forward(p, x), y), w, names)
    g_mix = _grad(lambda p: F.cross_entropy(_forward(p, x), y), mixed, names)
    w1 = {n: w[n] - LR * g_w[n] for n in names}
    v1 = {n: v[n] - LR * alpha * g_mix[n] for n in names}
    g_alpha = sum(float(((v[n] - w[n]) * g_mix[n]).sum()) for n in names)
    return w1, v1, min(1.0, max(0.0, alpha - LR * g_alpha))


def test_apfl_steps_the_global_copy_the_personal_model_and_alpha_as_algorithm_1():
    method = APFL(alpha=0.4, adaptive=True, **_kw())
    data = _data()
    gen = torch.Generator().manual_seed(3)
    v0 = {n: t + 0.5 * torch.randn(t.shape, generator=gen) for n, t in method.theta0.items()}
    state = PersonalState(params=dict(method.theta0), extra={**v0, ALPHA: torch.tensor(0.4)})
    reply, new = _fit(method, state=state, data=data)
    x, y = data.train
    w1, v1, a1 = _apfl_by_hand(method.theta0, v0, 0.4, x, y)
    for n in w1:
        torch.testing.assert_close(reply.arrays[n], w1[n])
        torch.testing.assert_close(new.extra[n], v1[n])
    assert float(new.extra[ALPHA]) == pytest.approx(a1, abs=1e-6) and a1 != 0.4
    metrics = method.client_evaluate(method.configure_evaluate(method.init_server(), 0), new, data)
    mixed = {n: a1 * v1[n] + (1 - a1) * method.theta0[n] for n in w1}  # with the received global model
    want = (_forward(mixed, x).argmax(1) == y).float().mean().item()
    assert metrics["accuracy"] == pytest.approx(want)


def test_apfl_clips_alpha_to_the_unit_interval_after_every_step_and_can_keep_it_fixed():
    data = _data()
    method = APFL(alpha=1.0, adaptive=True, **{**_kw(batch_size=2), "lr": 50.0})
    _, new = _fit(method, data=data)
    assert 0.0 <= float(new.extra[ALPHA]) <= 1.0
    fixed = APFL(alpha=0.4, adaptive=False, **_kw())
    _, kept = _fit(fixed, data=data)
    assert float(kept.extra[ALPHA]) == pytest.approx(0.4)


@pytest.mark.parametrize("cls", [LGFedAvg, APFL])
def test_vectorized_round_equals_one_client_after_another(cls):
    opts = {"alpha": 0.3, "adaptive": True} if cls is APFL else {}
    fast, slow = (cls(**opts, **_kw(batch_size=3), vectorize=v) for v in (True, False))
    server = fast.init_server()
    msgs = {c: fast.configure_fit(server, 1, c) for c in (0, 1, 2)}
    data = {c: _data(c, n=8 - c) for c in (0, 1, 2)}
    together = fast.client_fit_many(msgs, {}, data)
    for c, msg in msgs.items():
        reply, state = slow.client_fit(msg, None, data[c])
        for n, t in reply.arrays.items():
            torch.testing.assert_close(together[c][0].arrays[n], t, rtol=1e-5, atol=1e-6)
        for n, t in state.extra.items():
            torch.testing.assert_close(together[c][1].extra[n], t, rtol=1e-5, atol=1e-6)


SMALL = [
    'data.dataset="digits"',
    "data.num_clients=4",
    "data.num_unseen=0",
    "data.context_size=0",
    "data.eval_fraction=0.25",
    "federation.rounds=3",
    "federation.clients_per_round=3",
    'method.model="mlp"',
]


@pytest.mark.parametrize("name", ["lgfedavg", "apfl"])
def test_runs_under_fedlag_and_the_chosen_layers_stay_personal(name):
    setup = build_setup(
        load_config(None, [*SMALL, f'method.name="{name}"', "method.fedlag.top_k=1", "method.fedlag.warmup=1"])
    )
    method = build_method(setup)
    assert isinstance(method, FedLAG) and method.base.name == name
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    base = result.state.server.base
    assert len(base.personal) == 1 and not base.personal & method.base.own_personal
    assert all(0 <= m["accuracy"] <= 1 for m in result.evaluation.values())
    assert base.personal.isdisjoint(method.configure_fit(result.state.server, 4, 0).arrays)
