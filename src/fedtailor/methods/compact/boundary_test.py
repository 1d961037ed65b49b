"""Compact adaptation at the federation boundary: what an honest-but-curious server can regenerate, what a client
refuses to release, the norm bounds on what the server accepts, and the fixed-size abstention."""

from __future__ import annotations

import dataclasses
import math
import stat

import numpy as np
import pytest
import torch

from fedtailor.codecs import release_key
from fedtailor.codecs.format import unpad
from fedtailor.fl.checkpoint import load_checkpoint, save_checkpoint
from fedtailor.fl.loop import run_federated, start
from fedtailor.fl.records import Abstained, InvalidMessage, Message, RequestRefused
from fedtailor.methods.compact.adaptation import CompactClient
from fedtailor.methods.compact.adaptation_test import SMALL
from fedtailor.methods.compact.privacy_test import SECURE, build
from fedtailor.privacy.mechanisms import release_norm_bound
from fedtailor.privacy.noise import gaussian_noise, secure_gaussian_noise
from fedtailor.rng import derive_key


def _keys(obj, out: set[int]) -> set[int]:
    """Every integer of 64 bits or more anywhere in ``obj`` (dataclasses, dicts, sequences, byte strings of 32
    bytes read as keys): each is a candidate secret."""
    if isinstance(obj, bool):
        return out
    if isinstance(obj, int) and obj.bit_length() >= 64:
        out.add(obj)
    elif isinstance(obj, (bytes, bytearray)) and len(obj) == 32:
        out.add(int.from_bytes(obj, "little"))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _keys(getattr(obj, f.name), out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _keys(k, out)
            _keys(v, out)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _keys(v, out)
    return out


def _secure_release(codec: str):
    """A secure-mode run's setup and first release of one client: (setup, method, loop state, cid, u, decoded y,
    the reply)."""
    setup, method = build(SECURE, f'method.codec="{codec}"')
    state = start(method, setup.clients)
    cid = int(setup.schedule[0, 0])
    msg = method.configure_fit(state.server, 1, cid)
    _, u = method.release_input(msg.arrays["a"], 1, setup.clients[cid])
    reply, state.clients[cid] = method.client_fit(msg, state.clients[cid], setup.clients[cid])
    method.validate_reply(state.server, "fit", 1, cid, reply)
    state.round = 1
    return setup, method, state, cid, u, method.decode(state.server, 1, cid, reply), reply


@pytest.mark.parametrize("codec", ["dg-fp32", "dg-q12", "lrsuq", "ppr"])
def test_the_server_side_cannot_regenerate_the_noise_of_a_secure_release(codec, tmp_path):
    """Everything the server side holds (its state with the key ring, a checkpoint of the whole run, which in
    this in-process run even holds the clients' states, and the reply) gives no key whose Gaussian stream
    correlates with the real noise y - u. Each candidate is tried as the noise key itself, as the release key
    made from it, and as the seed's simulation keys, through both samplers (SHAKE-256 and ChaCha20); under
    independence a correlation is N(0, 1/k), so the bound 6/sqrt(k) fails an honest run with probability < 1e-8
    per candidate, while a regenerable noise gives a correlation near 1 (the old secure mode, where DG noise came
    from the shared release key)."""
    setup, method, state, cid, u, y, reply = _secure_release(codec)
    e = y - u
    ckpt = tmp_path / "checkpoint.pt"
    save_checkpoint(ckpt, state, setup.schedule)
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o600  # it holds the decoder's key ring: owner-only
    held = load_checkpoint(ckpt, setup.schedule)
    secrets = _keys(held, set()) | _keys(reply.config, set())
    assert state.server.codec_secrets[cid] in secrets  # the key ring is really in what the attack gets
    candidates = set()
    for s in secrets:
        candidates |= {s, release_key(s, cid, 1), derive_key(s, "dg-noise", cid, 1)}
    candidates |= {release_key(derive_key(method.seed, "release-secret", cid), cid, 1)}
    k, sigma = len(e), state.server.sigma
    worst = max(
        abs(float(np.corrcoef(sampler(key, "dg", sigma=sigma, size=k), e)[0, 1]))
        for key in candidates
        for sampler in (gaussian_noise, secure_gaussian_noise)  # the simulation and the secure (ChaCha20) sampler
    )
    assert worst < 6 / math.sqrt(k), f"the server regenerates the noise (correlation {worst:.3f})"


def test_what_a_holder_of_the_lrsuq_key_learns():
    """LRSUQ's noise is its quantisation error, a function of the shared randomness the decoder needs: with the
    key, the decoder knows each block's layer radius rho, and the error of every block lies inside it (the
    documented leak of docs/privacy.md: its eps holds against everyone without the key, not the decoder).
    A Gaussian error with no key known would leave such balls in about 15% of the blocks."""
    _, method, state, cid, u, y, _ = _secure_release("lrsuq")
    codec, sigma = method.codec, state.server.sigma
    key = release_key(state.server.codec_secrets[cid], cid, 1)
    b = codec.block_size
    n = codec.blocks_of(len(u))
    rho = codec.decoder_radius(key, sigma, n)
    err = np.zeros(n * b)
    err[: len(u)] = y - u
    assert np.all(np.linalg.norm(err.reshape(n, b), axis=1) <= rho * (1 + 1e-9))
    unrelated = codec.decoder_radius(derive_key(1, "unrelated"), sigma, n)  # a key the decoder does not hold
    assert np.mean(np.linalg.norm(err.reshape(n, b), axis=1) > unrelated) > 0.05


# ----- what a client refuses ------------------------------------------------------------------------------------
def _asked(method, server, rnd: int, cid: int, **change) -> Message:
    msg = method.configure_fit(server, rnd, cid)
    return Message(arrays=msg.arrays, config={**msg.config, **change})


@pytest.mark.parametrize("codec", ["dg-fp32", "lrsuq"])
def test_a_client_refuses_what_its_own_plan_does_not_allow(codec):
    setup, method = build(SMALL, f'method.codec="{codec}"')
    state = start(method, setup.clients)
    rnd, cid = 1, int(setup.schedule[0, 0])
    data, own = setup.clients[cid], state.clients.get(cid)
    sigma = state.server.sigma
    unscheduled = next(r for r in range(1, len(setup.schedule) + 1) if cid not in setup.schedule[r - 1])
    for change, why in (
        ({"sigma": sigma / 2}, "below its own"),
        ({"sigma": 0.0}, "below its own"),
        ({"round": unscheduled}, "not scheduled"),
        ({"round": 10_000}, "outside the schedule"),
    ):
        with pytest.raises(RequestRefused, match=why):
            method.client_fit(_asked(method, state.server, rnd, cid, **change), own, data)
    reply, after = method.client_fit(_asked(method, state.server, rnd, cid), own, data)
    assert after.released == frozenset({rnd})
    with pytest.raises(RequestRefused, match="already released"):  # the same key on a new input
        method.client_fit(_asked(method, state.server, rnd, cid), after, data)
    if codec == "lrsuq":
        size = state.server.pad_bytes
        assert len(reply.config["payload"]) == size
        for other in (size + 8, None):
            msg = _asked(method, state.server, rnd, cid)
            msg.config.pop("pad_bytes")
            if other is not None:
                msg.config["pad_bytes"] = other
            with pytest.raises(RequestRefused, match="fixed size"):
                method.client_fit(msg, own, data)
    with pytest.raises(RequestRefused, match="setup"):  # one context release per client, never two
        method.client_setup(method.configure_setup(state.server, cid), CompactClient(codec_secret=1, set_up=True), data)


def test_the_deployment_risks_name_what_voids_the_guarantee():
    _, sim = build(SMALL, 'method.codec="lrsuq"', "method.diagnostics=true", "method.padding=false")
    assert set(sim.deployment_risks()) == {"simulation-randomness", "diagnostics", "unpadded"}
    _, secure = build(SECURE, 'method.codec="lrsuq"')
    assert secure.deployment_risks() == {}
    assert "not the decoder" in secure.holds_against() and "seed" in sim.holds_against()
    _, dense = build(SECURE)
    assert dense.holds_against().startswith("the server")


# ----- what the server accepts ----------------------------------------------------------------------------------
def test_a_release_no_clipped_input_reaches_is_rejected():
    """The server decodes a DG release of ||u|| = 10 (clip 1), forged with the right key: rejected, while
    inputs at the clip norm pass the bound in every one of 200 draws (its tail is 1e-12)."""
    setup, method = build(SMALL)
    state = start(method, setup.clients)
    server, cid = state.server, int(setup.schedule[0, 0])
    key = release_key(method._simulation_secret(cid), cid, 1)
    u = np.zeros(method.k)
    u[0] = 10.0
    forged = Message(config={"payload": method.codec.encode(u, key=key, sigma=server.sigma)})
    before = server.ledger.to_json()
    with pytest.raises(InvalidMessage, match="no clipped input"):
        method.validate_reply(server, "fit", 1, cid, forged)
    assert server.ledger.to_json() != before  # it reached the server: charged as the release it stands for
    bound = release_norm_bound(method.clip, server.sigma, method.k)
    rng = np.random.default_rng(0)
    at_clip = np.eye(1, method.k).ravel() * method.clip
    assert max(np.linalg.norm(at_clip + server.sigma * rng.standard_normal(method.k)) for _ in range(200)) < bound


def test_one_context_moves_the_context_statistics_by_a_bounded_amount():
    """A context beyond the norm a bounded context plus noise reaches is refused (the old per-coordinate check
    let it through); one at the bound moves the seen clients' mean by at most 2 B / n."""
    setup, method = build(SMALL)
    server = method.init_server()
    replies = {}
    for cid in sorted(setup.clients):
        reply, _ = method.client_setup(method.configure_setup(server, cid), None, setup.clients[cid])
        replies[cid] = reply
    bound = release_norm_bound(1.0, server.sigma, method.context_dim)
    target = method.seen[0]
    too_far = Message(
        arrays={"context": torch.full((method.context_dim,), 1.2 * bound / math.sqrt(method.context_dim))}
    )
    with pytest.raises(InvalidMessage, match="norm"):
        method.validate_reply(server, "setup", 0, target, too_far)
    honest = method.aggregate_setup(method.init_server(), dict(replies)).omega["c_mean"]
    edge = torch.full((method.context_dim,), 0.999 * bound / math.sqrt(method.context_dim))
    method.validate_reply(server, "setup", 0, target, Message(arrays={"context": edge}))
    hostile = method.aggregate_setup(method.init_server(), {**replies, target: Message(arrays={"context": edge})})
    moved = float(torch.linalg.vector_norm(hostile.omega["c_mean"] - honest))
    assert 0 < moved <= 2 * bound / len(method.seen)


def test_a_release_too_long_for_the_fixed_size_is_a_fixed_size_abstention(tmp_path):
    """With a fixed size no message fits (64 bytes), every client abstains: each reply has exactly that size and
    says nothing else, nothing raises, every abstention is charged, and the run counts them apart from
    rejections."""
    setup, method = build(SMALL, 'method.codec="lrsuq"', "method.pad_bytes=64", "federation.rounds=3")
    state = start(method, setup.clients)
    cid = int(setup.schedule[0, 0])
    reply, _ = method.client_fit(method.configure_fit(state.server, 1, cid), state.clients.get(cid), setup.clients[cid])
    assert set(reply.config) == {"payload"} and len(reply.config["payload"]) == 64
    assert unpad(reply.config["payload"], size=64) == b""
    with pytest.raises(Abstained):
        method.validate_reply(state.server, "fit", 1, cid, reply)
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    per_round = setup.schedule.shape[1]
    assert all(r["abstained"] == per_round and r["rejected"] == 0 for r in result.history)
    releases = [r for r in result.state.server.ledger.releases if r.mechanism.startswith("coef-gradient")]
    assert len(releases) == per_round * 3
