"""Unseen (Future) clients of the parameter-sharing methods and FedLAG: evaluated with the global model as it is
and after fine-tuning on their own records, never scheduled, never changing the server, reproducible."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedtailor.config import ConfigError, load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.loop import evaluate_clients, run_federated, summarize
from fedtailor.fl.registry import fedlag_bases
from fedtailor.fl.training import accuracy_and_loss_of, functional_sgd
from fedtailor.rng import torch_generator

BASE = [
    'data.dataset="digits"',
    "data.num_clients=5",
    "data.num_unseen=2",
    "data.context_size=40",
    "data.eval_fraction=0.25",
    'data.scheme="iid"',
    "federation.rounds=2",
    "federation.clients_per_round=3",
    'method.model="mlp"',
    "method.lr=0.1",
    "method.batch_size=16",
    "seed=5",
]
LAG = ["method.fedlag.top_k=1", "method.fedlag.warmup=1"]


def _run(name: str, *extra: str):
    setup = build_setup(load_config(None, [*BASE, f'method.name="{name}"', *extra]))
    method = build_method(setup)
    result = run_federated(method, setup.clients, setup.schedule, eval_every=1, progress=False)
    return setup, method, result


def _unseen(setup) -> list[int]:
    return sorted(c for c, d in setup.clients.items() if not d.seen)


@pytest.mark.parametrize("lag", [False, True], ids=["base", "fedlag"])
@pytest.mark.parametrize("name", fedlag_bases())  # every registered base
def test_unseen_clients_are_evaluated_as_is_and_fine_tuned_and_never_scheduled(name, lag):
    setup, _, result = _run(name, *(LAG if lag else ()))
    unseen = _unseen(setup)
    assert len(unseen) == 2
    assert not set(unseen) & set(np.unique(setup.schedule).tolist())  # never trained
    assert not set(unseen) & set(result.state.clients)  # no state was kept for them
    for c in unseen:
        m = result.evaluation[c]
        assert {"accuracy", "loss", "finetuned_accuracy", "finetuned_loss"} <= set(m)
        assert all(0 <= m[k] <= 1 for k in ("accuracy", "finetuned_accuracy"))
    for c in set(setup.clients) - set(unseen):
        assert "finetuned_accuracy" not in result.evaluation[c]  # seen clients: their personalized model only
    summary = summarize(result.evaluation, setup.clients)
    assert {"seen/accuracy", "future/accuracy", "future/finetuned_accuracy"} <= set(summary)
    assert "seen/finetuned_accuracy" not in summary
    assert "future/finetuned_accuracy" in result.history[0]  # every evaluation, not only the last


@pytest.mark.parametrize("name", ["fedavg", "ditto", "apfl"])
def test_as_is_is_the_global_model_and_zero_epochs_fine_tune_nothing(name):
    """FedAvg, Ditto and APFL hold a whole global model: an unseen client's as-is accuracy is that model's
    (Ditto's and APFL's personal model start there); with 0 epochs the fine-tuned metrics equal the as-is ones."""
    setup, method, result = _run(name, "method.unseen_finetune_epochs=0")
    params = result.state.server.params

    def logits(xb: torch.Tensor) -> torch.Tensor:
        return functional_call(method.model, params, (xb,))

    for c in _unseen(setup):
        x, y = setup.clients[c].eval
        acc, loss = accuracy_and_loss_of(logits, x, y)
        m = result.evaluation[c]
        assert (m["accuracy"], m["loss"]) == (acc, loss)
        assert (m["finetuned_accuracy"], m["finetuned_loss"]) == (m["accuracy"], m["loss"])


def test_fedavg_fine_tuning_is_k_epochs_of_sgd_from_the_global_model_with_the_keyed_batch_order():
    setup, method, result = _run("fedavg", "method.unseen_finetune_epochs=2")
    params, rnd = result.state.server.params, result.state.round

    def loss(p, aux, x, y):
        return F.cross_entropy(functional_call(method.model, p, (x,)), y)

    changed = False
    for c in _unseen(setup):
        data = setup.clients[c]
        x, y = data.train
        assert len(y) == 40  # its labelled context
        tuned, _ = functional_sgd(
            loss,
            params,
            x,
            y,
            trainable=frozenset(params),
            batch_size=16,
            epochs=2,
            lr=0.1,
            generator=torch_generator(5, "batches", rnd, c, "unseen"),
        )
        acc, val = accuracy_and_loss_of(lambda xb, p=tuned: functional_call(method.model, p, (xb,)), *data.eval)
        m = result.evaluation[c]
        assert (m["finetuned_accuracy"], m["finetuned_loss"]) == (acc, val)
        changed |= m["finetuned_loss"] != m["loss"]
    assert changed


@pytest.mark.parametrize("name", ["fedrep", "ditto", "fedrod"])
def test_an_evaluation_with_fine_tuning_leaves_the_server_and_the_clients_unchanged(name):
    setup, method, result = _run(name, *LAG)
    state = result.state
    server, clients = copy.deepcopy(state.server), copy.deepcopy(state.clients)
    again = evaluate_clients(method, state, setup.clients)
    assert again == result.evaluation  # the final evaluation again, the same numbers
    for n, t in server.base.params.items():
        assert torch.equal(state.server.base.params[n], t)
    assert state.server.base.personal == server.base.personal and state.server.scores == server.scores
    assert set(state.clients) == set(clients)
    for c, s in clients.items():
        assert all(torch.equal(state.clients[c].params[n], t) for n, t in s.params.items())
        assert all(torch.equal(state.clients[c].extra[n], t) for n, t in s.extra.items())


def test_fine_tuning_is_reproducible_and_changes_the_unseen_metrics():
    a = _run("fedper")[2]
    b = _run("fedper")[2]
    assert (
        a.evaluation == b.evaluation
        and a.history[0]["future/finetuned_accuracy"] == b.history[0]["future/finetuned_accuracy"]
    )
    assert any(m.get("finetuned_loss", m["loss"]) != m["loss"] for m in a.evaluation.values())


def test_the_fine_tuning_epochs_are_validated():
    with pytest.raises(ConfigError, match="unseen_finetune_epochs"):
        load_config(None, [*BASE, 'method.name="fedavg"', "method.unseen_finetune_epochs=-1"])
    with pytest.raises(ConfigError, match="data.context_size = 0"):
        load_config(None, [*BASE, 'method.name="fedavg"', "data.context_size=0"])
    load_config(None, [*BASE, 'method.name="fedavg"', "data.context_size=0", "method.unseen_finetune_epochs=0"])
