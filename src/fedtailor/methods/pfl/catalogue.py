"""The FedLAG paper's experiments for ``fedtailor reproduce``, on ``configs/fedlag/*.toml``: every base with and
without FedLAG, the fixed First/Middle/Last-K and FedLAG's module unit, at Dirichlet alpha 0.1 and 1.0, on MNIST
(DNN) and Fashion-MNIST (FedAvgCNN; also at a scale a 2-core CPU fits), and the xi and top_k sensitivity on MNIST.
The paper's scripts use EMNIST with the FedAvgCNN; no package here carries EMNIST, so Fashion-MNIST (the same
28x28 grayscale shape, so the same network) stands in for it."""

from __future__ import annotations

from dataclasses import replace

from fedtailor.fl.experiments import Block, Claim, Experiment, Tuning, register_experiment
from fedtailor.fl.registry import fedlag_bases

# every base, with and without FedLAG, its own step size from one grid up from the paper's 0.005, and FedProx's mu
# and Ditto's lambda where the base has them, chosen on a validation split of the clients' training records. The
# steps grow by about 3x up to 0.15, declared before any FedLAG tuning run: on the same DNN the noise-free points of
# dp-utility-mnist chose 0.08 of {0.005, 0.02, 0.08, 0.32} (0.32 diverged), so a grid ending at 0.05 would have its
# choices at the edge
FEDLAG_STEPS = ("0.005", "0.015", "0.05", "0.15")


def _fedlag_tuning(steps: tuple[str, ...]) -> Tuning:
    """Each point's ``lr`` over ``steps``, FedProx's ``mu`` and Ditto's ``lam`` over three decades each."""
    return Tuning(
        grid=(("method.lr", steps), ("method.mu", ("0.001", "0.01", "0.1")), ("method.lam", ("0.01", "0.1", "1.0")))
    )


FEDLAG_TUNING = _fedlag_tuning(FEDLAG_STEPS)
# the paper's claim, for every base: with FedLAG (top_k = 2) above the base alone (its tables; no figure is quoted
# here, the verdict reads the interval over seeds)
IMPROVES = (Claim((("method.fedlag.top_k", "2"),), "seen/accuracy", "above", "FedLAG improves its base method"),)
# the DP privacy-utility table: three bases (one without a personal part, a personal head, a personal model);
# each point's step size tuned on the validation split (clipping and noise change the best step: issue 23's rule)
DP_BASES = ("fedavg", "fedper", "ditto")
# FedLAG's personal layers under DP: two of the DNN's four weight and bias tensors, one for FedPer, whose head is
# personal already (two would leave it nothing to share, and a DP release nothing to release: refused)
DP_TOP_K = {"fedavg": "2", "fedper": "1", "ditto": "2"}
DP_TUNING = Tuning(grid=(("method.lr", ("0.005", "0.02", "0.08", "0.32")),))  # 0.32: most chose 0.08, the edge
DP_REDUCED = ("federation.rounds=30", "federation.eval_every=0", "method.fedlag.warmup=15", "data.limit=20000")
# five seeds where the seed spread decides a verdict: over seeds 41-43 at the tuned steps APFL with FedLAG was above
# APFL alone in every seed at alpha 0.1 (FedPer below in every seed), with intervals over seeds spanning zero
MNIST_SEEDS = (41, 42, 43, 44, 45)
FMNIST_REDUCED = ("federation.rounds=40", "federation.eval_every=0", "data.limit=20000")
# the FedAvgCNN on Fashion-MNIST with one step more, 0.5: in the first tuning runs (seed 41, alpha 0.1, 20 rounds)
# FedAvg's validation accuracy still rose at the grid's top step, alone 66.2 / 73.3 / 79.2 / 81.5 and with FedLAG
# 68.3 / 74.8 / 84.2 / 93.1 over lr 0.005 / 0.015 / 0.05 / 0.15, so the grid grew before the other points ran
FMNIST_TUNING = _fedlag_tuning((*FEDLAG_STEPS, "0.5"))
# the reduced Fashion-MNIST scale's tuning at half its rounds (20, FedLAG's warm-up 10 by its default), the same grid
# and budget for every point: at 40 rounds its 290 tuning runs (4-9 min each here) would take about 32 CPU-hours
FMNIST_REDUCED_TUNING = replace(FMNIST_TUNING, sets=(*FMNIST_TUNING.sets, "federation.rounds=20"))


def _fedlag_blocks(prefix: str) -> tuple[Block, ...]:
    """Every base with and without FedLAG (``top_k = 0`` is the base exactly), the fixed First/Middle/Last-K,
    FedLAG scoring modules (a module's weight and bias as one layer; ``top_k = 1``: half of the DNN's two layers) and
    scoring each client's last-minibatch gradient instead of its round update, at both alphas, from
    ``configs/fedlag/<prefix>-alpha{01,10}.toml``. The bases are every registered one that FedLAG wraps
    (:func:`fedtailor.fl.registry.fedlag_bases`), so a new base is picked up."""
    bases = fedlag_bases()
    out = []
    for a in ("01", "10"):
        config = f"configs/fedlag/{prefix}-alpha{a}.toml"
        out += [
            Block(f"main-alpha{a}", config, (("method.name", bases), ("method.fedlag.top_k", ("0", "2")))),
            Block(f"fixed-alpha{a}", config, (("method.fedlag.choice", ("first", "middle", "last")),)),
            Block(f"unit-alpha{a}", config, (("method.fedlag.unit", ("module",)),), ("method.fedlag.top_k=1",)),
            Block(f"score-alpha{a}", config, (("method.fedlag.update", ("gradient",)),)),
        ]
    return tuple(out)


register_experiment(
    Experiment(
        "fedlag-mnist",
        "FedLAG: every base with and without FedLAG, fixed First/Middle/Last-K, the module unit and the "
        "last-minibatch-gradient score, on MNIST (DNN) at Dirichlet alpha 0.1 and 1.0",
        _fedlag_blocks("mnist-dnn"),
        quick=("federation.rounds=10", "federation.eval_every=0", "method.fedlag.warmup=5", "data.limit=10000"),
        metrics=("seen/accuracy", "fedlag_personal"),
        tuning=FEDLAG_TUNING,
        reference=(("method.fedlag.top_k", "0"),),  # each base with FedLAG against itself without
        claims=IMPROVES,
        seeds=MNIST_SEEDS,
    ),
    Experiment(
        "fedlag-fmnist",
        "FedLAG on Fashion-MNIST (FedAvgCNN) at alpha 0.1 and 1.0",
        _fedlag_blocks("fmnist-fedavgcnn"),
        quick=("federation.rounds=5", "federation.eval_every=0", "method.fedlag.warmup=2", "data.limit=5000"),
        metrics=("seen/accuracy", "fedlag_personal"),
        tuning=FMNIST_TUNING,
        reference=(("method.fedlag.top_k", "0"),),  # each base with FedLAG against itself without
        claims=IMPROVES,
    ),
    Experiment(
        "fedlag-fmnist-reduced",
        "FedLAG on Fashion-MNIST (FedAvgCNN; it stands in for the paper scripts' EMNIST, which no package here "
        "carries) at the scale this 2-core CPU fits: every base with and without FedLAG, fixed Last-K, the "
        "module unit and the last-minibatch-gradient score, 40 rounds (warm-up 20) on 20,000 records, at alpha "
        "0.1 and 1.0",
        tuple(
            b
            for a in ("01", "10")
            for b in (
                Block(
                    f"main-alpha{a}",
                    f"configs/fedlag/fmnist-fedavgcnn-alpha{a}.toml",
                    (("method.name", fedlag_bases()), ("method.fedlag.top_k", ("0", "2"))),
                    FMNIST_REDUCED,
                ),
                Block(
                    f"fixed-alpha{a}",
                    f"configs/fedlag/fmnist-fedavgcnn-alpha{a}.toml",
                    (("method.fedlag.choice", ("last",)),),
                    FMNIST_REDUCED,
                ),
                Block(
                    f"unit-alpha{a}",
                    f"configs/fedlag/fmnist-fedavgcnn-alpha{a}.toml",
                    (("method.fedlag.unit", ("module",)),),
                    (*FMNIST_REDUCED, "method.fedlag.top_k=1"),
                ),
                Block(
                    f"score-alpha{a}",
                    f"configs/fedlag/fmnist-fedavgcnn-alpha{a}.toml",
                    (("method.fedlag.update", ("gradient",)),),
                    FMNIST_REDUCED,
                ),
            )
        ),
        quick=("federation.rounds=5", "method.fedlag.warmup=2", "data.limit=5000"),
        metrics=("seen/accuracy", "fedlag_personal"),
        tuning=FMNIST_REDUCED_TUNING,
        reference=(("method.fedlag.top_k", "0"),),  # each base with FedLAG against itself without
        claims=IMPROVES,
    ),
    Experiment(
        "fedlag-sensitivity-mnist",
        "FedLAG's sensitivity on MNIST (DNN, FedAvg base): the conflict threshold xi and the number of personal "
        "layers top_k, at alpha 0.1 and 1.0",
        tuple(
            Block(
                f"{name}-alpha{a}",
                f"configs/fedlag/mnist-dnn-alpha{a}.toml",
                grid,
            )
            for a in ("01", "10")
            for name, grid in (
                ("xi", (("method.fedlag.xi", ("-0.2", "-0.1", "0.0", "0.1", "0.2")),)),
                ("top_k", (("method.fedlag.top_k", ("0", "1", "2", "3")),)),
            )
        ),
        quick=("federation.rounds=10", "federation.eval_every=0", "method.fedlag.warmup=5", "data.limit=10000"),
        metrics=("seen/accuracy", "fedlag_personal"),
        # each xi against the paper's xi = 0; each top_k against FedAvg alone (top_k = 0)
        reference=(("method.fedlag.xi", "0.0"), ("method.fedlag.top_k", "0")),
    ),
    Experiment(
        "dp-utility-mnist",
        "Privacy against utility of the parameter-sharing methods (docs/privacy.md): FedAvg, FedPer and Ditto with "
        "and without FedLAG on the FedLAG setup (MNIST, DNN, alpha 1.0) at a scale this CPU fits (30 rounds, "
        "warm-up 15, 20,000 records), record-level DP-SGD at eps 1, 4, 8 and without noise, client-level DP "
        "(each client's own noise) at eps 1, 4, 8, and FedAvg's client-level release over LRSUQ at eps 8",
        (
            *(  # one block per granularity and base, so that a session can finish one (NAME/BLOCK) at a time
                Block(
                    f"{level}-{base}",
                    "configs/fedlag/mnist-dnn-alpha10.toml",
                    (("method.fedlag.top_k", ("0", DP_TOP_K[base])), (f"method.{level}_dp.epsilon", epsilons)),
                    (*DP_REDUCED, f'method.name="{base}"', f'method.{level}_dp.randomness="simulation"'),
                )
                for level, epsilons in (("record", ("1", "4", "8", "inf")), ("client", ("1", "4", "8")))
                for base in DP_BASES
            ),
            Block(
                "client-lrsuq",
                "configs/fedlag/mnist-dnn-alpha10.toml",
                (("method.client_dp.codec", ("lrsuq",)),),
                (*DP_REDUCED, 'method.client_dp.randomness="simulation"', "method.client_dp.epsilon=8"),
            ),
        ),
        quick=("federation.rounds=4", "method.fedlag.warmup=2", "data.limit=4000"),
        # which layers FedLAG made personal, by eps; what the uplink cost a released value
        metrics=("seen/accuracy", "fedlag_personal", "uplink_bits_per_coefficient"),
        tuning=DP_TUNING,
        reference=(("method.fedlag.top_k", "0"),),  # FedLAG's gain at each eps: each base with it against without
    ),
    module=__name__,
)
