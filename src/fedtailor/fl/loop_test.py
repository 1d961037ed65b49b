"""The federated loop: resumption reproduces the uninterrupted run, hostile replies are rejected without
touching the server state, metrics average within a client first."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedtailor.data.datasets import load_dataset
from fedtailor.data.partition import federated_partition
from fedtailor.experiment import client_data
from fedtailor.fl.loop import chosen_rounds, client_statistics, evaluate_client, run_federated, summarize
from fedtailor.fl.records import ClientData, InvalidMessage, Message
from fedtailor.fl.schedule import participation_counts, uniform_schedule
from fedtailor.methods.pfl.fedavg import FedAvg
from fedtailor.models import build_model


@pytest.fixture(scope="module")
def digits_clients():
    ds = load_dataset("digits")
    part = federated_partition(ds.y, num_clients=6, num_unseen=1, alpha=1.0, context_size=20, seed=3)
    return ds, part, client_data(ds, part, torch.device("cpu"))


def _fedavg(ds, seed=3):
    return FedAvg(
        model_fn=lambda: build_model("mlp", input_shape=ds.input_shape, num_classes=10, seed=seed),
        lr=0.1,
        local_epochs=1,
        batch_size=16,
        seed=seed,
        device=torch.device("cpu"),
        rounds=6,
    )


def _schedule(part, rounds=6, per_round=3, seed=3):
    seen = np.asarray(part.seen)
    return seen[uniform_schedule(num_clients=len(seen), rounds=rounds, per_round=per_round, seed=seed)]


def _strip(history):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in history]


def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(digits_clients, tmp_path):
    ds, part, clients = digits_clients
    schedule = _schedule(part)
    full = run_federated(_fedavg(ds), clients, schedule, eval_every=2, progress=False)
    ckpt = tmp_path / "ckpt.pt"
    first = run_federated(_fedavg(ds), clients, schedule, eval_every=2, checkpoint=ckpt, progress=False, stop_after=3)
    assert first.state.round == 3 and ckpt.exists()
    resumed = run_federated(_fedavg(ds), clients, schedule, eval_every=2, checkpoint=ckpt, progress=False)
    assert resumed.state.round == 6
    assert all(
        torch.equal(resumed.state.server.params[n], full.state.server.params[n]) for n in full.state.server.params
    )
    assert _strip(resumed.history) == _strip(full.history)
    assert resumed.evaluation == full.evaluation


def test_checkpoint_for_another_schedule_is_refused(digits_clients, tmp_path):
    ds, part, clients = digits_clients
    ckpt = tmp_path / "ckpt.pt"
    run_federated(_fedavg(ds), clients, _schedule(part), checkpoint=ckpt, progress=False, stop_after=2)
    with pytest.raises(ValueError, match="different schedule"):
        run_federated(_fedavg(ds), clients, _schedule(part, seed=4), checkpoint=ckpt, progress=False)


class _Hostile(FedAvg):
    """FedAvg whose client ``bad`` sends a malformed reply of the given kind."""

    def __init__(self, *args, bad: int, kind: str, **kw):
        super().__init__(*args, **kw)
        self.bad, self.kind = bad, kind

    def client_fit_many(self, msgs, states, data):
        out = super().client_fit_many(msgs, states, data)
        if self.bad in out:
            reply, state = out[self.bad]
            a, name = dict(reply.arrays), "fc1.weight"
            p = a[name]
            reply = {
                "nan": Message(arrays={**a, name: p * float("nan")}, config=reply.config),
                "shape": Message(arrays={**a, name: p[:-1]}, config=reply.config),
                "missing": Message(arrays={k: v for k, v in a.items() if k != name}, config=reply.config),
                "weight": Message(arrays=a, config={**reply.config, "num_examples": -5}),
                "type": Message(arrays=a, config={**reply.config, "num_examples": "many"}),
                "dtype": Message(arrays={**a, name: p.double()}, config=reply.config),
                "huge": Message(arrays={k: v * 1e30 for k, v in a.items()}, config=reply.config),
                "examples": Message(arrays=a, config={**reply.config, "num_examples": 10**15}),
            }[self.kind]
            out[self.bad] = (reply, state)
        return out


def _hostile(ds, clients, **kw):
    return _Hostile(
        model_fn=lambda: build_model("mlp", input_shape=ds.input_shape, num_classes=10, seed=3),
        lr=0.1,
        local_epochs=1,
        batch_size=16,
        seed=3,
        device=torch.device("cpu"),
        rounds=6,
        train_sizes={c: len(d.train[1]) for c, d in clients.items()},
        **kw,
    )


@pytest.mark.parametrize("kind", ["nan", "shape", "missing", "weight", "type", "dtype", "huge", "examples"])
def test_malformed_reply_is_rejected_and_the_rest_aggregated(digits_clients, kind):
    """Among them a float64 array (it used to pass and crash the aggregation), values of 1e30 and a claim of
    1e15 examples (which used to take over the global model)."""
    ds, part, clients = digits_clients
    schedule = _schedule(part, rounds=1)
    bad = int(schedule[0, 0])
    honest = run_federated(_fedavg(ds), clients, schedule[:, 1:], progress=False)
    hostile = run_federated(_hostile(ds, clients, bad=bad, kind=kind), clients, schedule, progress=False)
    assert hostile.history[0]["rejected"] == 1
    assert all(
        torch.equal(hostile.state.server.params[n], honest.state.server.params[n]) for n in honest.state.server.params
    )


def test_a_round_whose_every_reply_is_rejected_stops_the_run_with_the_reason(digits_clients):
    from fedtailor.fl.records import RoundRejected

    ds, part, clients = digits_clients
    schedule = _schedule(part, rounds=2)[:, :1]  # one client a round, and it is hostile
    with pytest.raises(RoundRejected, match=r"round 1: every reply was rejected.*client \d+: .*NaN"):
        run_federated(_hostile(ds, clients, bad=int(schedule[0, 0]), kind="nan"), clients, schedule, progress=False)


def test_a_client_weight_is_capped_by_what_the_server_knows_and_updates_can_be_bounded(digits_clients):
    """A reply may claim fewer examples than the client's partition holds, never more; with ``update_bound`` a
    long update is rejected, or clipped to the bound (the aggregate then moves by at most the bound)."""
    ds, part, clients = digits_clients
    schedule = _schedule(part, rounds=1)
    model_fn = lambda: build_model("mlp", input_shape=ds.input_shape, num_classes=10, seed=3)
    sizes = {c: len(d.train[1]) for c, d in clients.items()}
    kw = {
        "model_fn": model_fn,
        "lr": 0.1,
        "local_epochs": 1,
        "batch_size": 16,
        "seed": 3,
        "device": torch.device("cpu"),
        "rounds": 6,
        "train_sizes": sizes,
    }
    plain = FedAvg(**kw)
    server = plain.init_server()
    cid = int(schedule[0, 0])
    reply, _ = plain.client_fit(plain.configure_fit(server, 1, cid), None, clients[cid])
    claim = lambda n: Message(arrays=reply.arrays, config={**reply.config, "num_examples": n})
    for n in (sizes[cid], 1):
        plain.validate_reply(server, "fit", 1, cid, claim(n))
    with pytest.raises(InvalidMessage, match="number of records"):
        plain.validate_reply(server, "fit", 1, cid, claim(sizes[cid] + 1))
    with pytest.raises(InvalidMessage, match="not a client"):
        plain.validate_reply(server, "fit", 1, max(sizes) + 1, reply)
    norm = plain._update_norm(server, reply)
    with pytest.raises(InvalidMessage, match="update_bound"):
        FedAvg(**kw, update_bound=norm / 2).validate_reply(server, "fit", 1, cid, reply)
    clip = FedAvg(**kw, update_bound=norm / 2, update_bound_mode="clip")
    clip.validate_reply(server, "fit", 1, cid, reply)
    new, _ = clip.aggregate_fit(server, 1, {cid: reply})
    moved = math.sqrt(sum(float((new.params[n] - server.params[n]).double().pow(2).sum()) for n in new.params))
    assert moved == pytest.approx(norm / 2, rel=1e-5)


def test_validation_helpers_name_the_problem():
    m = Message(arrays={"x": torch.zeros(3)}, config={"n": 1.5})
    with pytest.raises(InvalidMessage, match="shape"):
        m.array("x", shape=(4,))
    with pytest.raises(InvalidMessage, match="lacks array 'y'"):
        m.array("y")
    with pytest.raises(InvalidMessage, match="expected"):
        m.value("n", int)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_an_array_with_a_non_finite_or_huge_value_anywhere_is_refused(dtype):
    from fedtailor.fl.records import MAX_MAGNITUDE

    for at in (0, 4, -1):
        for bad, why in ((math.nan, "NaN or infinite"), (math.inf, "NaN or infinite"), (-math.inf, "NaN or infinite")):
            t = torch.linspace(-1, 1, 9, dtype=dtype)
            t[at] = bad
            with pytest.raises(InvalidMessage, match=why):
                Message(arrays={"x": t}).array("x")
        for huge in (2 * MAX_MAGNITUDE, -2 * MAX_MAGNITUDE):
            t = torch.zeros(9, dtype=torch.float64)
            t[at] = huge
            with pytest.raises(InvalidMessage, match="beyond"):
                Message(arrays={"x": t}).array("x")
    edge = torch.tensor([-MAX_MAGNITUDE, 0.0, MAX_MAGNITUDE], dtype=torch.float64)
    for ok in (edge, torch.zeros(0, dtype=dtype)):  # the bounds themselves, and an empty array, are accepted
        assert Message(arrays={"x": ok}).array("x") is ok
    Message(arrays={"x": torch.tensor([math.nan])}).array("x", finite=False)  # unchecked where asked


def test_summary_averages_within_a_client_first():
    clients = {0: ClientData(0, True), 1: ClientData(1, True), 2: ClientData(2, False)}
    evaluation = {
        0: {"accuracy": 1.0, "num_examples": 1000.0},
        1: {"accuracy": 0.0, "num_examples": 10.0},
        2: {"accuracy": 0.25, "num_examples": 5.0},
    }
    s = summarize(evaluation, clients)
    assert s["seen/accuracy"] == pytest.approx(0.5)  # not the record-weighted 0.990
    assert s["future/accuracy"] == pytest.approx(0.25)


def test_client_statistics_match_an_independent_computation():
    import statistics

    from scipy import stats

    vals = [0.9, 0.1, 0.5, 0.3, 0.8, 0.6, 0.2]
    s = client_statistics(vals)
    ordered = sorted(vals)  # p10: linear interpolation at rank 0.1 * (n - 1) = 0.6 between the two lowest
    assert s["/p10"] == pytest.approx(ordered[0] + 0.6 * (ordered[1] - ordered[0]))
    assert s["/p10"] == pytest.approx(0.16)
    assert s[""] == pytest.approx(statistics.mean(vals)) and s["/std"] == pytest.approx(statistics.stdev(vals))
    lo, hi = stats.t.interval(0.95, len(vals) - 1, loc=np.mean(vals), scale=stats.sem(vals))
    assert (s["/ci95_lo"], s["/ci95_hi"]) == (pytest.approx(lo), pytest.approx(hi))
    assert s["/ci95_hi"] - s[""] == pytest.approx(2.4469 * statistics.stdev(vals) / math.sqrt(7), rel=1e-4)
    assert s["/n"] == 7
    one = client_statistics([0.4])  # one client: no spread to report
    assert one == {"": 0.4, "/p10": 0.4, "/n": 1}


def test_summary_has_the_distribution_per_group_and_takes_other_groups():
    clients = {c: ClientData(c, c < 4) for c in range(6)}
    acc = [0.9, 0.1, 0.5, 0.3, 0.8, 0.6]
    evaluation = {c: {"accuracy": acc[c], "loss": 1.0 + c, "num_examples": 10.0} for c in range(6)}
    evaluation[0].update(val_accuracy=0.7, val_num_examples=5.0)
    s = summarize(evaluation, clients)
    for group, members in (("seen", [0, 1, 2, 3]), ("future", [4, 5]), ("all", range(6))):
        expect = client_statistics([acc[c] for c in members])
        assert {k: s[f"{group}/accuracy{k}"] for k in expect} == pytest.approx(expect)
    assert s["seen/val_accuracy"] == 0.7 and s["seen/val_accuracy/n"] == 1 and "seen/val_accuracy/std" not in s
    assert not any("num_examples" in k for k in s)
    third = summarize(evaluation, clients, groups={"odd": lambda c: c.cid % 2 == 1})
    assert set(third) == {
        f"odd/{m}{k}" for m in ("accuracy", "loss") for k in ("", "/std", "/p10", "/ci95_lo", "/ci95_hi", "/n")
    }
    assert third["odd/accuracy"] == pytest.approx(np.mean([0.1, 0.3, 0.6]))


def test_best_final_and_validation_chosen_rounds_differ():
    history = [
        {"round": 1, "loss": 2.0},
        {"round": 2, "loss": 1.5, "seen/accuracy": 0.60, "seen/val_accuracy": 0.55, "future/accuracy": 0.50},
        {"round": 3, "loss": 1.2},
        {"round": 4, "loss": 1.0, "seen/accuracy": 0.80, "seen/val_accuracy": 0.60, "future/accuracy": 0.40},
        {"round": 6, "loss": 0.9, "seen/accuracy": 0.70, "seen/val_accuracy": 0.65, "future/accuracy": 0.45},
        {"round": 8, "loss": 0.8, "seen/accuracy": 0.75, "seen/val_accuracy": 0.65, "future/accuracy": 0.30},
    ]
    out = chosen_rounds(history)
    assert out["best_round"] == 4 and out["best/seen/accuracy"] == 0.80 and out["best/future/accuracy"] == 0.40
    # the highest validation mean is tied at rounds 6 and 8: the earlier is chosen, and its test figures reported
    assert out["chosen_round"] == 6 and out["chosen/seen/accuracy"] == 0.70 and out["chosen/future/accuracy"] == 0.45
    assert "best/loss" not in out and "chosen/loss" not in out  # training figures are not evaluation figures
    assert history[-1]["seen/accuracy"] not in (out["best/seen/accuracy"], out["chosen/seen/accuracy"])  # final
    no_val = chosen_rounds([{k: v for k, v in r.items() if "val_" not in k} for r in history])
    assert no_val["best_round"] == 4 and "chosen_round" not in no_val
    assert chosen_rounds([{"round": 1, "loss": 1.0}]) == {}


def test_a_client_with_validation_records_reports_both():
    class Counter:
        def client_evaluate(self, msg, state, data):
            return {"accuracy": float(sum(data.eval)), "num_examples": float(len(data.eval))}

    plain = ClientData(0, True, train=[9], eval=[1, 0, 1])
    assert evaluate_client(Counter(), None, None, plain) == {"accuracy": 2.0, "num_examples": 3.0}
    both = ClientData(0, True, train=[9], eval=[1, 0, 1], val=[1, 1, 1, 1])
    assert evaluate_client(Counter(), None, None, both) == {
        "accuracy": 2.0,
        "num_examples": 3.0,
        "val_accuracy": 4.0,
        "val_num_examples": 4.0,
    }


def test_schedule_is_fixed_by_the_seed_and_uniform():
    a = uniform_schedule(num_clients=40, rounds=500, per_round=2, seed=41)
    assert np.array_equal(a, uniform_schedule(num_clients=40, rounds=500, per_round=2, seed=41))
    assert not np.array_equal(a, uniform_schedule(num_clients=40, rounds=500, per_round=2, seed=42))
    assert all(len(set(r)) == 2 for r in a)
    counts = participation_counts(a, 40)
    assert all(counts[i] == (a == i).any(axis=1).sum() for i in range(40))
    # Each T_i ~ Binomial(500, 1/20): mean 25, sd 4.87; all 40 within 25 +- 5 sd.
    assert np.all(np.abs(counts - 25) < 5 * 4.87)


def test_unknown_client_in_schedule_is_an_error(digits_clients):
    ds, _part, clients = digits_clients
    with pytest.raises(ValueError, match="without data"):
        run_federated(_fedavg(ds), clients, np.array([[0, 999]]), progress=False)


def test_a_streaming_round_equals_a_collected_round(digits_clients):
    """The streaming driver (each reply folded in as it arrives, clients one by one) ends where the collected
    round ends, with the default fold (the replies kept, then aggregate_fit)."""
    ds, part, clients = digits_clients
    schedule = _schedule(part, rounds=2)
    plain = _fedavg(ds)
    plain.vectorize = False
    streaming = _fedavg(ds)
    streaming.vectorize, streaming.streaming = False, True
    a = run_federated(plain, clients, schedule, progress=False)
    b = run_federated(streaming, clients, schedule, progress=False)
    assert all(torch.equal(a.state.server.params[n], b.state.server.params[n]) for n in a.state.server.params)
    assert _strip(a.history) == _strip(b.history)
