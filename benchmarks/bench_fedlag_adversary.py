"""How far one adversarial client moves FedLAG's choice of personal layers: the plain pair count (the paper's)
against the capped score (``method.fedlag.cap``, :func:`fedtailor.methods.pfl.fedlag.capped_conflicts`).

Setup: ``configs/fedlag/mnist-dnn-alpha01.toml`` (real MNIST, DNN, FedAvg base, 20 clients, all of them every
round, per-class Dirichlet alpha 0.1, batch 16, lr 0.005, top_k = 2) with a short warm-up: ``--warmup`` rounds
of scoring, the choice after the last of them (the run stops there).

Adversary: client ``--adversary`` (default 0) trains honestly and keeps its honest model, but on the targeted
layer it replies ``received - mean_u(delta_u)``, so that its round delta, which the server scores, is the
negative of the unweighted mean round delta of the 19 honest clients of that round (an omniscient client: the
strongest single-client push towards conflicts on one layer). Every other layer it reports honestly.

One run per (seed, target) records every round's conflict matrix of every candidate layer (which pairs of
clients conflict); every score is computed from the same matrices, which is exact: before the choice all
candidates are shared and the score changes nothing in training, so a run with ``method.fedlag.cap`` set has
the same warm-up. ``--verify`` checks that claim once: it reruns the first adversarial setting with the
method's own ``cap`` and compares its summary with the scores computed here.

Columns: ``GC(layer)`` the warm-up totals under each score, ``personal`` the ``top_k`` chosen, ``target
shift`` the targeted layer's total minus the same seed's no-adversary total under the same score (it also
holds the small drift of the honest clients' updates that the attack causes through the averaged model),
``bound`` what one client can add to it over the warm-up with the honest updates unchanged
(``warmup * (n - 1)`` plain, ``warmup * cap`` capped), ``choice changed`` whether the personal layers differ
from the no-adversary choice.
Writes ``adversary.csv`` (also the wall seconds of each run) and ``adversary.md`` under ``--out``.

    python benchmarks/bench_fedlag_adversary.py --seeds 41 42 --warmup 10 --caps 5 10 \\
        --targets fc1.weight fc.weight --verify --out docs/results/fedlag-adversary
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fedtailor.config import load_config
from fedtailor.experiment import Setup, build_method, build_setup
from fedtailor.fl.loop import run_federated
from fedtailor.fl.records import ClientData, Message
from fedtailor.methods.pfl.fedlag import FedLAG, LagState, capped_count, conflict_matrix
from fedtailor.methods.pfl.local import PersonalState

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "fedlag" / "mnist-dnn-alpha01.toml"


def attack(method: FedLAG, adversary: int, target: str) -> None:
    """Make client ``adversary`` reply the negative of the honest mean round delta on layer ``target``."""
    fit_many = method.client_fit_many

    def fit(
        msgs: dict[int, Message], states: dict[int, PersonalState | None], data: dict[int, ClientData]
    ) -> dict[int, tuple[Message, PersonalState]]:
        out = fit_many(msgs, states, data)
        if adversary in out and target in msgs[adversary].arrays:
            deltas = [out[c][0].arrays[target] - msgs[c].arrays[target] for c in out if c != adversary]
            honest_mean = torch.stack(deltas).mean(0)
            out[adversary][0].arrays[target] = msgs[adversary].arrays[target] - honest_mean
        return out

    method.client_fit_many = fit  # type: ignore[method-assign]


def record(method: FedLAG) -> list[list[torch.Tensor]]:
    """Every scored round's conflict matrix of every candidate (rounds x candidates), filled in the run."""
    matrices: list[list[torch.Tensor]] = []
    aggregate = method.aggregate_fit

    def agg(server: LagState, rnd: int, replies: dict[int, Message]) -> tuple[LagState, Any]:
        if method.scoring(rnd):
            row = []
            for i in method.candidates:
                layer = method.layers[i]
                h = torch.stack(
                    [torch.cat([method._update(server, r, n).reshape(-1) for n in layer]) for r in replies.values()]
                )
                row.append(conflict_matrix(h, xi=method.xi))
            matrices.append(row)
        return aggregate(server, rnd, replies)

    method.aggregate_fit = agg  # type: ignore[method-assign]
    return matrices


def overrides(seed: int, warmup: int, cap: int | None = None) -> list[str]:
    return [
        f"seed={seed}",
        f"federation.rounds={warmup}",
        f"method.fedlag.warmup={warmup}",
        "federation.eval_every=0",
        *([f"method.fedlag.cap={cap}"] if cap is not None else []),
    ]


def run(setup: Setup, target: str | None, adversary: int) -> tuple[FedLAG, list[list[torch.Tensor]], dict, float]:
    method = build_method(setup)
    assert isinstance(method, FedLAG)
    if target is not None:
        attack(method, adversary, target)
    matrices = record(method)
    t0 = time.perf_counter()
    result = run_federated(method, setup.clients, setup.schedule, progress=False)
    assert all(h["rejected"] == 0 for h in result.history)
    return method, matrices, method.summary(result.state.server), time.perf_counter() - t0


def score(matrices: list[list[torch.Tensor]], cap: int | None) -> list[float]:
    """Warm-up totals per candidate: the plain pair count (``cap`` None) or the capped score."""
    per_round = [[int(m.sum()) // 2 if cap is None else capped_count(m, cap=cap) for m in row] for row in matrices]
    return [sum(col) for col in zip(*per_round)]


def fmt(x: float) -> str:
    return f"{x:g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[41])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--caps", type=int, nargs="+", default=[5, 10])
    ap.add_argument("--targets", nargs="+", default=["fc1.weight", "fc.weight"])
    ap.add_argument("--adversary", type=int, default=0, help="client id of the adversary")
    ap.add_argument("--verify", action="store_true", help="rerun the first attack with the method's own cap")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "fedlag-adversary")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t_all = time.perf_counter()
    rows: list[dict[str, Any]] = []
    scores_names = ["plain", *[f"cap={c}" for c in args.caps]]
    for seed in args.seeds:
        setup = build_setup(load_config(CONFIG, overrides(seed, args.warmup)))
        n = len(setup.schedule[0])
        baseline: dict[str, tuple[list[float], tuple[int, ...]]] = {}
        for target in [None, *args.targets]:
            method, matrices, summary, wall = run(setup, target, args.adversary)
            names = summary["fedlag_candidates"]
            assert score(matrices, None) == summary["fedlag_scores"], "recorded conflicts differ"
            print(f"seed {seed}, adversary on {target}: {wall:.0f} s", file=sys.stderr, flush=True)
            if args.verify and target is not None and target == args.targets[0] and seed == args.seeds[0]:
                cap = args.caps[0]
                cfg = load_config(CONFIG, overrides(seed, args.warmup, cap))
                capped = build_method(replace(setup, cfg=cfg))
                assert isinstance(capped, FedLAG) and capped.cap == cap
                attack(capped, args.adversary, target)
                res = run_federated(capped, setup.clients, setup.schedule, progress=False)
                own = capped.summary(res.state.server)
                assert own["fedlag_scores"] == score(matrices, cap), own["fedlag_scores"]
                assert own["fedlag_personal"] == [names[j] for j in capped.choose(score(matrices, cap))]
                print(
                    f"verified: a run with method.fedlag.cap={cap} scores {own['fedlag_scores']}",
                    file=sys.stderr,
                    flush=True,
                )
            for name, cap in zip(scores_names, [None, *args.caps]):
                totals = score(matrices, cap)
                chosen = method.choose(totals)
                if target is None:
                    baseline[name] = (totals, chosen)
                base_totals, base_chosen = baseline[name]
                j = names.index(target) if target is not None else None
                rows.append(
                    {
                        "seed": seed,
                        "clients": n,
                        "warmup": args.warmup,
                        "adversary": "none" if target is None else f"-mean on {target}",
                        "score": name,
                        **{f"GC({c})": fmt(t) for c, t in zip(names, totals)},
                        "personal": ", ".join(names[k] for k in chosen),
                        "target shift": "" if j is None else fmt(totals[j] - base_totals[j]),
                        "bound": "" if j is None else fmt(args.warmup * (n - 1 if cap is None else cap)),
                        "choice changed": "" if j is None else ("yes" if chosen != base_chosen else "no"),
                        "run s": f"{wall:.0f}",
                    }
                )
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "adversary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = [c for c in rows[0] if c not in ("clients", "warmup", "run s")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    used = argv if argv is not None else sys.argv[1:]
    command = "python benchmarks/bench_fedlag_adversary.py " + " ".join(used)
    total = time.perf_counter() - t_all
    (args.out / "adversary.md").write_text(
        f"`{command}` ({total / 60:.1f} min, {torch.get_num_threads()} thread; {n} clients, warm-up "
        f"{args.warmup} rounds, adversary client {args.adversary})\n\n" + "\n".join(lines) + "\n"
    )
    print("\n".join(lines))
    print(f"total {total:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
