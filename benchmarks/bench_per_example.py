"""Per-record clipped gradients of the LeNet on 333 real MNIST records: vmap vs loop vs Opacus.

The LeNet is that of *Privacy-Aligned Personalized Federated Learning with Compact Adaptation and
Variable-Length Gaussian Communication* (``fedtailor.models.lenet``).

The three paths compute the same thing, the clipped per-record gradient matrix (333 x 85,822), and are
checked against each other before timing:

* ``vmap``: :func:`fedtailor.privacy.mechanisms.per_example_gradients` (torch.func) + ``clip_rows``;
* ``vmap, chunk 64``: the same with ``chunk_size=64`` (bounded memory);
* ``loop``: one forward/backward per record in Python (the baseline);
* ``opacus``: Opacus ``GradSampleModule`` (per-layer hooks), ``loss_reduction="sum"``, + ``clip_rows``.

Run: ``python benchmarks/bench_per_example.py [--threads 1] [--repeat 5] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import report

from fedtailor.data.datasets import load_dataset
from fedtailor.device import select_device
from fedtailor.models import build_model, num_parameters
from fedtailor.privacy.mechanisms import clip_rows, per_example_gradients
from fedtailor.rng import numpy_rng

CLIP = 1.0


def loop_path(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return clip_rows(torch.stack(rows), clip=CLIP)


def opacus_path(gs_model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    gs_model.zero_grad(set_to_none=True)
    for p in gs_model.parameters():
        p.grad_sample = None
    nn.functional.cross_entropy(gs_model(x), y, reduction="sum").backward()
    g = torch.cat([p.grad_sample.reshape(x.shape[0], -1) for p in gs_model.parameters()], dim=1)
    return clip_rows(g, clip=CLIP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repeats per path; the median is reported")
    parser.add_argument("--records", type=int, default=333, help="records per batch (m_g = 333)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--no-save", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = select_device(args.device)

    ds = load_dataset("mnist")
    idx = numpy_rng(0, "bench-per-example").choice(len(ds), size=args.records, replace=False)
    x = torch.from_numpy(ds.x[idx].copy()).to(device)
    y = torch.from_numpy(ds.y[idx].copy()).to(device)
    model = build_model("lenet", input_shape=ds.input_shape, num_classes=ds.num_classes, seed=0).to(device)
    d = num_parameters(model)

    # Opacus warns that its full backward hooks fire without input gradients; that is expected here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from opacus import GradSampleModule

        gs_model = GradSampleModule(
            build_model("lenet", input_shape=ds.input_shape, num_classes=10, seed=0).to(device),
            loss_reduction="sum",
        )

    paths: dict[str, Callable[[], torch.Tensor]] = {
        "loop (baseline)": lambda: loop_path(model, x, y),
        "vmap": lambda: clip_rows(per_example_gradients(model, nn.functional.cross_entropy, x, y), clip=CLIP),
        "vmap, chunk 64": lambda: clip_rows(
            per_example_gradients(model, nn.functional.cross_entropy, x, y, chunk_size=64), clip=CLIP
        ),
        "opacus GradSampleModule": lambda: opacus_path(gs_model, x, y),
    }

    def synced(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return out

        return run

    reference = paths["loop (baseline)"]()
    diffs = {name: float((fn() - reference).abs().max()) for name, fn in paths.items()}
    # Interleaved repeats (path A, B, C, D, A, B, ...) so that load from other processes hits all paths alike.
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        synced(fn)()  # warm-up
    for _ in range(args.repeat):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            synced(fn)()
            samples[name].append(time.perf_counter() - t0)
    times = {name: statistics.median(ts) for name, ts in samples.items()}
    base = times["loop (baseline)"]
    rows = [
        {
            "path": name,
            "median s": t,
            "records/s": args.records / t,
            "speed-up vs loop": base / t,
            "max abs diff vs loop": diffs[name],
        }
        for name, t in times.items()
    ]
    notes = (
        f"Clipped per-record gradients (C = {CLIP}) of the paper's LeNet (d = {d:,} parameters) on "
        f"{args.records} real MNIST records, device {device}, {args.threads} thread(s), median of "
        f"{args.repeat} interleaved repeats after one warm-up; all paths measured in the same run. The "
        "machine is shared with other engineers' processes, so absolute times are noisy; the ratios are "
        "the figure to quote."
    )
    report(
        "Per-record clipped gradients: torch.func vmap vs Python loop vs Opacus",
        rows,
        notes=notes,
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
