"""The vectorized path (clients of a round executed together by torch.func.vmap) gives the models of the
per-client path, for every base method, with momentum, several epochs and FedLAG on top; unequal client sizes
and ragged last batches included."""

from __future__ import annotations

import pytest
import torch

from fedtailor.fl.registry import fedlag_bases
from fedtailor.fl.training import batched_sgd, functional_sgd
from fedtailor.methods.pfl.fedlag_test import _run


@pytest.mark.parametrize("method", fedlag_bases())  # every registered base
def test_vectorized_and_per_client_paths_give_the_same_models(method):
    # lr 0.1 (the other tests' step) on an AVX-512 CPU puts one FedRoD pre-activation so close to the ReLU kink
    # that the two paths' float rounding lands it on opposite sides (1.2e-4 after one round; 6e-8 at 0.0999 and
    # 0.1001, as for every other base): a step off such a coincidence tests the paths, not the rounding
    extra = [
        "method.lr=0.1001",
        "method.local_epochs=2",
        "method.momentum=0.5",
        "method.fedlag.top_k=1",
        "method.fedlag.warmup=2",
    ]
    _, _, fast = _run(method, *extra)
    _, _, slow = _run(method, *extra, "method.vectorize=false")
    assert fast.state.server.chosen == slow.state.server.chosen
    for n, t in slow.state.server.base.params.items():
        torch.testing.assert_close(fast.state.server.base.params[n], t, rtol=1e-4, atol=1e-5)
    for cid, state in slow.state.clients.items():
        for n, t in {**state.params, **state.extra}.items():
            torch.testing.assert_close(
                {**fast.state.clients[cid].params, **fast.state.clients[cid].extra}[n], t, rtol=1e-4, atol=1e-5
            )
    for cid, m in slow.evaluation.items():
        assert fast.evaluation[cid]["accuracy"] == pytest.approx(m["accuracy"], abs=0.02)
    losses = [r["loss"] for r in slow.history]
    assert [r["loss"] for r in fast.history] == pytest.approx(losses, rel=1e-4)


def test_batched_sgd_equals_one_functional_sgd_per_client_with_ragged_sizes():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, generator=gen)
    sizes = [1, 7, 16, 23, 40]  # fewer records than one batch, exact multiples and remainders

    def loss(p, aux, x, y):
        return torch.nn.functional.cross_entropy(x @ p["w"].T, y) + (p["w"] - aux["anchor"]).pow(2).sum()

    xs = [torch.randn(n, 5, generator=gen) for n in sizes]
    ys = [torch.randint(0, 3, (n,), generator=gen) for n in sizes]
    anchors = torch.randn(len(sizes), 3, 5, generator=gen)
    gens = lambda: [torch.Generator().manual_seed(100 + c) for c in range(len(sizes))]
    got, means = batched_sgd(
        loss,
        {"w": w.expand(len(sizes), 3, 5)},
        xs,
        ys,
        aux={"anchor": anchors},
        trainable={"w"},
        epochs=2,
        batch_size=8,
        lr=0.1,
        momentum=0.9,
        generators=gens(),
    )
    for c, g in enumerate(gens()):
        want, mean = functional_sgd(
            loss,
            {"w": w},
            xs[c],
            ys[c],
            aux={"anchor": anchors[c]},
            trainable={"w"},
            epochs=2,
            batch_size=8,
            lr=0.1,
            momentum=0.9,
            generator=g,
        )
        torch.testing.assert_close(got["w"][c], want["w"], rtol=1e-5, atol=1e-6)
        assert means[c] == pytest.approx(mean, rel=1e-5)
