"""pFedDPO, FedDPO and centralized DPO on a tiny randomly initialised Llama: what is uploaded, what stays,
how bases are averaged, the kappa^2 diagnostics against their definition, and short runs that learn."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("peft")

from fedtailor.fl.loop import run_federated, start
from fedtailor.fl.records import ClientData, InvalidMessage, Message
from fedtailor.lm.model import tiny_llama
from fedtailor.lm.preference import PreferencePair, tokenize_pairs
from fedtailor.lm.training import dpo_on
from fedtailor.methods.dpo.pfeddpo import CentralizedDPO, PFedDPO


class CharTokenizer:
    eos_token_id, pad_token_id = 1, 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [2 + (ord(c) % 120) for c in text]


def _clients(n: int = 3, pairs: int = 8) -> dict[int, ClientData]:
    rng = np.random.default_rng(0)
    words = ["yes", "no", "maybe", "sure", "never", "always", "fine", "bad"]
    out = {}
    for cid in range(n):
        # each client prefers its own word: personal preferences that differ
        mk = lambda: PreferencePair(
            prompt=f"q{rng.integers(10)}:",
            chosen=f" {words[cid]}",
            rejected=f" {words[(cid + 1 + rng.integers(n)) % len(words)]}",
        )
        train = tokenize_pairs(CharTokenizer(), [mk() for _ in range(pairs)], max_length=16)
        held = tokenize_pairs(CharTokenizer(), [mk() for _ in range(4)], max_length=16)
        out[cid] = ClientData(cid=cid, seen=True, train=train, eval=held)
    return out


def _method(personal: bool = True, **kw) -> PFedDPO:
    args = {
        "model": tiny_llama(seed=3),
        "beta": 0.5,
        "lr": 3e-3,
        "local_steps": 2,
        "batch_size": 4,
        "grad_clip": 1.0,
        "seed": 0,
        "rounds": 6,
        "lora_rank": 2,
        "lora_alpha": 4,
    }
    args.update(kw)
    return PFedDPO(personal=personal, **args)


def test_only_the_base_is_uploaded_and_the_adapter_stays_on_its_client():
    method, clients = _method(), _clients()
    setup_reply, _ = method.client_setup(method.configure_setup(method.init_server(), 0), None, clients[0])
    assert not setup_reply.arrays  # the reference log-probabilities stay on the client
    state = start(method, clients)
    msgs, replies, states = {}, {}, {}
    for cid in clients:
        msgs[cid] = method.configure_fit(state.server, 1, cid)
        replies[cid], states[cid] = method.client_fit(msgs[cid], state.clients[cid], clients[cid])
        assert not [n for n in replies[cid].arrays if "lora_" in n]  # no adapter tensor in the upload
        assert set(replies[cid].arrays) == set(method.base_names)
        method.validate_reply(state.server, "fit", 1, cid, replies[cid])
        assert states[cid].adapter and states[cid].moments  # the adapter and its AdamW moments stay
    assert any(not torch.equal(states[0].adapter[n], method.adapter0[n]) for n in method.adapter_names)
    # a reply that smuggles an adapter tensor is refused
    leak = Message(
        arrays={**replies[0].arrays, method.adapter_names[0]: states[0].adapter[method.adapter_names[0]]},
        config=replies[0].config,
    )
    with pytest.raises(InvalidMessage, match="exactly the base"):
        method.validate_reply(state.server, "fit", 1, 0, leak)
    # aggregation is the mean of the client bases (equal pair counts)
    acc = None
    for cid in clients:
        acc = method.fold_fit(state.server, 1, acc, cid, replies[cid])
    server, metrics = method.finish_fit(state.server, 1, acc)
    for n in method.base_names[:5]:
        torch.testing.assert_close(server.base[n], sum(replies[c].arrays[n] for c in clients) / len(clients))
    assert metrics["base_grad_norm"] > 0


def test_feddpo_averages_the_whole_model_and_has_no_adapters():
    method = _method(personal=False)
    assert not method.adapter_names and method.name == "feddpo"
    result = run_federated(method, _clients(), np.tile(np.arange(3), (2, 1)), progress=False)
    assert result.history[-1]["rejected"] == 0


def test_a_short_pfeddpo_run_lowers_the_loss_and_raises_training_reward_accuracy():
    method, clients = _method(), _clients()
    schedule = np.tile(np.arange(3), (6, 1))
    result = run_federated(method, clients, schedule, eval_every=6, progress=False)
    losses = [r["loss"] for r in result.history]
    assert losses[-1] < losses[0] - 0.05
    train_acc = np.mean([m["train_accuracy"] for m in result.evaluation.values()])
    assert train_acc >= 0.8  # from 0.5 (ties at the start: the reference is the initial model)


def test_validation_pairs_alongside_score_as_they_do_in_place_of_the_held_out_ones():
    """data.validation_mode = "alongside": each client's validation pairs get their own cached reference
    log-probabilities, so their val_* metrics equal those of a run that evaluates on them instead (replace)."""
    clients = _clients()
    val = {c: clients[(c + 1) % 3].eval for c in clients}  # a set of pairs other than its held-out ones
    alongside = {c: dataclasses.replace(d, val=val[c]) for c, d in clients.items()}
    instead = {c: dataclasses.replace(d, eval=val[c]) for c, d in clients.items()}
    schedule = np.tile(np.arange(3), (2, 1))
    a = run_federated(_method(rounds=2), alongside, schedule, eval_every=2, progress=False)
    b = run_federated(_method(rounds=2), instead, schedule, eval_every=2, progress=False)
    for c in clients:
        assert len(a.state.clients[c].ref_eval) == 2 and len(b.state.clients[c].ref_eval) == 1
        assert a.evaluation[c]["val_accuracy"] == b.evaluation[c]["accuracy"]
        assert a.evaluation[c]["val_loss"] == b.evaluation[c]["loss"]
        assert a.evaluation[c]["loss"] != a.evaluation[c]["val_loss"]  # the held-out pairs scored apart
        assert "val_train_accuracy" not in a.evaluation[c]  # the training pairs scored once
        assert a.evaluation[c]["train_accuracy"] == b.evaluation[c]["train_accuracy"]
    method = _method(rounds=2)
    with pytest.raises(ValueError, match="client 0 has no reference log-probabilities of its evaluation pairs"):
        method.client_evaluate(Message(arrays=dict(a.state.server.base)), b.state.clients[0], clients[0])


def test_centralized_dpo_trains_one_model_on_the_pooled_pairs():
    args = {
        "model": tiny_llama(seed=3),
        "beta": 0.5,
        "lr": 3e-3,
        "local_steps": 2,
        "batch_size": 4,
        "grad_clip": 1.0,
        "seed": 0,
        "rounds": 6,
    }
    method, clients = CentralizedDPO(**args), _clients()
    result = run_federated(method, clients, np.tile(np.arange(3), (6, 1)), eval_every=6, progress=False)
    assert len(result.state.server.pool["ref"]) == 24  # 3 clients x 8 pairs pooled once
    assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_kappa2_is_the_mean_squared_distance_of_client_gradients_from_their_mean():
    method, clients = _method(diagnostics_every=1, diagnostic_pairs=4), _clients()
    state = start(method, clients)
    grads = []
    for cid in clients:  # the definition, client by client, at the same base
        method._load(state.server.base, None)
        grads.append(method._diagnostics(clients[cid], state.clients[cid])["grad_off"].double())
    g = torch.stack(grads)
    want = float(((g - g.mean(0)) ** 2).sum(1).mean())
    result = run_federated(method, clients, np.tile(np.arange(3), (1, 1)), progress=False)
    rec = result.history[0]
    assert rec["kappa2"] == pytest.approx(want, rel=1e-4)
    assert rec["kappa2_rel"] == pytest.approx(want / float((g.mean(0) ** 2).sum()), rel=1e-4)
    assert rec["kappa2_adapted"] + rec["kappa2_other"] == pytest.approx(rec["kappa2"])
    assert rec["kappa2_adapted"] > 0 and rec["kappa2_other"] > 0 and rec["adapter_grad_sq_mean"] > 0
    assert method.summary(result.state.server)["diagnostics_sent"] is True


def test_a_spilled_running_sum_gives_the_same_bases_bit_for_bit_and_leaves_no_file(tmp_path, monkeypatch):
    """spill_sum keeps the round's sum of bases on disk between folds (one base less in memory while a client
    trains); the averaged bases must not change by a bit, and the temporary file must be gone after the round."""
    import tempfile

    import fedtailor.methods.dpo.pfeddpo as mod

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    written, write = [], mod._write_sum
    monkeypatch.setattr(mod, "_write_sum", lambda path, total: (written.append(path), write(path, total)))
    schedule = np.tile(np.arange(3), (2, 1))
    plain = run_federated(_method(), _clients(), schedule, progress=False)
    spilled_method = _method(spill_sum=True)
    spilled = run_federated(spilled_method, _clients(), schedule, progress=False)
    assert spilled_method.spill_sum and [h["loss"] for h in plain.history] == [h["loss"] for h in spilled.history]
    for n, t in plain.state.server.base.items():
        assert torch.equal(t, spilled.state.server.base[n]), n
    assert len(written) == 6 and all(tmp_path in p.parents for p in written)  # 2 rounds x 3 folds, on disk
    assert not list(tmp_path.iterdir())  # the round's sum file and folder were removed


@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_round_cut_short_between_folds_leaves_no_spill_folder(tmp_path, monkeypatch, failure):
    """An error or Ctrl-C in a client's training after the round's sum was spilled: the run stops and the
    temporary folder is gone (the runner closes the method however the run ends)."""
    import tempfile
    from types import SimpleNamespace

    from fedtailor import runner
    from fedtailor.config import load_config
    from fedtailor.fl.loop import RunInterrupted

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    method, spilled = _method(spill_sum=True), []
    real = method.client_fit

    def fit(msg, state, data):
        if int(msg.config["round"]) == 2 and data.cid == 1:  # client 0's base is folded in and on disk
            spilled.extend(p for d in temp.iterdir() for p in d.iterdir())
            raise failure
        return real(msg, state, data)

    monkeypatch.setattr(method, "client_fit", fit)
    setup = SimpleNamespace(clients=_clients(), schedule=np.tile(np.arange(3), (2, 1)))
    monkeypatch.setattr(runner, "build_setup", lambda cfg: setup)
    monkeypatch.setattr(runner, "build_method", lambda s: method)
    cfg = load_config(
        None,
        [
            'method.name="pfeddpo"',
            "data.num_clients=3",
            "data.num_unseen=0",
            "federation.rounds=2",
            "federation.clients_per_round=3",
            "method.spill_sum=true",
        ],
    )
    with pytest.raises((RuntimeError, RunInterrupted)):
        runner.run_experiment(cfg, tmp_path / "run", progress=False)
    assert [p.name for p in spilled] == ["sum.safetensors"]
    assert not list(temp.iterdir())  # the folder of the spilled sum is removed, not left for the OS


# --- record-level DP: pair-level DP-SGD ------------------------------------------------------------------------
def _private(personal: bool = True, schedule: np.ndarray | None = None, **dp) -> PFedDPO:
    from fedtailor.methods.pfl.local import RecordDPConfig

    cfg = RecordDPConfig(**{"epsilon": 8.0, "clip": 0.5, "randomness": "simulation", **dp})
    schedule = np.tile(np.arange(3), (3, 1)) if schedule is None else schedule
    return _method(personal, train_sizes=dict.fromkeys(range(3), 8), record_dp=cfg, schedule=schedule)


def test_one_pair_moves_the_clipped_sum_by_at_most_the_clip_over_base_and_adapter_together():
    """The sensitivity of a DP-SGD step of pFedDPO: removing one pair from a batch moves the pre-noise sum (every
    trained tensor, the private adapter included) by at most C; with a clip above every gradient the sum is the
    plain sum of the pairs' gradients (nothing is clipped by mistake)."""
    from fedtailor.lm.dpsgd import clipped_pair_sum

    method, clients = _private(), _clients()
    state = start(method, clients)
    data, ref = clients[0], state.clients[0].ref_train
    method._load(state.server.base, None)
    trained = {n: method.params[n] for n in (*method.base_names, *method.adapter_names)}
    idx = torch.arange(6)
    for clip in (0.05, 0.5):
        full, _ = clipped_pair_sum(method.model, trained, data.train, ref, idx, beta=0.5, clip=clip)
        for drop in range(6):
            part, _ = clipped_pair_sum(method.model, trained, data.train, ref, idx[idx != drop], beta=0.5, clip=clip)
            moved = torch.sqrt(sum(((full[n] - part[n]).double() ** 2).sum() for n in trained))
            assert moved <= clip * (1 + 1e-6)
        assert any(float(full[n].abs().sum()) > 0 for n in method.adapter_names)  # the adapter is in the clip
    single, _ = clipped_pair_sum(method.model, trained, data.train, ref, idx[:1], beta=0.5, clip=1e9)
    method.model.zero_grad(set_to_none=True)
    dpo_on(method.model, data.train, ref, idx[:1], beta=0.5).loss.backward()
    for n in trained:
        torch.testing.assert_close(single[n], method.params[n].grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_private_dpo_step_is_the_noisy_clipped_sum_over_the_sampled_pairs_by_hand(monkeypatch, threads):
    """One step of ``private_dpo_steps`` with plain SGD at lr 1: every trained tensor moves by ``(sum_j clip_C(g_j)
    + zeta C z) / (q N)``, the pairs j those whose uniform of the key's ``("sample", 0)`` stream is below q, z the
    step's secure noise tensor by tensor and chunk by chunk (the chunk made small here, so that tensors span
    several), whether one thread draws the chunks or several do."""
    import fedtailor.lm.dpsgd as lm_dpsgd
    from fedtailor.lm.dpsgd import clipped_pair_sum, private_dpo_steps
    from fedtailor.privacy.noise import open_unit, secure_gaussian_noise, secure_stream_words

    monkeypatch.setattr(lm_dpsgd, "NOISE_CHUNK", 7)
    method, clients = _private(), _clients()
    state = start(method, clients)
    data, ref = clients[0], state.clients[0].ref_train
    method._load(state.server.base, None)
    trained = {n: method.params[n] for n in (*method.base_names, *method.adapter_names)}
    before = {n: p.detach().clone() for n, p in trained.items()}
    key, clip, zeta, n, q = 12345, 0.05, 0.7, len(ref), 4 / len(ref)
    chosen = (torch.from_numpy(open_unit(secure_stream_words(key, "sample", 0, count=n))) < q).nonzero().reshape(-1)
    assert 0 < len(chosen) < n
    sums, _ = clipped_pair_sum(method.model, trained, data.train, ref, chosen, beta=0.5, clip=clip)
    opt = torch.optim.SGD(trained.values(), lr=1.0)
    private_dpo_steps(
        method.model, trained, opt, data.train, ref, steps=1, batch_size=4, beta=0.5, clip=clip,
        noise_multiplier=zeta, key=key, threads=threads,
    )  # fmt: skip
    for i, (name, p) in enumerate(trained.items()):
        z = np.concatenate(
            [
                secure_gaussian_noise(key, "noise", 0, i, j, sigma=zeta * clip, size=min(7, p.numel() - start))
                for j, start in enumerate(range(0, p.numel(), 7))
            ]
        )
        step = (sums[name].double().reshape(-1) + torch.from_numpy(z)) / (q * n)
        torch.testing.assert_close(p.detach(), before[name] - step.reshape(p.shape).to(p.dtype), rtol=1e-6, atol=1e-7)


def test_a_private_run_sends_the_base_alone_and_reports_the_eps_of_dp_accounting():
    """pFedDPO under record_dp: each reply carries the base and the public pair count only; the ledger holds one
    release per participation; every client's eps equals dp-accounting's RDP composition of its Poisson-subsampled
    Gaussian steps, and the calibrated noise keeps the worst within the target."""
    import dp_accounting

    from fedtailor.privacy.ledger import PrivacyBudgetExceeded

    method, clients = _private(), _clients()
    result = run_federated(method, clients, np.tile(np.arange(3), (3, 1)), progress=False)
    summary = method.summary(result.state.server)
    assert len(result.state.server.ledger.releases) == 9 and result.history[-1]["rejected"] == 0
    assert "loss" not in result.history[-1]  # no client sent a training statistic
    z, q, steps = method.noise_multiplier, 4 / 8, method.local_steps * 3
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps
    )
    orders = [2 + k / 8 for k in range(8 * 62)] + list(range(64, 513))  # finer than the ledger's
    rdp = dp_accounting.rdp.RdpAccountant(orders).compose(event).get_epsilon(1e-5)
    pld = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-5)
    for eps in summary["epsilon_per_client"].values():
        assert rdp <= eps <= 1.01 * rdp  # the ledger's coarser orders: never below, within 1%
        assert pld <= eps < 1.5 * pld  # RDP is an upper bound, PLD near-tight
    assert 7.9 < summary["epsilon_max"] <= 8.0 + 1e-9 and not summary["epsilon_void"]
    with pytest.raises(PrivacyBudgetExceeded, match="client 0 would reach"):  # a fourth release would pass eps
        method.configure_fit(result.state.server, 4, 0)
    fresh = start(method, clients)
    reply, _ = method.client_fit(method.configure_fit(fresh.server, 1, 0), fresh.clients[0], clients[0])
    assert set(reply.config) == {"num_examples"} and set(reply.arrays) == set(method.base_names)


def test_private_noise_is_the_clients_own_in_secure_mode_and_reproducible_in_simulation():
    """Secure mode: the same client fit twice from the same state sends different bases (the noise and the pair
    sampling come from a fresh key of its OS entropy, nothing the server holds); simulation: bit for bit equal."""
    clients = _clients()
    for randomness, equal in (("simulation", True), ("secure", False)):
        method = _private(randomness=randomness)
        state = start(method, clients)
        msg = method.configure_fit(state.server, 1, 0)
        a, _ = method.client_fit(msg, state.clients[0], clients[0])
        b, _ = method.client_fit(msg, state.clients[0], clients[0])
        same = all(torch.equal(a.arrays[n], b.arrays[n]) for n in method.base_names)
        assert same is equal, randomness


def test_private_dpo_at_eps_inf_is_the_plain_method_bit_for_bit():
    plain, private = _method(), _private(epsilon=float("inf"))
    schedule = np.tile(np.arange(3), (2, 1))
    a = run_federated(plain, _clients(), schedule, progress=False)
    b = run_federated(private, _clients(), schedule, progress=False)
    for n in plain.base_names:
        assert torch.equal(a.state.server.base[n], b.state.server.base[n])
    assert b.state.server.ledger is None


def test_a_private_schedule_over_budget_is_refused_before_anything_is_released():
    from fedtailor.privacy.ledger import PrivacyBudgetExceeded

    method = _private(epsilon=1.0, noise_multiplier=0.3, schedule=np.tile(np.arange(3), (20, 1)))
    with pytest.raises(PrivacyBudgetExceeded, match="client"):
        method.init_server()


def test_centralized_dpo_refuses_record_dp_with_one_line():
    from types import SimpleNamespace

    from fedtailor.config import load_config
    from fedtailor.methods.dpo.pfeddpo import build_dpo_method

    cfg = load_config(None, ['method.name="dpo-central"', "method.record_dp.epsilon=8"])
    setup = SimpleNamespace(cfg=cfg, model=tiny_llama(seed=3), clients=_clients(), schedule=np.zeros((1, 3), int))
    with pytest.raises(ValueError, match="no client release to protect"):
        build_dpo_method(setup)


@pytest.mark.parametrize("n", [28_311_552, 1_000_003, 7])  # SmolLM2's embedding, a remainder after the rows, no row
def test_squared_norm_is_accurate_where_one_float32_sum_is_off(n):
    from fedtailor.methods.dpo.pfeddpo import _sq

    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    g[: min(n, 1000)] *= 1e3  # a few large entries ahead of many small ones
    exact = float(g.double().square().sum())
    if n > 10**7:  # the case _sq exists for: a plain float32 norm of it is off by far more than _sq may be
        assert abs(float(torch.linalg.vector_norm(g)) ** 2 / exact - 1) > 1e-3
    assert _sq(g) == pytest.approx(exact, rel=1e-6)
    assert _sq(g.reshape(-1, 1).expand(-1, 2).t()) == pytest.approx(2 * exact, rel=1e-6)  # not contiguous
    assert _sq(g.to(torch.bfloat16)) == pytest.approx(float(g.to(torch.bfloat16).double().square().sum()), rel=1e-6)


def test_the_reference_cache_gives_the_computed_values_and_is_keyed_by_model_pairs_and_precision(
    monkeypatch, tmp_path, caplog
):
    """With ``FEDTAILOR_REFERENCE_CACHE`` set, a client's setup writes its pairs' reference log-probabilities, and a
    later setup on the same pretrained weights (FedDPO after pFedDPO at another rank) reads them without a forward
    pass, equal to the bit to those computed without the cache; other weights, other pairs or another precision
    miss; a corrupt file is computed again and rewritten; a folder that cannot be written is one warning."""
    import fedtailor.lm.training as training

    clients = _clients()

    def setup(method: PFedDPO, cid: int = 0):
        msg = method.configure_setup(method.init_server(), cid)
        return method.client_setup(msg, None, clients[cid])[1]

    monkeypatch.delenv(training.REFERENCE_CACHE, raising=False)
    plain = setup(_method())
    monkeypatch.setenv(training.REFERENCE_CACHE, str(tmp_path))
    first = setup(_method())
    kept = sorted(tmp_path.glob("*.pt"))
    assert len(kept) == 2  # the training pairs and the held-out pairs
    real = training.pair_logprobs

    def forbidden(*a, **kw):
        raise AssertionError("a forward pass despite the cache")

    monkeypatch.setattr(training, "pair_logprobs", forbidden)
    again = setup(_method(personal=False, lora_rank=4))
    for s in (first, again):
        assert torch.equal(s.ref_train, plain.ref_train) and s.ref_eval.keys() == plain.ref_eval.keys()
        assert all(torch.equal(s.ref_eval[k], plain.ref_eval[k]) for k in plain.ref_eval)
    for other in (_method(model=tiny_llama(seed=4)), _method(precision="bf16")):  # other weights, other precision
        with pytest.raises(AssertionError, match="despite the cache"):
            setup(other)
    with pytest.raises(AssertionError, match="despite the cache"):
        setup(_method(), cid=1)  # another client's pairs
    monkeypatch.setattr(training, "pair_logprobs", real)
    kept[0].write_bytes(b"not a tensor")
    kept[1].write_bytes(kept[1].read_bytes()[:20])  # truncated
    assert torch.equal(setup(_method()).ref_train, plain.ref_train)
    monkeypatch.setattr(training, "pair_logprobs", forbidden)
    assert torch.equal(setup(_method()).ref_train, plain.ref_train)  # rewritten whole
    monkeypatch.setattr(training, "pair_logprobs", real)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(training.REFERENCE_CACHE, str(tmp_path / "a-file"))
    with caplog.at_level("WARNING", logger="fedtailor.lm.training"):
        assert torch.equal(setup(_method()).ref_train, plain.ref_train)
    assert "cannot keep reference log-probabilities there" in caplog.text
