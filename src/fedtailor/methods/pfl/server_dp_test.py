"""A trusted server's noise on the clipped sum (``[method.server_dp]``, ``methods/pfl/private.py``): the aggregate
is recomputed here from the replies and the noise key, every training client's eps is dp-accounting's fixed-size
subsampled Gaussian (sampled or not in a round), the sampling credit is real, a hostile update moves the model by
at most its clip over m, eps = inf is the base bit for bit, what the guarantee does not cover is said, and
adaptive clipping follows its count at the calibrated budget."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event, rdp
from dp_accounting.privacy_accountant import NeighboringRelation

from fedtailor.fl.checkpoint import load_checkpoint, save_checkpoint
from fedtailor.fl.loop import run_federated
from fedtailor.fl.records import InvalidMessage, Message
from fedtailor.methods.pfl.private import SERVER_MECHANISM, ServerDP
from fedtailor.methods.pfl.private_test import _fit, build
from fedtailor.privacy.accountant import epsilon_from_rho
from fedtailor.privacy.noise import secure_gaussian_noise
from fedtailor.rng import derive_key

SIM = [
    "federation.clients_per_round=2",  # 2 of the 5 clients a round: the sampling credit applies
    "method.server_dp.clip=0.5",
    "method.server_dp.epsilon=8",
    'method.server_dp.randomness="simulation"',
]


def _flat(params: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([params[n].double().reshape(-1) for n in names])


def _round(method, setup, server, rnd: int, replace: dict[int, Message] | None = None):
    cids = [int(c) for c in setup.schedule[rnd - 1]]
    _, out = _fit(method, server, setup, rnd, cids)
    replies = {c: out[c][0] for c in cids} | (replace or {})
    for c, r in replies.items():
        method.validate_reply(server, "fit", rnd, c, r)
    return cids, replies, method.aggregate_fit(server, rnd, replies)[0]


def test_the_aggregate_is_the_clipped_sum_plus_the_servers_noise_over_m():
    setup, method = build("fedper", *SIM)
    assert isinstance(method, ServerDP) and method.sigma == pytest.approx(2 * 0.5 * method.noise_multiplier)
    server = method.init_server()
    names = method.base.shared_names(server)
    start = _flat(server.params, names)
    cids, replies, new = _round(method, setup, server, 1)
    total = torch.zeros_like(start)
    for c in cids:
        d = _flat(replies[c].arrays, names) - start
        total += d * min(1.0, 0.5 / float(d.norm()))
    noise = secure_gaussian_noise(
        derive_key(setup.cfg.seed, "server-dp", 1), "server-dp", sigma=method.sigma, size=start.numel()
    )
    expected = start + (total + torch.from_numpy(noise)) / len(cids)
    assert torch.allclose(_flat(new.params, names), expected, atol=1e-6)
    assert not torch.allclose(_flat(new.params, names), start + total / len(cids), atol=1e-4)  # noise was added


def test_every_training_client_is_charged_dp_accountings_fixed_size_sampled_gaussian_each_round():
    setup, method = build("fedavg", *SIM)
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    ledger = result.state.server.ledger
    seen = sorted(c for c, d in setup.clients.items() if d.seen)
    n, m, rounds = len(seen), setup.schedule.shape[1], setup.schedule.shape[0]
    assert ledger.clients == seen and len(ledger.releases) == n * rounds  # sampled in a round or not
    assert {r.mechanism for r in ledger.releases} == {SERVER_MECHANISM}
    acc = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(
        dp_event.SampledWithoutReplacementDpEvent(n, m, dp_event.GaussianDpEvent(method.noise_multiplier)), rounds
    )
    sampled = acc.get_epsilon(1e-5)  # dp-accounting's own orders
    # the ledger takes the smaller of that and the rounds without the sampling credit (both valid bounds)
    no_credit = epsilon_from_rho(rounds / (2 * method.noise_multiplier**2), delta=1e-5, conversion="closed-form")
    independent = min(sampled, no_credit)
    for eps in ledger.epsilons().values():
        assert eps == pytest.approx(independent, rel=0.02) and eps >= independent * (1 - 1e-9)
    assert max(ledger.epsilons().values()) <= 8.0 * (1 + 1e-6)  # calibrated to the target
    # the sampling credit: the same rounds and noise without client sampling cost every client more
    plain = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    plain.compose(dp_event.GaussianDpEvent(method.noise_multiplier), rounds)
    assert sampled < 0.8 * plain.get_epsilon(1e-5)
    summary = method.summary(result.state.server)
    assert "not the server itself" in summary["epsilon_holds_against"] and summary["dp"].startswith("client-level")


def test_a_hostile_update_moves_the_model_by_at_most_its_clip_over_m():
    setup, method = build("fedavg", *SIM)
    server = method.init_server()
    names = method.base.shared_names(server)
    cids, replies, honest = _round(method, setup, server, 1)
    bad = cids[0]
    huge = Message(arrays={k: v + 1e6 for k, v in replies[bad].arrays.items()}, config=dict(replies[bad].config))
    server = method.init_server()
    _, _, poisoned = _round(method, setup, server, 1, {bad: huge})
    moved = float((_flat(poisoned.params, names) - _flat(honest.params, names)).norm())
    assert 0 < moved <= 2 * 0.5 / len(cids) + 1e-5  # the same noise: only the clipped update differs
    nan = Message(
        arrays={k: v * float("nan") for k, v in replies[bad].arrays.items()}, config=dict(replies[bad].config)
    )
    with pytest.raises(InvalidMessage):
        method.validate_reply(method.init_server(), "fit", 1, bad, nan)


def test_without_noise_it_is_the_method_bit_for_bit():
    setup, method = build("ditto", "method.server_dp.epsilon=inf")
    _, plain = build("ditto")
    a = run_federated(method, setup.clients, setup.schedule, progress=False).state.server
    b = run_federated(plain, setup.clients, setup.schedule, progress=False).state.server
    assert all(torch.equal(a.params[k], b.params[k]) for k in b.params)


def test_what_it_cannot_cover_is_refused_in_one_line():
    with pytest.raises(ValueError, match="conflict score reads each client's update"):
        build("fedavg", *SIM, "method.fedlag.top_k=1")
    with pytest.raises(ValueError, match="choose one of"):
        build("fedavg", *SIM, "method.client_dp.epsilon=8")
    _, method = build("fedavg", "method.server_dp.epsilon=1e-3", "method.server_dp.noise_multiplier=1.0")
    with pytest.raises(Exception, match="above the target"):
        method.init_server()
    assert math.isfinite(method.sigma) and np.isfinite(method.q)


# ----- adaptive clipping (Andrew et al. 2021) ---------------------------------------------------------------
ADAPTIVE = [*SIM, "method.server_dp.adaptive_clip=true", "method.server_dp.count_noise=4"]


def test_adaptive_clip_follows_the_noisy_count_of_updates_within_it():
    setup, method = build("fedavg", *ADAPTIVE)
    assert method.adaptive and method.count_noise == 4.0
    z, z_u = method.noise_multiplier, method.update_multiplier
    assert z_u > z and (z_u**-2 + 4.0**-2) ** -0.5 == pytest.approx(z, rel=1e-12)  # the joint release's z
    server = method.init_server()
    names = method.base.shared_names(server)
    clip = 0.5
    for rnd in (1, 2):  # round 2 clips at the clip round 1 chose
        assert server.clip == pytest.approx(clip, rel=1e-12)
        start = _flat(server.params, names)
        cids, replies, new = _round(method, setup, server, rnd)
        total, within = torch.zeros_like(start), 0
        for c in cids:
            d = _flat(replies[c].arrays, names) - start
            within += float(d.norm()) <= clip
            total += d * min(1.0, clip / float(d.norm()))
        noise = secure_gaussian_noise(
            derive_key(setup.cfg.seed, "server-dp", rnd), "server-dp", sigma=z_u * 2 * clip, size=start.numel()
        )
        expected = start + (total + torch.from_numpy(noise)) / len(cids)
        assert torch.allclose(_flat(new.params, names), expected, atol=1e-6)
        count_key = derive_key(setup.cfg.seed, "server-dp-count", rnd)
        count = secure_gaussian_noise(count_key, "server-dp-count", sigma=4.0, size=1)
        clip *= math.exp(-0.2 * ((within + float(count[0])) / len(cids) - 0.5))
        assert new.clip == pytest.approx(clip, rel=1e-12) and new.clip != server.clip
        recorded = [r for r in new.ledger.releases if r.round == rnd]
        assert {(r.sensitivity, r.sigma) for r in recorded} == {(2 * server.clip, 2 * server.clip * z)}
        server = new


def test_adaptive_clipping_spends_what_fixed_clipping_does_and_dp_accounting_agrees(tmp_path):
    full = ["method.server_dp.count_noise=4", "method.server_dp.adaptive_clip=true"]
    setup, method = build("fedavg", "method.server_dp.epsilon=8", 'method.server_dp.randomness="simulation"', *full)
    _, fixed = build("fedavg", "method.server_dp.epsilon=8", 'method.server_dp.randomness="simulation"')
    assert method.q == 1.0 and method.noise_multiplier == fixed.noise_multiplier  # the same calibration
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    server = result.state.server
    rounds = setup.schedule.shape[0]
    # the round's two noisy sums composed by dp-accounting cost what one Gaussian of the joint z does
    joint = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    parts = [dp_event.GaussianDpEvent(method.update_multiplier), dp_event.GaussianDpEvent(method.count_noise)]
    joint.compose(dp_event.ComposedDpEvent(parts), rounds)
    single = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    single.compose(dp_event.GaussianDpEvent(method.noise_multiplier), rounds)
    assert joint.get_epsilon(1e-5) == pytest.approx(single.get_epsilon(1e-5), rel=1e-9)
    run_fixed = run_federated(fixed, setup.clients, setup.schedule, progress=False).state.server
    assert server.ledger.epsilons() == pytest.approx(run_fixed.ledger.epsilons(), rel=1e-9)
    assert max(server.ledger.epsilons().values()) <= 8.0 * (1 + 1e-6)
    summary = method.summary(server)
    assert summary["dp_clip_next"] == server.clip and summary["update_noise_multiplier"] == method.update_multiplier
    save_checkpoint(tmp_path / "ck.pt", result.state, setup.schedule)  # the clip travels with the state
    assert load_checkpoint(tmp_path / "ck.pt", setup.schedule).server.clip == server.clip


def test_adaptive_clipping_refuses_a_count_noise_below_the_noise_multiplier():
    with pytest.raises(ValueError, match="must exceed the noise multiplier"):
        build("fedavg", *SIM, "method.server_dp.adaptive_clip=true")  # m/20 = 0.1 with 2 clients a round
