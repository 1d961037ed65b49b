"""FedLAG: conflict counts on hand-built updates, what becomes personal, what is sent and averaged, and
top_k = 0 against its base bit for bit."""

from __future__ import annotations

import pytest
import torch

from fedtailor.config import load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.loop import run_federated
from fedtailor.fl.method import Method
from fedtailor.fl.registry import fedlag_bases
from fedtailor.methods.pfl.fedlag import FedLAG, capped_conflicts, conflict_counts, conflict_matrix
from fedtailor.methods.pfl.local import WRAPPER_API, LocalTraining

BASE = [
    'data.dataset="digits"',
    "data.num_clients=5",
    "data.num_unseen=0",
    "data.context_size=0",
    "data.eval_fraction=0.25",
    'data.scheme="dirichlet-per-class"',
    "data.alpha=0.3",
    "data.min_records=40",
    "federation.rounds=4",
    "federation.clients_per_round=5",
    'method.model="mlp"',
    "method.lr=0.1",
    "method.batch_size=16",
    "seed=5",
]
LAG = ["method.fedlag.top_k=2", "method.fedlag.warmup=2"]


def _run(method_name: str, *extra: str):
    setup = build_setup(load_config(None, [*BASE, f'method.name="{method_name}"', *extra]))
    method = build_method(setup)
    return setup, method, run_federated(method, setup.clients, setup.schedule, eval_every=2, progress=False)


def test_conflicts_are_pairs_strictly_below_xi_from_one_gram_matrix():
    h = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, 0.0]])
    # pairs: (0,1) cos 0, (0,2) cos -1, (1,2) cos 0; row 3 is zero and takes part in no pair
    assert conflict_counts(h, xi=0.0) == 1  # a cosine exactly at xi = 0 is not a conflict
    assert conflict_counts(h, xi=1e-12) == 3
    assert conflict_counts(h, xi=-1.0) == 0
    g = torch.tensor([[3.0, 4.0], [4.0, 3.0]])  # cos = 24/25 = 0.96 exactly
    assert conflict_counts(g, xi=0.96) == 0 and conflict_counts(g, xi=0.9600001) == 1
    # against the pairwise definition on random updates
    r = torch.randn(7, 30, generator=torch.Generator().manual_seed(1))
    cos = torch.nn.functional.cosine_similarity(r[:, None], r[None, :], dim=2)
    want = sum(int(cos[i, j] < 0.1) for i in range(7) for j in range(i + 1, 7))
    assert conflict_counts(r, xi=0.1) == want


@pytest.mark.parametrize("base", ["fedavg", "fedper", "ditto", "fedrod"])
def test_top_k_zero_is_the_base_method_bit_for_bit(base):
    _, _, plain = _run(base)
    _, _, wrapped = _run(base, "method.fedlag.top_k=0", "method.fedlag.warmup=2")
    for n, t in plain.state.server.params.items():
        assert torch.equal(wrapped.state.server.base.params[n], t)
    for cid, state in plain.state.clients.items():
        assert all(torch.equal(wrapped.state.clients[cid].params[n], t) for n, t in state.params.items())
    assert plain.evaluation == wrapped.evaluation


@pytest.mark.parametrize("base", fedlag_bases())  # every registered base
def test_personal_layers_are_never_sent_nor_averaged_and_shared_ones_reach_every_client(base):
    setup, method, result = _run(base, *LAG)
    assert isinstance(method, FedLAG) and isinstance(method.base, LocalTraining)
    server = result.state.server
    personal = server.base.personal
    assert len(method.personal_names(server.chosen)) == len(personal) > 0
    assert not personal & method.base.own_personal  # chosen among the candidates only
    assert all(method.summary(server)["fedlag_scores"][j] >= 0 for j in range(len(method.candidates)))
    # after the warm-up the server never touched the personal layers: they hold the round-2 average
    for cid in setup.clients:
        msg = method.configure_fit(server, 4, cid)
        assert not set(msg.arrays) & (personal | method.base.own_personal)
    # the clients' personal copies differ from each other (they train alone), the shared ones are equal
    evals = [
        method.base.start_model(method.configure_evaluate(server, c), result.state.clients[c])[0]
        for c in sorted(setup.clients)
    ]
    for n in method.base.names:
        same = all(torch.equal(evals[0][n], e[n]) for e in evals[1:])
        if n in personal:
            assert not same, n
        elif n not in method.base.own_personal:
            assert same, n


def test_the_choice_is_the_top_k_by_score_with_ties_to_the_earlier_layer_and_fixed_choices_by_position():
    setup = build_setup(load_config(None, [*BASE, 'method.name="fedavg"', *LAG]))
    method = build_method(setup)
    assert method.choose([1, 5, 5, 0, 2, 5]) == (1, 2)
    for choice, want in (("first", (0, 1)), ("middle", (2, 3)), ("last", (4, 5))):
        fixed = build_method(
            build_setup(load_config(None, [*BASE, 'method.name="fedavg"', *LAG, f'method.fedlag.choice="{choice}"']))
        )
        assert fixed.choose([9, 9, 9, 9, 9, 9]) == want
    with pytest.raises(ValueError, match="top_k=9"):
        build_method(build_setup(load_config(None, [*BASE, 'method.name="fedavg"', "method.fedlag.top_k=9"])))


@pytest.mark.parametrize(
    "option", ['method.fedlag.update="gradient"', "method.fedlag.rechoose=true", 'method.fedlag.unit="module"']
)
def test_options_run_and_report_their_scores(option):
    _, method, result = _run("fedavg", *LAG, option)
    summary = method.summary(result.state.server)
    rows = summary["fedlag_conflicts_per_round"]
    assert len(rows) == (4 if "rechoose" in option else 2)
    assert all(len(r) == len(method.candidates) for r in rows)
    assert summary["fedlag_scores"] == [sum(col) for col in zip(*rows)]
    if "module" in option:
        assert all("+" in c for c in summary["fedlag_candidates"])  # weight and bias together
    assert result.history[-1]["rejected"] == 0


def test_a_reply_without_its_requested_reports_is_refused():
    setup, method, result = _run("fedavg", *LAG, "method.fedlag.rechoose=true")
    server = result.state.server
    cid = min(setup.clients)
    msg = method.configure_fit(server, 4, cid)
    assert msg.config["report"] == "delta"
    reply, _ = method.client_fit(msg, result.state.clients[cid], setup.clients[cid])
    method.validate_reply(server, "fit", 4, cid, reply)
    from fedtailor.fl.records import InvalidMessage, Message

    stripped = Message(
        arrays={n: t for n, t in reply.arrays.items() if not n.startswith("report/")}, config=reply.config
    )
    with pytest.raises(InvalidMessage, match="report"):
        method.validate_reply(server, "fit", 4, cid, stripped)


SEVEN = fedlag_bases()  # every registered base (seven when this test was written)


@pytest.mark.parametrize("base", SEVEN)
def test_rechoose_with_round_deltas_reports_exactly_the_fedlag_personal_layers_on_every_base(base):
    """After the warm-up a client reports the round deltas of the FedLAG-personal layers and nothing else:
    never the base's own personal part (FedPer's, FedRep's, FedBABU's head), so every reply is accepted and
    the shared layers keep training."""
    rechoose = "method.fedlag.rechoose=true"
    plain = build_method(build_setup(load_config(None, [*BASE, f'method.name="{base}"'])))
    # top_k = 2 leaves a shared layer to watch unless the base has only two candidates (LG-FedAvg: its head)
    top_k = 2 if len(set(plain.names) - plain.own_personal) > 2 else 1
    lag = [f"method.fedlag.top_k={top_k}", "method.fedlag.warmup=2"]
    setup = build_setup(load_config(None, [*BASE, f'method.name="{base}"', *lag, rechoose]))
    method = build_method(setup)
    assert isinstance(method, FedLAG) and method.update == "delta" and method.rechoose
    reports: list[tuple[int, set[str]]] = []
    personal_at: dict[int, frozenset[str]] = {}
    moved: dict[int, bool] = {}
    fit_many, aggregate = method.client_fit_many, method.aggregate_fit

    def spy_fit(msgs, states, data):
        out = fit_many(msgs, states, data)
        for c, (reply, _) in out.items():
            reports.append(
                (int(msgs[c].config["round"]), {n[len("report/") :] for n in reply.arrays if n.startswith("report/")})
            )
        return out

    def spy_aggregate(server, rnd, replies):
        new, metrics = aggregate(server, rnd, replies)
        personal_at[rnd] = server.base.personal
        shared = method.base.shared_names(server.base)
        moved[rnd] = len(shared) > 0 and all(not torch.equal(new.base.params[n], server.base.params[n]) for n in shared)
        return new, metrics

    method.client_fit_many, method.aggregate_fit = spy_fit, spy_aggregate
    result = run_federated(method, setup.clients, setup.schedule, eval_every=2, progress=False)
    assert [h["rejected"] for h in result.history] == [0, 0, 0, 0]
    assert moved == {1: True, 2: True, 3: True, 4: True}  # every round aggregated, every shared layer moved
    assert len(reports) == 4 * 5
    for rnd, got in reports:
        assert not got & method.base.own_personal, (rnd, got)  # the base's own head never leaves the client
        assert got == (set(personal_at[rnd]) if rnd > 2 else set()), (rnd, got)
    assert all(len(got) == top_k for rnd, got in reports if rnd > 2)  # top_k layers after the warm-up
    rows = method.summary(result.state.server)["fedlag_conflicts_per_round"]
    assert len(rows) == 4  # scored every round, from the accepted replies


def _honest(n: int, dim: int, seed: int, spread: float) -> torch.Tensor:
    """``n`` client updates around one common direction (``spread`` = noise relative to it)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(dim, generator=g) + spread * torch.randn(n, dim, generator=g)


@pytest.mark.parametrize("cap", [1, 2, 3, 7])
def test_one_adversary_moves_the_capped_score_by_at_most_the_cap_and_the_plain_count_by_n_minus_1(cap):
    n = 20
    honest = _honest(n, 50, seed=3, spread=0.3)
    assert conflict_counts(honest, xi=0.0) == 0 and capped_conflicts(honest, xi=0.0, cap=cap) == 0
    attacked = honest.clone()
    attacked[7] = -honest[torch.arange(n) != 7].mean(0)  # client 7 sends the negative of the honest mean
    assert conflict_counts(attacked, xi=0.0) == n - 1  # it conflicts with every other client
    assert capped_conflicts(attacked, xi=0.0, cap=cap) == cap  # but takes part in at most cap counted pairs
    # the bound holds for any honest updates, conflicting ones too, and any replacement row
    jumps = 0
    for seed in range(40):
        rows = _honest(12, 8, seed=seed, spread=1.5)
        bad = rows.clone()
        other = torch.randn(8, generator=torch.Generator().manual_seed(seed))
        bad[seed % 12] = -rows.mean(0) if seed % 2 else other
        assert abs(capped_conflicts(bad, xi=0.0, cap=cap) - capped_conflicts(rows, xi=0.0, cap=cap)) <= cap
        jumps += abs(conflict_counts(bad, xi=0.0) - conflict_counts(rows, xi=0.0)) > cap
    assert jumps > 0  # the plain count is not bounded that way


def test_the_capped_score_is_the_fractional_cap_matching_and_the_plain_count_when_no_client_exceeds_the_cap():
    from scipy.optimize import linprog

    g = torch.Generator().manual_seed(2)
    for _ in range(60):
        n, cap, xi = (int(torch.randint(2, 11, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g)), 0.2)
        h = torch.randn(n, 3, generator=g)
        c = conflict_matrix(h, xi=xi)
        assert torch.equal(c, c.T) and not c.diagonal().any()
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n) if c[i, j]]
        plain = conflict_counts(h, xi=xi)
        assert plain == len(pairs)
        assert capped_conflicts(h, xi=xi, cap=n - 1) == plain  # a cap of n - 1 never binds
        if pairs:  # the definition: max sum x over conflicting pairs, 0 <= x <= 1, at most cap per client
            a = torch.zeros(n, len(pairs), dtype=torch.float64)
            for k, (i, j) in enumerate(pairs):
                a[i, k] = a[j, k] = 1
            lp = -linprog(-torch.ones(len(pairs)).numpy(), A_ub=a.numpy(), b_ub=[cap] * n, bounds=(0, 1)).fun
            assert capped_conflicts(h, xi=xi, cap=cap) == pytest.approx(lp, abs=1e-9)
            assert capped_conflicts(h, xi=xi, cap=cap) * 2 == int(capped_conflicts(h, xi=xi, cap=cap) * 2)
    with pytest.raises(ValueError, match="cap"):
        capped_conflicts(h, xi=0.0, cap=0)


def test_without_an_adversary_the_capped_score_picks_the_same_layers_as_the_plain_count():
    setup = build_setup(load_config(None, [*BASE, 'method.name="fedavg"', *LAG]))
    plain = build_method(setup)
    capped = build_method(build_setup(load_config(None, [*BASE, 'method.name="fedavg"', *LAG, "method.fedlag.cap=2"])))
    assert (plain.cap, capped.cap) == (None, 2) and len(plain.candidates) == 6
    e = torch.tensor([1.0, 0.0])
    layers = [
        torch.stack([e] * 8),  # all agree: 0 conflicts
        torch.stack([e] * 4 + [-e] * 4),  # two camps of 4: 16 pairs, 4 each
        torch.stack([torch.tensor([1.0, 2.0]), torch.tensor([1.0, -2.0])] + [e] * 6),  # one pair
        torch.stack([-e] * 2 + [e] * 6),  # 2 against 6: 12 pairs
        torch.stack([e] * 7 + [torch.zeros(2)]),  # a zero update: 0
        torch.stack([e] * 6 + [torch.tensor([-1.0, 1.0]), torch.tensor([0.0, 1.0])]),  # one client against 6
    ]
    plain_scores = [plain.layer_score(h) for h in layers]
    capped_scores = [capped.layer_score(h) for h in layers]
    assert plain_scores == [0, 16, 1, 12, 0, 6]
    assert capped_scores == [0, 8, 1, 4, 0, 2]  # each client counted in at most 2 pairs
    assert plain.choose(plain_scores) == capped.choose(capped_scores) == (1, 3)


def test_a_cap_that_never_binds_is_the_plain_run_bit_for_bit_and_a_binding_cap_bounds_each_round():
    _, plain, a = _run("fedavg", *LAG)
    _, lax, b = _run("fedavg", *LAG, "method.fedlag.cap=4")  # 5 clients: nobody has more than 4 pairs
    assert lax.summary(b.state.server)["fedlag_scores"] == plain.summary(a.state.server)["fedlag_scores"]
    for n, t in a.state.server.base.params.items():
        assert torch.equal(b.state.server.base.params[n], t)
    assert a.evaluation == b.evaluation
    assert "fedlag_cap" not in plain.summary(a.state.server)  # the default summary is unchanged
    _, tight, c = _run("fedavg", *LAG, "method.fedlag.cap=1")
    summary = tight.summary(c.state.server)
    assert summary["fedlag_cap"] == 1
    rows = summary["fedlag_conflicts_per_round"]
    assert len(rows) == 2 and all(0 <= x <= 2.5 and 2 * x == int(2 * x) for r in rows for x in r)
    assert any(x > 1 for r in plain.summary(a.state.server)["fedlag_conflicts_per_round"] for x in r)
    with pytest.raises(ValueError, match="cap"):
        load_config(None, [*BASE, 'method.name="fedavg"', *LAG, "method.fedlag.cap=0"])


class _OnlyThePublicInterface:
    """A base seen through the Method interface and WRAPPER_API alone: any other attribute is an error."""

    def __init__(self, base: LocalTraining) -> None:
        self._base = base
        self._allowed = WRAPPER_API | {n for n in dir(Method) if not n.startswith("_")}

    def __getattr__(self, name: str):
        if name not in self._allowed:
            raise AssertionError(f"FedLAG used {name!r} of its base, outside the Method interface and WRAPPER_API")
        return getattr(self._base, name)


@pytest.mark.parametrize("update", ["delta", "gradient"])
def test_fedlag_uses_only_the_public_interface_of_its_base_and_keeps_its_summary(update):
    setup = build_setup(
        load_config(
            None,
            [*BASE, 'method.name="fedrod"', *LAG, "method.fedlag.rechoose=true", f'method.fedlag.update="{update}"'],
        )
    )
    ref = build_method(setup)
    base = ref.base
    base.summary = lambda server: {"base_fact": len(server.params)}  # a base that reports something
    wrapped = FedLAG(
        _OnlyThePublicInterface(base),
        top_k=2,
        xi=0.0,
        warmup=2,
        unit="tensor",
        update=update,
        rechoose=True,
        choice="conflict",
    )
    result = run_federated(wrapped, setup.clients, setup.schedule, eval_every=2, progress=False)
    summary = wrapped.summary(result.state.server)
    assert summary["base_fact"] == len(result.state.server.base.params)
    assert len(summary["fedlag_personal"]) == 2
