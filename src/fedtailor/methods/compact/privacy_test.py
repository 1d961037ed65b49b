"""Compact adaptation, where its guarantees are used: secure randomness, DP-only outputs, padding, the budget
guard inside the method, and the server step against autograd."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedtailor.config import load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.loop import run_federated, start
from fedtailor.fl.records import InvalidMessage, Message
from fedtailor.fl.schedule import participation_counts
from fedtailor.methods.compact.adaptation_test import SMALL
from fedtailor.privacy.ledger import PrivacyBudgetExceeded

SECURE = [s for s in SMALL if "randomness" not in s] + ['method.privacy.randomness="secure"']


def build(base: list[str], *extra: str):
    setup = build_setup(load_config(None, [*base, *extra]))
    return setup, build_method(setup)


def _release(method, server, setup, rnd: int, cid: int) -> tuple[np.ndarray, Message]:
    """One fit exchange of ``cid``; returns the decoded release and the reply."""
    state = method.init_client(cid)
    reply, _ = method.client_fit(method.configure_fit(server, rnd, cid), state, setup.clients[cid])
    method.validate_reply(server, "fit", rnd, cid, reply)
    return method.decode(server, rnd, cid, reply), reply


def test_secure_mode_noise_cannot_be_regenerated_from_the_config():
    """Two secure runs of one config: the context releases and the codec secrets differ (fresh OS entropy), and
    neither equals what the seed derives; a release does not decode under the seed-derived key."""
    runs = []
    for _ in range(2):
        setup, method = build(SECURE)
        runs.append((setup, method, start(method, setup.clients)))
    (setup, m1, s1), (_, _m2, s2) = runs
    cid = int(setup.schedule[0, 0])
    sim_setup, sim = build(SMALL)
    sim_state = start(sim, sim_setup.clients)
    c1, c2, c_sim = s1.server.contexts[cid], s2.server.contexts[cid], sim_state.server.contexts[cid]
    assert not torch.equal(c1, c2) and not torch.equal(c1, c_sim)
    secret1, secret2 = s1.clients[cid].codec_secret, s2.clients[cid].codec_secret
    assert secret1 != secret2 and secret1 != sim._simulation_secret(cid)
    assert s1.server.codec_secrets[cid] == secret1  # the decoder holds it; nobody derives it
    assert secret1.bit_length() > 128 and secret2.bit_length() > 128  # 256-bit secrets (P[<= 128 bits] = 2^-128)
    # the release decodes with the client's secret only: the seed-derived key is refused (tag mismatch)
    reply, _ = m1.client_fit(m1.configure_fit(s1.server, 1, cid), s1.clients[cid], setup.clients[cid])
    m1.validate_reply(s1.server, "fit", 1, cid, reply)
    assert m1.decode(s1.server, 1, cid, reply).shape == (m1.k,)
    forged = type(s1.server)(**{**vars(s1.server), "codec_secrets": {cid: sim._simulation_secret(cid)}})
    with pytest.raises(InvalidMessage):
        m1.validate_reply(forged, "fit", 1, cid, reply)
    assert "secure" in m1.summary(s1.server)["randomness"]
    assert "simulation" in sim.summary(sim_state.server)["randomness"]


def test_simulation_mode_is_reproducible_and_the_default_is_secure():
    assert load_config(None, []).method.privacy.randomness == "secure"
    a = [start(m, s.clients).server.contexts for s, m in (build(SMALL), build(SMALL))]
    assert all(torch.equal(a[0][c], a[1][c]) for c in a[0])


def test_only_dp_outputs_leave_a_client_by_default():
    """Default run: the replies carry the payload alone, every payload has one size, no diagnostic is in the
    metrics and eps is not void. With diagnostics on, the summary marks eps void."""
    setup, method = build(SMALL, 'method.codec="lrsuq"')
    assert method.cfg.diagnostics is False and method.cfg.padding is True
    server = start(method, setup.clients).server
    sizes = set()
    for rnd in (1, 2):
        for cid in (int(c) for c in setup.schedule[rnd - 1]):
            _, reply = _release(method, server, setup, rnd, cid)
            assert set(reply.config) == {"payload"} and not reply.arrays
            sizes.add(len(reply.config["payload"]))
    assert sizes == {server.pad_bytes}
    result = run_federated(method, setup.clients, setup.schedule[:3], progress=False)
    leaky = {"perturbation_norm", "clip_fraction", "encode_ms", "decode_ms", "message_bytes"}
    assert not leaky & set().union(*result.history)
    summary = method.summary(result.state.server)
    assert summary["epsilon_void"] is False and summary["epsilon_void_reasons"] == []
    setup, method = build(SMALL, 'method.codec="lrsuq"', "method.diagnostics=true", "federation.rounds=2")
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    assert leaky - {"decode_ms"} <= set(result.history[-1]) and result.history[-1]["perturbation_norm"] > 0
    summary = method.summary(result.state.server)
    assert summary["epsilon_void"] is True and "diagnostics" in summary["epsilon_void_reasons"][0]
    _, method = build(SMALL, 'method.codec="lrsuq"', "method.padding=false")
    assert any("padding off" in r for r in method.privacy_status()[1])


def test_padded_messages_are_checked_before_decoding():
    setup, method = build(SMALL, 'method.codec="lrsuq"')
    server = start(method, setup.clients).server
    cid = int(setup.schedule[0, 0])
    _, reply = _release(method, server, setup, 1, cid)
    good = reply.config["payload"]
    omega = {k: v.clone() for k, v in server.omega.items()}
    for bad in (good[:-1], good + b"\x00", good[:-1] + b"\x01", b"FTP\x00" + b"\xff" * (len(good) - 4)):
        with pytest.raises(InvalidMessage):
            method.validate_reply(server, "fit", 1, cid, Message(config={"payload": bad}))
    assert all(torch.equal(omega[k], server.omega[k]) for k in omega)


def test_the_method_refuses_a_release_beyond_its_calibrated_schedule():
    """Drive the method past its plan: the client with T_max participations asks for one more release; the
    budget guard inside configure_fit refuses it and records nothing."""
    setup, method = build(SMALL)
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    server = result.state.server
    counts = participation_counts(setup.schedule, len(setup.clients))
    worst = int(np.argmax(counts))
    assert server.ledger.epsilon(worst) == pytest.approx(8.0, rel=1e-9)
    before = server.ledger.to_json()
    with pytest.raises(PrivacyBudgetExceeded, match=f"client {worst}"):
        method.configure_fit(server, setup.schedule.shape[0] + 1, worst)
    assert server.ledger.to_json() == before
    # a fixed sigma too small for the schedule is refused before any release
    _, method = build(SMALL, "method.privacy.sigma=0.01")
    with pytest.raises(PrivacyBudgetExceeded, match="planned schedule"):
        method.init_server()


def test_rejected_setup_replies_leave_the_server_intact():
    setup, method = build(SMALL)
    server = method.init_server()
    cid = int(setup.partition.seen[0])
    msg = method.configure_setup(server, cid)
    good, _ = method.client_setup(msg, None, setup.clients[cid])
    method.validate_reply(server, "setup", 0, cid, good)
    for bad in (
        Message(),
        Message(arrays={"context": torch.ones(3)}),
        Message(arrays={"context": torch.full((2,), 1e6)}),
        Message(arrays={"context": torch.tensor([float("nan"), 0.0])}),
    ):
        with pytest.raises(InvalidMessage):
            method.validate_reply(server, "setup", 0, cid, bad)
    _, secure = build(SECURE)
    s_server = secure.init_server()
    reply, _ = secure.client_setup(secure.configure_setup(s_server, cid), None, setup.clients[cid])
    for secret in (b"", b"\x00" * 31, "text"):
        with pytest.raises(InvalidMessage):
            secure.validate_reply(
                s_server, "setup", 0, cid, Message(arrays=reply.arrays, config={"codec_secret": secret})
            )
    assert s_server.codec_secrets == {} and s_server.contexts == {}


def test_without_noise_eps_is_infinite_and_void():
    setup, method = build(SMALL, "method.privacy.epsilon=inf", "federation.rounds=2")
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    summary = method.summary(result.state.server)
    assert result.state.server.sigma == 0 and summary["epsilon_max"] == math.inf and summary["epsilon_void"]
    assert result.state.server.ledger.releases == ()


def test_the_noiseless_context_control_sends_the_exact_mean_keeps_sigma_and_voids_eps():
    """Factorized+clean: each context release is the exact mean (no noise, nothing in the ledger for it), the
    gradient releases keep Factorized+ctx's sigma, and eps is void with the reason. A client configured with a
    private context adds noise whatever the request says."""
    from fedtailor.data.context import context_mean

    setup, clean = build(SMALL, 'method.variant="factorized-clean"', "federation.rounds=2")
    _, private = build(SMALL, 'method.variant="factorized-ctx"', "federation.rounds=2")
    result = run_federated(clean, setup.clients, setup.schedule, progress=False)
    server = result.state.server
    assert server.sigma > 0 and server.sigma == private.init_server().sigma
    for cid, c in server.contexts.items():
        torch.testing.assert_close(c, context_mean(setup.clients[cid].context), rtol=0, atol=0)
    mechanisms = {r.mechanism for r in server.ledger.releases}
    assert mechanisms and not any(m == "context" for m in mechanisms)
    summary = clean.summary(server)
    assert summary["epsilon_void"] and "without noise" in summary["epsilon_void_reasons"][0]
    assert "noiseless-context" in clean.deployment_risks()
    cid = int(setup.schedule[0, 0])
    request = clean.configure_setup(clean.init_server(), cid)  # the same request, to a private-context client
    reply, _ = private.client_setup(request, None, setup.clients[cid])
    assert not torch.equal(reply.arrays["context"], context_mean(setup.clients[cid].context))
    assert private.summary(start(private, setup.clients).server)["epsilon_void"] is False


def _autograd_step(method, omega: dict[str, torch.Tensor], contexts, setup, rnd: int, cids: list[int]):
    """omega - eta_t grad_omega (1/|S|) sum_i mean_{z in B_it} loss(theta_ref + P W h(c_i); z), by autograd."""
    names = {n for n, p in method.generator.named_parameters() if p.requires_grad}
    params = {k: v.clone().requires_grad_(k in names) for k, v in omega.items()}
    a, _ = functional_call(method.generator, params, (torch.stack([contexts[c] for c in cids]),))
    loss = 0.0
    for i, cid in enumerate(cids):
        x, y = setup.clients[cid].train
        idx = method.batch_indices(rnd, cid, x)
        logits = functional_call(method.model, method.layout.unflatten(method.theta(a[i])), (x[idx],))
        loss = loss + F.cross_entropy(logits, y[idx]) / len(cids)
    grads = dict(zip(sorted(names), torch.autograd.grad(loss, [params[n] for n in sorted(names)])))
    step = method.step_size(rnd)
    return {k: (v - step * grads[k] if k in names else v).detach() for k, v in params.items()}


@pytest.mark.parametrize(
    ("generator", "transform"),
    [("factorized", "blocked-dct"), ("deeplin", "blocked-dct"), ("factorized", "layer-kronecker")],
)
def test_the_server_step_is_gradient_descent_on_the_mean_batch_loss(generator, transform):
    """Without noise and clipping the release is P^T grad of the mean batch loss, so two rounds must equal two
    autograd SGD steps on omega (round 1 moves W only, since W = 0; round 2 checks h's parameters too). A step
    of the wrong sign, a missing J^T, or P instead of P^T fails this."""
    setup, method = build(
        SMALL,
        "method.privacy.epsilon=inf",
        "method.privacy.clip=1e9",
        "method.lr=0.5",
        f'method.generator="{generator}"',
        f'method.subspace_transform="{transform}"',
    )
    server = start(method, setup.clients).server
    for rnd in (1, 2):
        cids = [int(c) for c in setup.schedule[rnd - 1]]
        before = {k: v.clone() for k, v in server.omega.items()}
        expected = _autograd_step(method, server.omega, server.contexts, setup, rnd, cids)
        replies = {}
        for cid in cids:
            reply, _ = method.client_fit(method.configure_fit(server, rnd, cid), None, setup.clients[cid])
            method.validate_reply(server, "fit", rnd, cid, reply)
            replies[cid] = reply
        server, _ = method.aggregate_fit(server, rnd, replies)
        for k, v in expected.items():
            torch.testing.assert_close(server.omega[k], v, rtol=2e-4, atol=1e-7)
        moved = {k for k in expected if not torch.allclose(expected[k], before[k], rtol=0, atol=1e-6)}
        assert "W" in moved and (rnd == 1 or moved - {"W"}), moved  # round 2 moves h's parameters too


def test_a_secure_run_resumes_with_its_secrets_and_the_same_ledger(tmp_path):
    """The checkpoint keeps the clients' codec secrets and the server's key ring (both inside the trust
    boundary), so a resumed secure run decodes every later release; its ledger equals an uninterrupted run's."""
    setup, method = build(SECURE, 'method.codec="lrsuq"')
    full = run_federated(method, setup.clients, setup.schedule, progress=False)
    ckpt = tmp_path / "ckpt.pt"
    run_federated(
        build(SECURE, 'method.codec="lrsuq"')[1],
        setup.clients,
        setup.schedule,
        checkpoint=ckpt,
        progress=False,
        stop_after=5,
    )
    resumed = run_federated(
        build(SECURE, 'method.codec="lrsuq"')[1], setup.clients, setup.schedule, checkpoint=ckpt, progress=False
    )
    assert all(r["rejected"] == 0 for r in resumed.history)
    assert full.state.server.ledger.to_json() == resumed.state.server.ledger.to_json()
    assert not torch.equal(full.state.server.omega["W"], resumed.state.server.omega["W"])  # fresh noise


def test_the_cosine_step_decays_from_eta_to_near_zero():
    _, method = build(SMALL, "method.lr=0.4")
    rounds = len(method.schedule)
    steps = [method.step_size(t) for t in range(1, rounds + 1)]
    assert steps[0] == 0.4 and all(a > b for a, b in itertools.pairwise(steps)) and 0 < steps[-1] < 0.4 * 0.02
    assert method.step_size(rounds // 2 + 1) == pytest.approx(0.2)
    _, const = build(SMALL, "method.lr=0.4", 'method.lr_schedule="constant"')
    assert {const.step_size(t) for t in range(1, rounds + 1)} == {0.4}


def test_the_ledger_counts_the_releases_that_arrived_and_only_those():
    """A client lost before it answers released nothing and is not charged; a release that arrived counts even
    when it is then rejected, once per request however often it is resent; an unsolicited one is refused."""
    setup, method = build(SMALL)
    server = start(method, setup.clients).server
    a, b = (int(c) for c in setup.schedule[0])
    mechanism = f"coef-gradient/{method.codec.name}"
    msgs = {c: method.configure_fit(server, 1, c) for c in (a, b)}  # both asked
    assert not server.ledger.recorded(client=a, round=1, mechanism=mechanism)  # nothing counted at request
    reply, _ = method.client_fit(msgs[a], method.init_client(a), setup.clients[a])
    method.validate_reply(server, "fit", 1, a, reply)  # a answered; b was lost
    with pytest.raises(InvalidMessage):
        method.validate_reply(server, "fit", 1, a, Message(config={"payload": b"\x00" * 64}))  # resent, garbage
    assert server.ledger.recorded(client=a, round=1, mechanism=mechanism)
    assert not server.ledger.recorded(client=b, round=1, mechanism=mechanism)
    assert server.ledger.epsilon(a) > server.ledger.epsilon(b)
    others = [c for c in setup.clients if c not in (a, b) and setup.clients[c].seen]
    with pytest.raises(InvalidMessage, match="was not asked"):
        method.validate_reply(server, "fit", 1, others[0], reply)
    assert not server.ledger.recorded(client=others[0], round=1, mechanism=mechanism)
