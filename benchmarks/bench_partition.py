"""Time the equal-size Dirichlet partition of the 70,000 MNIST labels against a per-record Python loop.

Both implement the same interleaved fill (``docs/data.md``): per pass, clients in a fresh random order, each
draws a class from q_i renormalised over the classes with records left, then a record of that class. The
baseline does one draw at a time in Python (inverse CDF, the cheapest per-draw form); ours vectorises each
pass over clients (``fedtailor.data.partition.dirichlet_equal_partition``). The per-class Dirichlet variant
(unequal sizes) is timed as well for reference. Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_partition.py [--repeat 5] [--no-save]
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np
from harness import report, time_call

from fedtailor.data.datasets import load_dataset
from fedtailor.data.partition import (
    dirichlet_equal_partition,
    dirichlet_per_class_partition,
    sample_log_dirichlet,
)


def per_record_loop(
    labels: np.ndarray, *, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Baseline: the interleaved fill with one Python iteration (and a few NumPy calls) per record."""
    num_classes = int(labels.max()) + 1
    size = labels.size // num_clients
    q = np.exp(sample_log_dirichlet(alpha, num_clients, num_classes, rng))
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    available = np.array([len(p) > 0 for p in pools], dtype=float)
    out: list[list[int]] = [[] for _ in range(num_clients)]
    for _ in range(size):
        for i in rng.permutation(num_clients):
            cdf = np.cumsum(q[i] * available)
            c = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
            pool = pools[c]
            out[i].append(pool.pop())
            if not pool:
                available[c] = 0.0
    return [np.sort(np.asarray(r, dtype=np.int64)) for r in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of the vectorised fill (median)")
    parser.add_argument("--no-save", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()

    labels = load_dataset("mnist").y
    rows = []
    for num_clients in (50, 1000):
        for alpha in (0.05, 0.5):
            kwargs = {"num_clients": num_clients, "alpha": alpha}
            ours = time_call(
                partial(dirichlet_equal_partition, labels, rng=np.random.default_rng(0), **kwargs),
                repeat=args.repeat,
            )
            loop = time_call(
                partial(per_record_loop, labels, rng=np.random.default_rng(0), **kwargs), repeat=1, warmup=0
            )
            per_class = time_call(
                partial(dirichlet_per_class_partition, labels, rng=np.random.default_rng(0), **kwargs),
                repeat=args.repeat,
            )
            rows.append(
                {
                    "records": labels.size,
                    "clients": num_clients,
                    "alpha": alpha,
                    "vectorised interleaved (s)": ours,
                    "per-record loop (s)": loop,
                    "speed-up": f"{loop / ours:.1f}x",
                    "per-class variant (s)": per_class,
                }
            )
    report(
        "Equal-size Dirichlet partition of MNIST labels (fedtailor.data.partition)",
        rows,
        notes=(
            "Vectorised and per-class: median of --repeat runs after one warm-up; per-record loop: one run "
            "(same algorithm, one draw per Python iteration). The machine is shared with other engineers' "
            "processes, so absolute times are disturbed; the ratio is measured in the same run."
        ),
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
