"""The parameter-sharing methods, one round each against a hand computation on a tiny model, and the protocol
they share: what is sent, what stays, what is averaged, and hostile replies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedtailor.fl.records import ClientData, InvalidMessage, Message
from fedtailor.methods.pfl.ditto import Ditto
from fedtailor.methods.pfl.fedavg import FedAvg
from fedtailor.methods.pfl.fedbabu import FedBABU
from fedtailor.methods.pfl.fedper import FedPer
from fedtailor.methods.pfl.fedprox import FedProx
from fedtailor.methods.pfl.fedrep import FedRep
from fedtailor.methods.pfl.fedrod import FedRoD
from fedtailor.methods.pfl.local import PersonalState
from fedtailor.models.parts import head_names, layer_units

LR = 0.3


class Tiny(nn.Module):
    head = "fc"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 3)
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.body(x)))


def _data(cid: int = 0, n: int = 8) -> ClientData:
    gen = torch.Generator().manual_seed(10 + cid)
    x = torch.randn(n, 4, generator=gen)
    y = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2])[:n]  # unequal class counts (FedRoD's balanced softmax)
    return ClientData(cid=cid, seen=True, train=(x, y), eval=(x, y))


def _kw(batch_size: int = 8, **extra):
    return dict(
        model_fn=Tiny,
        lr=LR,
        local_epochs=1,
        batch_size=batch_size,
        seed=0,
        device=torch.device("cpu"),
        rounds=2,
        **extra,
    )


def _forward(p, x):
    return F.linear(torch.tanh(F.linear(x, p["body.weight"], p["body.bias"])), p["fc.weight"], p["fc.bias"])


def _grad(loss_fn, p, names):
    live = {n: t.detach().clone().requires_grad_(n in names) for n, t in p.items()}
    grads = torch.autograd.grad(loss_fn(live), [live[n] for n in names])
    return dict(zip(names, grads))


def _step(p, grads):
    return {n: (p[n] - LR * grads[n]).detach() if n in grads else p[n] for n in p}


def _fit(method, state=None, data=None, rnd=1):
    server = method.init_server()
    data = data or _data()
    return method.client_fit(method.configure_fit(server, rnd, data.cid), state, data)


def test_fedprox_follows_the_prox_gradient_to_the_received_model():
    method = FedProx(mu=0.7, **_kw(batch_size=4))
    data = _data()
    reply, _ = _fit(method, data=data)
    x, y = data.train
    order = torch.randperm(8, generator=method.batches(1, 0))
    w0 = dict(method.theta0)
    names = list(w0)
    w = w0
    for part in (order[:4], order[4:]):
        g = _grad(
            lambda p: (
                F.cross_entropy(_forward(p, x[part]), y[part]) + 0.35 * sum((p[n] - w0[n]).pow(2).sum() for n in names)
            ),
            w,
            names,
        )
        w = _step(w, g)
    for n in names:
        torch.testing.assert_close(reply.arrays[n], w[n])
    plain, _ = _fit(FedAvg(**_kw(batch_size=4)), data=data)
    assert not torch.allclose(plain.arrays["body.weight"], w["body.weight"])  # the prox term mattered


def test_fedrep_trains_the_head_first_then_the_body_and_shares_only_the_body():
    method = FedRep(head_epochs=1, **_kw())
    data = _data()
    reply, state = _fit(method, data=data)
    x, y = data.train
    ce = lambda p: F.cross_entropy(_forward(p, x), y)
    head = ["fc.weight", "fc.bias"]
    w1 = _step(method.theta0, _grad(ce, method.theta0, head))
    w2 = _step(w1, _grad(ce, w1, ["body.weight", "body.bias"]))
    assert set(reply.arrays) == {"body.weight", "body.bias"}
    for n in w2:
        torch.testing.assert_close(state.params[n], w2[n])
    wrong = _step(method.theta0, _grad(ce, method.theta0, ["body.weight", "body.bias"]))  # body before head
    assert not torch.allclose(wrong["body.weight"], w2["body.weight"])


def test_fedbabu_keeps_the_head_at_its_initialisation_and_fine_tunes_only_for_the_final_evaluation():
    method = FedBABU(finetune_epochs=2, **_kw())
    data = _data()
    reply, state = _fit(method, data=data)
    x, y = data.train
    w1 = _step(
        method.theta0, _grad(lambda p: F.cross_entropy(_forward(p, x), y), method.theta0, ["body.weight", "body.bias"])
    )
    assert set(reply.arrays) == {"body.weight", "body.bias"}
    for n in w1:
        torch.testing.assert_close(state.params[n], w1[n])
    assert torch.equal(state.params["fc.weight"], method.theta0["fc.weight"])
    tuned, _ = method.predict(state.params, state.extra, data=data, final=True)
    same, _ = method.predict(state.params, state.extra, data=data, final=False)
    assert not torch.equal(tuned["fc.weight"], method.theta0["fc.weight"]) and same is state.params


def test_fedbabu_fine_tunes_at_its_own_step_when_given_one():
    """``finetune_lr`` fine-tunes exactly as a method trained at that step would (same batches), and the default
    is the training step."""
    data = _data()
    _, state = _fit(FedBABU(finetune_epochs=2, **_kw()), data=data)
    own = FedBABU(finetune_epochs=2, finetune_lr=LR / 10, **_kw())
    tuned, _ = own.predict(state.params, state.extra, data=data, final=True)
    slower, _ = FedBABU(finetune_epochs=2, **{**_kw(), "lr": LR / 10}).predict(
        state.params, state.extra, data=data, final=True
    )
    default, _ = FedBABU(finetune_epochs=2, **_kw()).predict(state.params, state.extra, data=data, final=True)
    for n in tuned:
        torch.testing.assert_close(tuned[n], slower[n], rtol=0, atol=0)
    assert not torch.equal(tuned["fc.weight"], default["fc.weight"])


def test_ditto_steps_the_personal_model_toward_the_received_global_one():
    method = Ditto(lam=0.8, personal_epochs=1, **_kw())
    data = _data()
    gen = torch.Generator().manual_seed(3)
    v0 = {n: t + 0.5 * torch.randn(t.shape, generator=gen) for n, t in method.theta0.items()}
    reply, state = _fit(method, state=PersonalState(params=dict(method.theta0), extra=v0), data=data)
    x, y = data.train
    w0 = method.theta0
    names = list(w0)
    v1 = _step(
        v0,
        _grad(
            lambda p: F.cross_entropy(_forward(p, x), y) + 0.4 * sum((p[n] - w0[n]).pow(2).sum() for n in names),
            v0,
            names,
        ),
    )
    w1 = _step(w0, _grad(lambda p: F.cross_entropy(_forward(p, x), y), w0, names))
    for n in names:
        torch.testing.assert_close(state.extra[n], v1[n])
        torch.testing.assert_close(reply.arrays[n], w1[n])
    metrics = method.client_evaluate(method.configure_evaluate(method.init_server(), 0), state, data)
    want = (_forward(v1, x).argmax(1) == y).float().mean().item()
    assert metrics["accuracy"] == pytest.approx(want)  # evaluated with the personal model


def test_fedrod_trains_the_generic_model_on_the_balanced_softmax_and_the_personal_head_on_top():
    method = FedRoD(**_kw())
    data = _data()
    reply, state = _fit(method, data=data)
    x, y = data.train
    log_counts = torch.tensor([5.0, 2.0, 1.0]).log()
    w0 = method.theta0
    names = list(w0)
    w1 = _step(w0, _grad(lambda p: F.cross_entropy(_forward(p, x) + log_counts, y), w0, names))
    rep = torch.tanh(F.linear(x, w0["body.weight"], w0["body.bias"]))
    z_g = _forward(w0, x)
    phi0 = {"fc.weight": w0["fc.weight"], "fc.bias": w0["fc.bias"]}
    phi1 = _step(
        phi0, _grad(lambda p: F.cross_entropy(z_g + F.linear(rep, p["fc.weight"], p["fc.bias"]), y), phi0, list(phi0))
    )
    for n in names:
        torch.testing.assert_close(reply.arrays[n], w1[n])
    for n in phi1:
        torch.testing.assert_close(state.extra[n], phi1[n])
    plain = _step(w0, _grad(lambda p: F.cross_entropy(_forward(p, x), y), w0, names))
    assert not torch.allclose(plain["fc.bias"], w1["fc.bias"])  # the log-count shift mattered


def test_heads_come_from_the_model_declaration():
    assert head_names(Tiny()) == {"fc.weight", "fc.bias"}
    assert layer_units(Tiny(), "module") == [("body.weight", "body.bias"), ("fc.weight", "fc.bias")]
    assert FedPer(**_kw()).own_personal == {"fc.weight", "fc.bias"}
    with pytest.raises(ValueError, match="declares no head"):
        FedPer(**{**_kw(), "model_fn": lambda: nn.Sequential(nn.Linear(2, 2))})


def test_fedper_averages_the_body_and_each_client_keeps_its_head():
    method = FedPer(**_kw())
    server = method.init_server()
    replies, states = {}, {}
    for cid in (0, 1):
        msg = method.configure_fit(server, 1, cid)
        assert set(msg.arrays) == {"body.weight", "body.bias"}  # the head is never sent
        replies[cid], states[cid] = method.client_fit(msg, None, _data(cid))
        method.validate_reply(server, "fit", 1, cid, replies[cid])
    new, _ = method.aggregate_fit(server, 1, replies)
    torch.testing.assert_close(
        new.params["body.weight"], (replies[0].arrays["body.weight"] + replies[1].arrays["body.weight"]) / 2
    )
    assert torch.equal(new.params["fc.weight"], server.params["fc.weight"])  # never averaged
    assert not torch.equal(states[0].params["fc.weight"], states[1].params["fc.weight"])


@pytest.mark.parametrize("kind", ["extra", "missing", "shape", "nan", "weight"])
def test_hostile_replies_are_refused(kind):
    method = FedPer(**_kw())
    server = method.init_server()
    reply, _ = _fit(method)
    a, c = dict(reply.arrays), dict(reply.config)
    if kind == "extra":
        a["fc.weight"] = torch.zeros(3, 3)  # a personal layer leaking into the uplink is refused too
    elif kind == "missing":
        del a["body.bias"]
    elif kind == "shape":
        a["body.bias"] = torch.zeros(4)
    elif kind == "nan":
        a["body.bias"] = torch.full((3,), float("nan"))
    else:
        c["num_examples"] = 0
    with pytest.raises(InvalidMessage):
        method.validate_reply(server, "fit", 1, 0, Message(arrays=a, config=c))
