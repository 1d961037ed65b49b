"""Compact adaptation: the kernel identity, the calibrated release noise, the ledger against the accountant,
malformed releases, and unseen clients served from their context alone."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedtailor.config import COMPACT_VARIANTS, load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.loop import run_federated, start
from fedtailor.fl.records import InvalidMessage, Message
from fedtailor.fl.schedule import participation_counts
from fedtailor.methods.compact.adaptation import Generator
from fedtailor.privacy.accountant import make_accountant
from fedtailor.privacy.calibrate import calibrate_sigma
from fedtailor.runner import run_experiment

SMALL = [
    'data.dataset="mnist-5k"',
    "data.num_clients=10",
    "data.num_unseen=2",
    "data.context_size=60",
    "federation.rounds=12",
    "federation.clients_per_round=2",
    "method.coef_dim=2048",
    "method.hidden_dim=16",
    "method.privacy.batch_size=60",
    "method.privacy.epsilon=8",
    'method.privacy.randomness="simulation"',
]


def small(*extra: str):
    setup = build_setup(load_config(None, [*SMALL, *extra]))
    return setup, build_method(setup)


def test_kernel_identity_for_the_W_block_and_rank_of_the_psi_block():
    """K_ji = J_j J_i^T = (h_j . h_i) I_k (W block) + a term of rank <= r (psi block)."""
    torch.manual_seed(0)
    k, r = 40, 6
    gen = Generator(kind="factorized", context_dim=2, hidden_dim=r, out_dim=k, seed=0)
    with torch.no_grad():
        gen.W.normal_()  # away from the zero initialisation, so the psi block is not trivially zero
    c = torch.randn(2, 2)

    def jac(i: int, block: list[torch.nn.Parameter]) -> torch.Tensor:
        rows = []
        for e in torch.eye(k):
            a, _ = gen(c)
            rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(a[i] @ e, block)]))
        return torch.stack(rows)  # (k, |block|) = d a_i / d block

    _, h = gen(c)
    h = h.detach()
    w_block = jac(1, [gen.W]) @ jac(0, [gen.W]).T
    assert torch.allclose(w_block, (h[1] @ h[0]) * torch.eye(k), atol=1e-5)
    psi = list(gen.psi.parameters())
    psi_block = jac(1, psi) @ jac(0, psi).T
    sv = torch.linalg.svdvals(psi_block.double())
    assert sv[r - 1] > 1e-3 * sv[0]  # a genuine rank-r term (W was randomised) ...
    assert sv[r] < 1e-5 * sv[0]  # ... and nothing beyond rank r, up to float32 rounding
    # and the diagonal W block is the scalar gain ||h_i||^2 I_k
    assert torch.allclose(jac(0, [gen.W]) @ jac(0, [gen.W]).T, (h[0] @ h[0]) * torch.eye(k), atol=1e-5)


@pytest.mark.parametrize("codec", ["dg-fp32", "lrsuq", "ppr"])
def test_release_noise_has_the_calibrated_sigma(codec):
    setup, method = small(f'method.codec="{codec}"')
    _, ref_method = small('method.codec="dg-fp32"')
    server = start(method, setup.clients).server
    counts = participation_counts(setup.schedule, max(setup.partition.seen) + 1)
    expected = calibrate_sigma(
        eps=8,
        delta=1e-5,
        t_max=int(counts.max()),
        context_sensitivity=2 / 60,
        gradient_sensitivity=2 / 60,
        conversion="closed-form",
    )
    assert server.sigma == pytest.approx(expected, rel=1e-12)
    cid = int(setup.schedule[0, 0])
    # u: the same client, round and generator, the release's input
    ref_server = start(ref_method, setup.clients).server
    msg = ref_method.configure_fit(ref_server, 1, cid)
    _, u = ref_method.release_input(msg.arrays["a"], 1, setup.clients[cid])
    assert 0 < np.linalg.norm(u) <= 1.0 + 1e-6  # a clipped mean of per-record coefficient gradients
    msg = method.configure_fit(server, 1, cid)
    reply, _ = method.client_fit(msg, None, setup.clients[cid])
    method.validate_reply(server, "fit", 1, cid, reply)
    e = (method.decode(server, 1, cid, reply) - u) / server.sigma
    # k = 2048 standardised coordinates: KS against N(0, 1) at alpha = 1e-3, and the sample std, whose
    # sampling sd is 1/sqrt(2k) = 1.6%, within 5% (3 sd): a sigma off by 10% fails with power > 0.99.
    assert stats.kstest(e, "norm").pvalue > 1e-3
    assert abs(e.std() - 1.0) < 0.05
    assert abs(e.mean()) < 4 / math.sqrt(len(e))


@pytest.mark.parametrize("variant", ["full-dg", "global"])
def test_full_space_release_input_from_one_batched_pass_is_the_per_record_clipped_mean(variant):
    """Full-space variants form u by ghost clipping (no (m_g, d) gradients); with diagnostics on they take the
    per-record path. Both give the same u (float rounding apart) and only the latter returns the gradients."""
    clip = "method.privacy.clip=5.5"  # between the records' gradient norms (about 4.5 to 7): some clip, some not
    setup, fast = small(f'method.variant="{variant}"', clip)
    _, slow = small(f'method.variant="{variant}"', clip, "method.diagnostics=true")
    torch.manual_seed(0)
    cid = int(setup.schedule[0, 0])
    for rnd in (1, 2):
        a = torch.randn(fast.d) * 0.05  # away from theta_ref, so that some records clip and some do not
        none, u = fast.release_input(a, rnd, setup.clients[cid])
        grads, u_ref = slow.release_input(a, rnd, setup.clients[cid])
        norms = torch.linalg.vector_norm(grads, dim=1)
        assert none is None and grads.shape == (60, fast.d)
        assert (norms > 5.5).any() and (norms < 5.5).any()
        np.testing.assert_allclose(u, u_ref, rtol=0, atol=1e-6 * np.abs(u_ref).max())
        assert 0 < np.linalg.norm(u) <= 5.5 * (1 + 1e-6)


def test_ledger_matches_the_accountant_for_the_realised_schedule():
    setup, method = small()
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    server = result.state.server
    counts = participation_counts(setup.schedule, len(setup.clients))
    for cid in setup.clients:
        acc = make_accountant("closed-form")
        acc.step(sensitivity=2 / 60, sigma=server.sigma)
        if counts[cid]:
            acc.step(sensitivity=2 / 60, sigma=server.sigma, count=int(counts[cid]))
        assert server.ledger.epsilon(cid) == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)
    assert server.ledger.max_epsilon() == pytest.approx(8.0, rel=1e-9)  # the T_max client spends the budget
    summary = method.summary(server)
    assert summary["T_max"] == counts.max() and summary["epsilon_max"] <= 8.0 * (1 + 1e-9)


def test_malformed_releases_are_rejected_without_touching_the_server():
    setup, method = small('method.codec="lrsuq"')
    server = start(method, setup.clients).server
    cid = int(setup.schedule[0, 0])
    reply, _ = method.client_fit(method.configure_fit(server, 1, cid), None, setup.clients[cid])
    good = reply.config["payload"]
    omega = {k: v.clone() for k, v in server.omega.items()}
    for bad in (good[:-3], good[:10] + bytes([good[10] ^ 0xFF]) + good[11:], b"", b"\x00" * 64, "text"):
        with pytest.raises(InvalidMessage):
            method.validate_reply(server, "fit", 1, cid, Message(config={"payload": bad}))
    with pytest.raises(InvalidMessage):  # decoded with another client's key: mismatched release
        method.validate_reply(server, "fit", 1, cid + 1 if cid + 1 in setup.clients else cid - 1, reply)
    assert all(torch.equal(omega[k], server.omega[k]) for k in omega)


def test_a_release_is_decoded_once_and_never_mixed_up_with_another():
    setup, method = small('method.codec="lrsuq"')
    server = start(method, setup.clients).server
    a, b = (int(c) for c in setup.schedule[0, :2])
    replies = {c: method.client_fit(method.configure_fit(server, 1, c), None, setup.clients[c])[0] for c in (a, b)}
    decoded = {c: method.decode(server, 1, c, replies[c]) for c in (a, b)}
    method.validate_reply(server, "fit", 1, a, replies[a])
    # folded right after its validation: the same values, bit for bit
    assert np.array_equal(method.fold_fit(server, 1, None, a, replies[a])[a].g.numpy(), decoded[a].astype(np.float32))
    # a fold of another reply than the one just validated decodes that reply itself
    method.validate_reply(server, "fit", 1, a, replies[a])
    acc = method.fold_fit(server, 1, None, b, replies[b])
    assert np.array_equal(acc[b].g.numpy(), decoded[b].astype(np.float32))
    method.validate_reply(server, "fit", 1, b, replies[b])
    same_client = Message(config={"payload": bytes(replies[a].config["payload"])})  # equal bytes, other object
    assert np.array_equal(method.fold_fit(server, 1, None, a, same_client)[a].g.numpy(), decoded[a].astype(np.float32))


def test_unseen_clients_get_a_generated_model_without_training():
    setup, method = small()
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    server = result.state.server
    unseen = list(setup.partition.unseen)
    assert unseen and all(c in server.contexts for c in unseen)  # one-shot releases cached
    assert not set(unseen) & set(np.unique(setup.schedule).tolist())  # never trained on
    a, _ = method.coefficients(server, unseen)
    assert torch.linalg.vector_norm(a, dim=1).min() > 0  # a personalised point, not theta_ref
    assert a.shape == (len(unseen), 2048) and not torch.allclose(a[0], a[1])  # different contexts, different models
    # a Future client's model depends on its own release only: changing another client's context leaves it
    other = next(c for c in server.contexts if c != unseen[0])
    server.contexts[other] = server.contexts[other] + 1.0
    b, _ = method.coefficients(server, unseen)
    assert torch.equal(a[0], b[0])


def test_resumed_private_run_has_the_same_ledger_and_generator(tmp_path):
    setup, method = small()
    full = run_federated(method, setup.clients, setup.schedule, progress=False)
    ckpt = tmp_path / "ckpt.pt"
    run_federated(small()[1], setup.clients, setup.schedule, checkpoint=ckpt, progress=False, stop_after=5)
    resumed = run_federated(small()[1], setup.clients, setup.schedule, checkpoint=ckpt, progress=False)
    a, b = full.state.server, resumed.state.server
    assert a.ledger.to_json() == b.ledger.to_json()  # nothing spent twice, nothing forgotten
    assert all(torch.equal(a.omega[k], b.omega[k]) for k in a.omega)
    assert full.evaluation == resumed.evaluation


@pytest.mark.parametrize("variant", sorted(COMPACT_VARIANTS))
def test_every_variant_of_the_paper_runs_and_reports(variant, tmp_path):
    extra = ["federation.rounds=3", f'method.variant="{variant}"']
    if variant == "replay":  # Replay reads the per-round gains of a finished factorized run
        cfg = load_config(None, [*SMALL, "federation.rounds=3", 'method.variant="factorized"'])
        factorized = run_experiment(cfg, tmp_path / "factorized", progress=False)
        extra.append(f'method.replay_from="{factorized}"')
    setup, method = small(*extra)
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    axes = COMPACT_VARIANTS[variant]
    dim = method.d if axes["space"] == "full" else 2048
    assert method.k == dim and result.history[-1]["rejected"] == 0
    rec = result.history[-1]
    assert ("h_norm2" in rec) == (axes["generator"] in ("factorized", "deeplin", "radial"))
    summary = method.summary(result.state.server)
    if axes["codec"] in ("lrsuq", "ppr"):  # padded to one fixed size set from public probes: each release that size
        assert {r["uplink_payload_bytes"] for r in result.history} == {2.0 * summary["message_bytes_fixed"]}
        assert rec["bits_per_coefficient"] == 8 * summary["message_bytes_fixed"] / dim < 2.0
        assert summary["public_bits_per_coefficient_at_u0"] < summary["public_bits_per_coefficient_at_clip"]
    else:
        assert rec["bits_per_coefficient"] == pytest.approx({"dg-fp32": 32, "dg-q12": 12}[axes["codec"]], rel=0.02)
    if variant == "replay":
        gains = [json.loads(line)["h_norm2"] for line in (factorized / "metrics.jsonl").read_text().splitlines()]
        assert [r["replay_gain"] for r in result.history] == pytest.approx(gains)
    if variant == "replay":  # Replay reads the Factorized run's gains, so its eps composes both runs' releases
        from fedtailor.privacy.accountant import epsilon_from_rho
        from fedtailor.privacy.ledger import PrivacyLedger

        before = PrivacyLedger.from_json((factorized / "privacy_ledger.json").read_text())
        own = result.state.server.ledger
        for c, e in summary["epsilon_per_client"].items():
            rho = own.rho(int(c)) + before.rho(int(c))
            assert e == pytest.approx(epsilon_from_rho(rho, delta=1e-5, conversion="closed-form"), rel=1e-12)
        assert summary["epsilon_max"] > 8.0 and str(factorized) in summary["epsilon_includes"]
    else:
        assert summary["epsilon_max"] <= 8.0 * (1 + 1e-9)
    assert bool(result.state.server.contexts) == (axes["context"] != "public")
    assert summary["epsilon_void"] == (axes["context"] == "noiseless")
    assert set(result.evaluation) == set(setup.clients)
    assert all(
        m["num_examples"] == len(setup.clients[c].eval[1]) and math.isfinite(m["loss"])
        for c, m in result.evaluation.items()
    )
