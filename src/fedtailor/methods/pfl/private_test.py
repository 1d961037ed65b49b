"""Client-level DP around the parameter-sharing methods (``methods/pfl/private.py``), where its guarantees are
used: the release is the clipped update plus the client's own noise, the server's mean is unweighted, every
client's eps agrees with dp-accounting, secure noise is nobody else's, hostile replies are refused with the
state unchanged, the budget is guarded before and during a run, FedLAG scores only the released updates, and the
ledger survives a checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event, rdp

from fedtailor.config import load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.checkpoint import load_checkpoint, save_checkpoint
from fedtailor.fl.loop import run_federated, start
from fedtailor.fl.records import InvalidMessage, Message
from fedtailor.methods.pfl.fedlag import FedLAG
from fedtailor.methods.pfl.fedlag_test import BASE, LAG
from fedtailor.methods.pfl.private import MECHANISM, ClientDP
from fedtailor.privacy.ledger import PrivacyBudgetExceeded
from fedtailor.privacy.noise import secure_gaussian_noise
from fedtailor.rng import derive_key
from fedtailor.runner import round_totals

SIM = ["method.client_dp.clip=0.5", "method.client_dp.epsilon=2000", 'method.client_dp.randomness="simulation"']


def build(name: str = "fedavg", *extra: str):
    setup = build_setup(load_config(None, [*BASE, f'method.name="{name}"', *extra]))
    return setup, build_method(setup)


def _fit(method, server, setup, rnd: int, cids: list[int]):
    msgs = {c: method.configure_fit(server, rnd, c) for c in cids}
    return msgs, method.client_fit_many(msgs, {}, {c: setup.clients[c] for c in cids})


def test_a_release_is_the_clipped_update_plus_the_clients_noise_and_the_mean_is_unweighted():
    setup, method = build("fedper", *SIM)
    _, plain = build("fedper")
    assert isinstance(method, ClientDP) and method.sigma > 0
    server = method.init_server()
    cids = [int(c) for c in setup.schedule[0]]
    msgs, out = _fit(method, server, setup, 1, cids)
    _, base_out = _fit(plain, plain.init_server(), setup, 1, cids)  # the same local programs without DP
    releases = {}
    for c in cids:
        reply = out[c][0]
        assert set(reply.arrays) == set(msgs[c].arrays) and not reply.config  # no record count, no loss
        received = msgs[c].arrays
        update = torch.cat([(base_out[c][0].arrays[n].double() - received[n].double()).reshape(-1) for n in received])
        assert float(update.norm()) > 0.5  # the clip is active
        key = derive_key(5, "client-dp", 1, c)
        noise = secure_gaussian_noise(key, "client-dp", sigma=method.sigma, size=update.numel())
        want = update * (0.5 / float(update.norm())) + torch.from_numpy(noise)
        got = torch.cat([(reply.arrays[n].double() - received[n].double()).reshape(-1) for n in received])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # float32 rounding of theta + release
        pre_noise = got - torch.from_numpy(noise)
        assert float(pre_noise.norm()) <= 0.5 * (1 + 1e-5)
        method.validate_reply(server, "fit", 1, c, reply)
        releases[c] = reply
    new, metrics = method.aggregate_fit(server, 1, releases)
    assert "loss" not in metrics
    for n in msgs[cids[0]].arrays:  # theta_g + the unweighted mean of the releases
        want = server.params[n] + torch.stack([releases[c].arrays[n] - server.params[n] for c in cids]).mean(0)
        torch.testing.assert_close(new.params[n], want, rtol=1e-6, atol=1e-7)
    assert [(r.client, r.round, r.mechanism) for r in new.ledger.releases] == [(c, 1, MECHANISM) for c in cids]


@pytest.mark.parametrize("conversion", ["balle", "closed-form"])
def test_every_clients_eps_is_its_composed_gaussian_releases_and_matches_dp_accounting(conversion):
    setup, method = build("fedavg", *SIM, "method.client_dp.epsilon=40", f'method.client_dp.conversion="{conversion}"')
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    summary = method.summary(result.state.server)
    counts = {c: int((setup.schedule == c).sum()) for c in setup.clients}
    assert summary["epsilon_max"] <= 40 * (1 + 1e-9) and not summary["epsilon_void"]
    assert summary["noise_multiplier"] == pytest.approx(method.sigma / 0.5)
    for c, eps in summary["epsilon_per_client"].items():
        if conversion != "balle":
            continue
        acc = rdp.RdpAccountant(orders=np.linspace(1.01, 200, 20000))
        acc.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(method.sigma / (2 * 0.5)), counts[int(c)]))
        theirs = acc.get_epsilon(1e-5)
        assert eps <= theirs + 1e-12 and eps == pytest.approx(theirs, rel=1e-3)
    assert max(summary["epsilon_per_client"].values()) == summary["epsilon_max"]


def test_secure_noise_comes_from_the_client_alone():
    setup, method = build("fedavg", "method.client_dp.clip=0.5", "method.client_dp.epsilon=2000")
    assert method.cfg.randomness == "secure" and "simulation-randomness" not in method.deployment_risks()
    server = method.init_server()
    c = int(setup.schedule[0, 0])
    first, second = (_fit(method, server, setup, 1, [c])[1][c][0] for _ in range(2))
    _, sim = build("fedavg", *SIM)
    simulated = _fit(sim, sim.init_server(), setup, 1, [c])[1][c][0]
    for n in first.arrays:  # same update, three different noise draws: none regenerable from the config
        assert not torch.equal(first.arrays[n], second.arrays[n])
        assert not torch.equal(first.arrays[n], simulated.arrays[n])
    assert "seed" not in method.summary(method.init_server())["epsilon_holds_against"]


def test_hostile_replies_are_refused_and_the_server_state_is_unchanged():
    setup, method = build("fedavg", *SIM)
    state = start(method, setup.clients)
    server = state.server
    c = int(setup.schedule[0, 0])
    _, out = _fit(method, server, setup, 1, [c])
    honest = out[c][0]
    name = next(iter(honest.arrays))
    before = {n: t.clone() for n, t in server.params.items()}
    hostile = [
        Message(arrays=honest.arrays, config={"num_examples": 10**9}),
        Message(arrays={**honest.arrays, name: honest.arrays[name].double()}),
        Message(arrays={**honest.arrays, name: honest.arrays[name].reshape(-1)}),
        Message(arrays={**honest.arrays, name: honest.arrays[name] * float("nan")}),
        Message(arrays={**honest.arrays, name: honest.arrays[name] + 100.0}),  # far beyond clip + noise
        Message(arrays={k: v for k, v in honest.arrays.items() if k != name}),
    ]
    for reply in hostile:
        with pytest.raises(InvalidMessage):
            method.validate_reply(server, "fit", 1, c, reply)
    assert all(torch.equal(before[n], server.params[n]) for n in before)
    assert len(server.ledger.releases) == 1  # what reached the server is counted once, however it was judged
    method.validate_reply(server, "fit", 1, c, honest)


def test_the_budget_is_guarded_before_the_run_and_at_every_request():
    with pytest.raises(PrivacyBudgetExceeded, match="planned schedule"):
        build("fedavg", *SIM, "method.client_dp.sigma=0.01")[1].init_server()
    setup, method = build("fedavg", *SIM)
    server = method.init_server()
    c = int(setup.schedule[0, 0])
    for rnd in range(1, len(setup.schedule) + 1):  # the planned participations spend the budget exactly
        method.validate_reply(server, "fit", rnd, c, _fit(method, server, setup, rnd, [c])[1][c][0])
    with pytest.raises(PrivacyBudgetExceeded):
        method.configure_fit(server, len(setup.schedule) + 1, c)
    with pytest.raises(ValueError, match="update_bound"):
        build("fedavg", *SIM, "method.update_bound=1.0")


def test_fedlag_scores_the_released_updates_and_refuses_unprotected_reports():
    setup, method = build("fedavg", *SIM, *LAG)
    assert isinstance(method, FedLAG) and isinstance(method.base, ClientDP)
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    assert len(result.state.server.chosen) == 2 and result.history[-1]["rejected"] == 0
    assert len(result.state.server.base.ledger.releases) == setup.schedule.size  # the ledger kept through FedLAG
    assert method.artifacts(result.state.server)["privacy_ledger.json"] == result.state.server.base.ledger.to_json()
    assert "simulation-randomness" in method.deployment_risks() and "epsilon_max" in method.summary(result.state.server)
    for bad in ("method.fedlag.rechoose=true", 'method.fedlag.update="gradient"'):
        with pytest.raises(ValueError, match="unprotected reports"):
            build("fedavg", *SIM, *LAG, bad)
    # every layer FedPer shares made personal: nothing left to release, refused before the run
    every = len(build("fedper", *SIM, *LAG)[1].candidates)
    assert isinstance(build("fedper", *SIM, *LAG, f"method.fedlag.top_k={every - 1}")[1], FedLAG)
    with pytest.raises(ValueError, match=f"the private release would be empty; set method.fedlag.top_k below {every}"):
        build("fedper", *SIM, *LAG, f"method.fedlag.top_k={every}")


@pytest.mark.parametrize(
    ("name", "dp"),
    [
        ("fedavg", ["method.client_dp.epsilon=inf"]),
        ("fedper", ["method.client_dp.epsilon=inf", *LAG]),
        ("ditto", ["method.record_dp.epsilon=inf"]),
        ("fedrep", ["method.record_dp.epsilon=inf", *LAG]),
    ],
)
def test_without_noise_a_wrapped_run_is_the_method_without_dp_bit_for_bit(name, dp, tmp_path):
    from fedtailor.fl.workers_test import _identical

    setup, private = build(name, *dp)
    _, plain = build(name, *[s for s in dp if s.startswith("method.fedlag")])
    runs = [run_federated(m, setup.clients, setup.schedule, progress=False) for m in (private, plain)]
    inner = runs[0].state.server.base if dp[-1].startswith("method.fedlag") else runs[0].state.server
    outer = runs[1].state.server.base if dp[-1].startswith("method.fedlag") else runs[1].state.server
    _identical(inner.params, outer.params, "params")
    _identical(runs[0].state.clients, runs[1].state.clients, "clients")
    _identical(runs[0].evaluation, runs[1].evaluation, "evaluation")
    summary = private.summary(runs[0].state.server)
    assert summary["epsilon_void"] and summary["epsilon_max"] == math.inf and inner.ledger.releases == ()
    save_checkpoint(tmp_path / "ck.pt", runs[0].state, setup.schedule)
    load_checkpoint(tmp_path / "ck.pt", setup.schedule)


def test_the_ledger_survives_a_checkpoint(tmp_path):
    setup, method = build("ditto", *SIM)
    result = run_federated(method, setup.clients, setup.schedule[:2], progress=False)
    save_checkpoint(tmp_path / "ck.pt", result.state, setup.schedule)
    back = load_checkpoint(tmp_path / "ck.pt", setup.schedule).server
    assert back.ledger.to_json() == result.state.server.ledger.to_json() and len(back.ledger.releases) == 10


# ----- record-level DP-SGD -----------------------------------------------------------------------------------
RECORD = ["method.record_dp.clip=1.0", "method.record_dp.epsilon=8", 'method.record_dp.randomness="simulation"']


def test_a_dp_sgd_step_is_the_noisy_clipped_sum_over_the_sampled_records_by_hand():
    """Six records, expected batch 2 (q = 1/3, three steps a pass): step 0 samples records 0, 2, 4 (their uniforms
    below q) and adds the given noise; steps 1 and 2 sample nothing and add zero noise, so the result is one step
    ``w - eta (sum_i clip_C(g_i) + zeta C z) / (q N)`` computed here by autograd, record by record."""
    from fedtailor.privacy.dpsgd import dp_sgd

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    x, y = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    loss = lambda p, aux, xb, yb: torch.nn.functional.cross_entropy(xb @ p["w"].T, yb)
    u = torch.tensor([0.1, 0.9, 0.3, 0.6, 0.2, 0.8], dtype=torch.float64)
    z = torch.randn(12, generator=gen, dtype=torch.float64)
    new, _, steps = dp_sgd(
        loss, {"w": w}, x, y, trainable={"w"}, epochs=1, batch_size=2, lr=0.5, clip=0.3, noise_multiplier=1.7,
        uniforms=lambda s, n: u if s == 0 else torch.ones(n, dtype=torch.float64),
        noise=lambda s, size: z if s == 0 else torch.zeros(size, dtype=torch.float64),
    )  # fmt: skip
    assert steps == 3
    total = torch.zeros_like(w)
    for i in (0, 2, 4):
        wi = w.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss({"w": wi}, {}, x[i : i + 1], y[i : i + 1]), [wi])
        assert float(g.norm()) > 0.3  # every clip is active
        total += g * (0.3 / float(g.norm()))
    want = w - 0.5 * (total + 1.7 * 0.3 * z.reshape(3, 4)) / (6 / 3)
    torch.testing.assert_close(new["w"], want, rtol=1e-12, atol=1e-12)


def test_a_proximal_penalty_is_added_to_the_noisy_step_outside_the_clip_by_hand():
    """The step of the test above with ``penalty`` (FedProx's and Ditto's proximal gradient ``mu (w - a)``): ``w -
    eta ((sum_i clip_C(g_i) + zeta C z) / (q N) + mu (w - a))``, the clip applied to the records' gradients alone;
    the anchor lies far away (||w - a|| = 40), so a clip over the penalty would cap the pull toward it."""
    from fedtailor.methods.pfl.local import proximal_gradient
    from fedtailor.privacy.dpsgd import dp_sgd

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    a = w + 40 * torch.nn.functional.normalize(
        torch.randn(3, 4, generator=gen, dtype=torch.float64).reshape(-1), dim=0
    ).reshape(3, 4)
    x, y = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    loss = lambda p, aux, xb, yb: torch.nn.functional.cross_entropy(xb @ p["w"].T, yb)
    z = torch.randn(12, generator=gen, dtype=torch.float64)
    new, _, _ = dp_sgd(
        loss, {"w": w}, x, y, trainable={"w"}, epochs=1, batch_size=6, lr=0.5, clip=0.3, noise_multiplier=1.7,
        uniforms=lambda s, n: torch.zeros(n, dtype=torch.float64), noise=lambda s, size: z,
        penalty=lambda p: proximal_gradient(p, anchor={"w": a}, mu=1.2),
    )  # fmt: skip
    total = torch.zeros_like(w)
    for i in range(6):
        wi = w.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss({"w": wi}, {}, x[i : i + 1], y[i : i + 1]), [wi])
        total += g * min(1.0, 0.3 / float(g.norm()))
    want = w - 0.5 * ((total + 1.7 * 0.3 * z.reshape(3, 4)) / 6 + 1.2 * (w - a))
    torch.testing.assert_close(new["w"], want, rtol=1e-12, atol=1e-12)
    assert float((new["w"] - a).norm()) < 0.5 * 40  # the pull toward the anchor is not clipped


@pytest.mark.parametrize("momentum", [0.0, 0.5])
@pytest.mark.parametrize("name", ["fedprox", "ditto"])
def test_record_dp_takes_the_batched_pass_for_the_proximal_bases_unless_momentum(name, momentum, monkeypatch):
    """FedProx and Ditto under record-level DP: the clipped sums come from one batched pass (the proximal term
    added after the noise), with momentum from per-record autograd (the term inside each record's loss); the
    honest replies pass the release bound either way."""
    import fedtailor.privacy.dpsgd as dpsgd

    calls = []  # (batched pass, penalty) of every local DP-SGD run
    real = dpsgd.dp_sgd
    spy = lambda *a, **kw: calls.append((kw["model"] is not None, kw["penalty"] is not None)) or real(*a, **kw)
    monkeypatch.setattr(dpsgd, "dp_sgd", spy)
    setup, method = build(name, *RECORD, f"method.momentum={momentum}")
    server = start(method, setup.clients).server
    cids = [int(c) for c in setup.schedule[0]]
    _, replies = _fit(method, server, setup, 1, cids)
    for c in cids:
        method.validate_reply(server, "fit", 1, c, replies[c][0])
    prox = (True, True) if momentum == 0.0 else (False, False)  # the proximal run: batched + penalty, or autograd
    per_client = [prox, (True, False)] if name == "ditto" else [prox]  # Ditto's global model: plain cross-entropy
    assert sorted(calls) == sorted(per_client * len(cids))


def test_one_record_moves_the_pre_noise_sum_by_at_most_the_clip():
    from fedtailor.privacy.dpsgd import clipped_sum

    gen = torch.Generator().manual_seed(1)
    grads = {"a": torch.randn(9, 5, 3, generator=gen) * 10, "b": torch.randn(9, 2, generator=gen) * 10}
    for huge in (1e-3, 1.0, 1e6):
        extra = {"a": torch.full((1, 5, 3), huge), "b": torch.full((1, 2), -huge)}
        with_one = clipped_sum({n: torch.cat([grads[n], extra[n]]) for n in grads}, clip=0.7)[0]
        without = clipped_sum(grads, clip=0.7)[0]
        moved = torch.cat([(with_one[n] - without[n]).reshape(-1) for n in grads]).norm()
        assert float(moved) <= 0.7 * (1 + 1e-6)


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedrep", "fedbabu", "ditto", "fedrod", "lgfedavg", "apfl"])
def test_record_dp_runs_every_base_with_its_planned_steps_and_each_clients_eps(name):
    from fedtailor.methods.pfl.private import RecordDP

    setup, method = build(name, *RECORD)
    assert isinstance(method, RecordDP) and method.noise_multiplier > 0 and not method.base.vectorize
    result = run_federated(method, setup.clients, setup.schedule, progress=False)  # steps checked every fit
    summary = method.summary(result.state.server)
    assert summary["epsilon_max"] <= 8 * (1 + 1e-9) and summary["epsilon_max"] > 7.5  # calibrated to 0.1%
    releases = result.state.server.ledger.releases
    assert len(releases) == setup.schedule.size and all(0 < r.sampling_rate < 1 and r.steps > 1 for r in releases)
    client = releases[0].client
    mine = [r for r in releases if r.client == client]
    theirs = rdp.RdpAccountant()  # dp-accounting's default orders (fractional ones too): never above ours
    event = dp_event.PoissonSampledDpEvent(mine[0].sampling_rate, dp_event.GaussianDpEvent(method.noise_multiplier))
    theirs.compose(event, sum(r.steps for r in mine))
    ours = summary["epsilon_per_client"][str(client)]
    assert theirs.get_epsilon(1e-5) - 1e-9 <= ours <= 1.02 * theirs.get_epsilon(1e-5)


def test_record_dp_noise_and_sampling_are_the_clients_own_and_replies_carry_the_shared_values_alone():
    setup, method = build("fedper", "method.record_dp.clip=1.0", "method.record_dp.epsilon=8")
    assert method.cfg.randomness == "secure"
    server = method.init_server()
    c = int(setup.schedule[0, 0])
    first, second = (_fit(method, server, setup, 1, [c])[1][c][0] for _ in range(2))
    assert not first.config and set(first.arrays) == set(method.base.shared_names(server))
    assert any(not torch.equal(first.arrays[n], second.arrays[n]) for n in first.arrays)
    method.validate_reply(server, "fit", 1, c, first)
    with pytest.raises(InvalidMessage):
        method.validate_reply(server, "fit", 1, c, Message(arrays=first.arrays, config={"num_examples": 1}))
    with pytest.raises(ValueError, match="choose one"):
        build("fedavg", *RECORD, *SIM)


def test_record_dp_refuses_a_plan_over_budget_and_keeps_its_ledger_through_a_checkpoint(tmp_path):
    with pytest.raises(PrivacyBudgetExceeded, match="planned schedule"):
        build("fedavg", *RECORD, "method.record_dp.noise_multiplier=0.3")[1].init_server()
    setup, method = build("ditto", *RECORD, *LAG)
    result = run_federated(method, setup.clients, setup.schedule[:2], progress=False)
    save_checkpoint(tmp_path / "ck.pt", result.state, setup.schedule)
    back = load_checkpoint(tmp_path / "ck.pt", setup.schedule).server.base.ledger
    assert back.to_json() == result.state.server.base.ledger.to_json() and back.releases[0].sampling_rate < 1


# ----- the exact compressed uplink ---------------------------------------------------------------------------
LRSUQ = ["method.client_dp.clip=0.5", "method.client_dp.epsilon=200", 'method.client_dp.codec="lrsuq"']


@pytest.mark.parametrize("codec", ["lrsuq", "ppr"])
def test_client_dp_over_an_exact_codec_sends_a_fixed_size_payload_whose_decoded_noise_is_the_gaussian(codec):
    from scipy import stats

    setup, method = build(
        "fedavg", *LRSUQ[:2], f'method.client_dp.codec="{codec}"', 'method.client_dp.randomness="simulation"'
    )
    server = method.init_server()
    cids = [int(c) for c in setup.schedule[0]]
    msgs, out = _fit(method, server, setup, 1, cids)
    _, plain = build("fedavg")
    _, base_out = _fit(plain, plain.init_server(), setup, 1, cids)
    sizes, z = set(), []
    for c in cids:
        reply = out[c][0]
        assert not reply.arrays and set(reply.config) == {"payload"}
        sizes.add(len(reply.config["payload"]))
        method.validate_reply(server, "fit", 1, c, reply)  # decoded into the shared values
        received = msgs[c].arrays
        update = torch.cat([(base_out[c][0].arrays[n].double() - received[n].double()).reshape(-1) for n in received])
        u = update * min(1.0, 0.5 / float(update.norm()))
        g = torch.cat([(reply.arrays[n].double() - received[n].double()).reshape(-1) for n in received])
        z.append(((g - u) / method.sigma).numpy())
    z = np.concatenate(z)  # 5 clients x 8,970 coordinates: KS against N(0, 1), and the first moments
    assert len(sizes) == 1 and 8 * sizes.pop() / (len(z) / len(cids)) < 8  # bits per coordinate, padded
    assert stats.kstest(z, "norm").pvalue > 1e-4 and abs(z.mean()) < 0.05 and abs(z.std() - 1) < 0.03
    new, _ = method.aggregate_fit(server, 1, {c: out[c][0] for c in cids})
    assert all(torch.isfinite(t).all() for t in new.params.values())
    summary = method.summary(new)
    assert summary["codec"] == codec and all(v < 8 for k, v in summary.items() if k.startswith("bits_per"))


def test_the_uplink_counts_the_payload_a_codec_reply_carries_not_what_it_decodes_to():
    setup, method = build("fedavg", *LRSUQ[:2], 'method.client_dp.codec="lrsuq"', *SIM)
    cids = [int(c) for c in setup.schedule[0]]
    _, out = _fit(method, method.init_server(), setup, 1, cids)
    payload = {len(out[c][0].config["payload"]) for c in cids}
    assert len(payload) == 1  # one padded size for every client
    result = run_federated(method, setup.clients, setup.schedule[:1], progress=False)
    size = payload.pop()
    assert result.history[0]["uplink_bytes"] == len(cids) * size
    # the run's bits per released value: the padded payload over the values it carried, as the summary states
    dim = sum(method.base.shapes[n].numel() for n in method.base.shared_names(result.state.server))
    assert result.history[0]["uplink_coefficients"] == len(cids) * dim
    totals = round_totals(result.history)
    assert totals["uplink_bits_per_coefficient"] == pytest.approx(8 * size / dim, rel=1e-12)
    assert totals["uplink_bits_per_coefficient"] == pytest.approx(method.codec_bits()[f"bits_per_coefficient_d{dim}"])
    _, fp32 = build("fedavg", *LRSUQ[:2], 'method.client_dp.codec="fp32"', *SIM)
    plain = round_totals(run_federated(fp32, setup.clients, setup.schedule[:1], progress=False).history)
    assert 32.0 <= plain["uplink_bits_per_coefficient"] < 32.2  # float32 values and the message's framing


def test_client_dp_over_lrsuq_in_secure_mode_under_fedlag():
    setup, method = build("fedavg", *LRSUQ, *LAG)
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    assert result.history[-1]["rejected"] == 0 and len(result.state.server.chosen) == 2
    inner = method.base
    assert len(inner._pad) == 2  # every layer shared during the warm-up, then two fewer
    assert "not the decoder" in inner.summary(result.state.server.base)["epsilon_holds_against"]
    server = inner.init_server()
    c = int(setup.schedule[0, 0])
    reply = _fit(inner, server, setup, 1, [c])[1][c][0]
    assert len(reply.config["codec_key"]) == 32
    forged = Message(config={**reply.config, "codec_key": b"\x01" * 32})
    with pytest.raises(InvalidMessage):
        inner.validate_reply(server, "fit", 1, c, forged)
    with pytest.raises(ValueError, match="lrsuq"):
        build("fedavg", 'method.client_dp.codec="lrsuq"', "method.client_dp.epsilon=inf")


@pytest.mark.parametrize("model", ["dnn", "fedavgcnn"])
def test_the_batched_clipped_sum_equals_per_record_autograd(model):
    """:func:`layer_clipped_sum` (ghost norms for Linear layers, through fl/batched.py's hand-written backward when
    the model is a chain of them; a grouped convolution backward for convolutions) against the per-record autograd
    path, on all parameters and on the head alone, with half the records clipped."""
    from fedtailor.models import build_model
    from fedtailor.privacy import dpsgd
    from fedtailor.privacy.dpsgd import clipped_sum, layer_clipped_sum

    net = build_model(model, input_shape=(1, 28, 28), num_classes=10, seed=0).double()
    gen = torch.Generator().manual_seed(3)
    x, y = torch.rand(7, 1, 28, 28, generator=gen, dtype=torch.float64), torch.randint(0, 10, (7,), generator=gen)
    params = {n: p.detach() for n, p in net.named_parameters()}
    for names in (set(params), {"fc.weight", "fc.bias"}):
        per = {}
        for i in range(len(x)):
            live = {n: params[n].clone().requires_grad_(n in names) for n in params}
            loss = torch.nn.functional.cross_entropy(
                torch.func.functional_call(net, live, (x[i : i + 1],)), y[i : i + 1]
            )
            grads = torch.autograd.grad(loss, [live[n] for n in sorted(names)])
            for n, g in zip(sorted(names), grads):
                per.setdefault(n, []).append(g)
        stacked = {n: torch.stack(v) for n, v in per.items()}
        clip = float(clipped_sum(stacked, clip=1.0)[1].median())  # half the records clipped
        want, norms = clipped_sum(stacked, clip=clip)
        assert (norms > clip).any() and (norms < clip).any()
        got, losses = layer_clipped_sum(net, params, names, x, y, clip=clip)
        assert set(got) == names and losses.shape == (7,)
        # every parameter of the Linear-only DNN: the hand-written chain path (no autograd) is the one that ran
        assert (dpsgd._linear_chain(net, names) is not None) == (model == "dnn" and names == set(params))
        for n in names:
            torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-12)


# ----- DP-FedSGD: one record-level step a round through the codec --------------------------------------------
ONE_STEP = [*RECORD, "method.batch_size=10000", "method.local_epochs=1"]


@pytest.mark.parametrize("codec", ["lrsuq", pytest.param("ppr", marks=pytest.mark.slow)])  # PPR: 2 min here
def test_dp_fedsgd_over_a_codec_sends_the_step_and_the_server_takes_it_bit_for_bit(codec):
    """One DP-SGD step a round on all of a client's records (q = 1): the client sends its clipped gradient sum
    through the codec (a fixed-size payload, nothing else); the server decodes it and takes the client's step
    itself, arriving at the client's own parameters bit for bit; the released noise is N(0, (zeta C)^2) (KS over
    five clients); the eps is the plain record-level run's; bits per coefficient are reported."""
    from scipy import stats

    from fedtailor.methods.pfl.private import RecordDP

    setup, method = build("fedavg", *ONE_STEP, f'method.record_dp.codec="{codec}"')
    assert isinstance(method, RecordDP) and all(s == 1 for s in method.steps.values())
    server = method.init_server()
    cids = [int(c) for c in setup.schedule[0]]
    taken: dict[int, dict[str, torch.Tensor]] = {}
    real = method.base.client_fit

    def spy(msg, state, data):  # what the client's own step arrived at, before the wrapper sends the codec message
        reply, new = real(msg, state, data)
        taken[data.cid] = reply.arrays
        return reply, new

    method.base.client_fit = spy
    msgs, out = _fit(method, server, setup, 1, cids)
    _, plain = build("fedavg", *ONE_STEP)  # the same step without noise, for the clipped sum
    z, sizes = [], set()
    for c in cids:
        reply = out[c][0]
        assert not reply.arrays and set(reply.config) == {"payload"}
        sizes.add(len(reply.config["payload"]))
        method.validate_reply(server, "fit", 1, c, reply)
        assert all(torch.equal(reply.arrays[n], taken[c][n]) for n in taken[c])  # the client's step, bit for bit
        n = setup.clients[c].train[0].shape[0]
        received = msgs[c].arrays
        step = torch.cat([(received[m].double() - reply.arrays[m].double()).reshape(-1) for m in received])
        z.append(step.numpy() * n / method.base.lr)  # the released noisy sum (to float32 rounding)
    assert len(sizes) >= 1 and all(8 * s / len(z[0]) < 8 for s in sizes)
    summary = method.summary(server)
    assert summary["codec"] == codec and all(v < 8 for k, v in summary.items() if k.startswith("bits_per"))
    _, fp32 = build("fedavg", *ONE_STEP)
    assert method.noise_multiplier == fp32.noise_multiplier  # the same mechanism, the same accounting
    # the noise: the release minus the noiseless clipped sum of the same step
    from torch.func import functional_call, grad, vmap

    from fedtailor.privacy.dpsgd import clipped_sum

    model = plain.base.model

    def loss(p, xi, yi):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    sums = []
    for c in cids:
        x, y = setup.clients[c].train
        params = {m: msgs[c].arrays[m].detach() for m in msgs[c].arrays}
        per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
        s, _ = clipped_sum(per, clip=1.0)
        sums.append(torch.cat([s[m].double().reshape(-1) for m in params]).numpy())
    noise = np.concatenate([zi - si for zi, si in zip(z, sums)]) / method.sigma
    assert stats.kstest(noise, "norm").pvalue > 1e-4 and abs(noise.std() - 1) < 0.03


def test_dp_fedsgd_over_a_codec_refuses_more_than_one_step_and_personal_parameters():
    with pytest.raises(ValueError, match="one DP-SGD step a round"):
        build("fedavg", *RECORD, 'method.record_dp.codec="lrsuq"')
    with pytest.raises(ValueError, match="also trains personal"):
        build("fedper", *ONE_STEP, 'method.record_dp.codec="lrsuq"')
    with pytest.raises(ValueError, match="fedlag.top_k = 0"):
        build("fedavg", *ONE_STEP, 'method.record_dp.codec="lrsuq"', *LAG)
    from fedtailor.fl.records import RequestRefused

    setup, method = build("fedavg", *ONE_STEP, 'method.record_dp.codec="lrsuq"')  # a layout the server cannot read
    server = method.init_server()
    c = int(setup.schedule[0, 0])
    method.base.names = list(reversed(method.base.names))
    with pytest.raises(RequestRefused, match="shared values only"):
        _fit(method, server, setup, 1, [c])
