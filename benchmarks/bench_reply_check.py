"""The server's per-reply work on a SmolLM2-135M base (134,515,008 float32 numbers, what every pFedDPO and FedDPO
client uploads each round), against the forms it replaced, in one run:

* the value check of :meth:`fedtailor.fl.records.Message.array` (finite, below ``MAX_MAGNITUDE``: one
  ``torch.aminmax`` pass) against ``isfinite(t).all()`` then ``abs().max()`` (a boolean and a float copy);
* the base-gradient norm a pFedDPO client reports after each step (float32 norms of rows of 1024 entries,
  combined in float64) against ``t.double().pow(2).sum()`` (two float64 copies) and against one float64 pass
  (``vector_norm(dtype=torch.float64)``, what it used before).

    python benchmarks/bench_reply_check.py [--threads 1] [--repeat 5]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import report, time_call

from fedtailor.fl.records import MAX_MAGNITUDE, Message
from fedtailor.methods.dpo.pfeddpo import _norm

SMOLLM2_BASE = 134_515_008


def two_pass_check(t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()) or float(t.abs().max()) > MAX_MAGNITUDE:
        raise ValueError("refused")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = torch.randn(SMOLLM2_BASE, generator=torch.Generator().manual_seed(0))
    reply = Message(arrays={"base": base})
    copies = math.sqrt(float(base.double().pow(2).sum()))
    assert abs(_norm([base]) - copies) <= 1e-7 * copies  # the same number, to float32 rounding
    rows = []
    for what, before, after in (
        ("reply value check", lambda: two_pass_check(base), lambda: reply.array("base")),
        ("reported gradient norm", lambda: math.sqrt(float(base.double().pow(2).sum())), lambda: _norm([base])),
        (
            "reported gradient norm, against one float64 pass",
            lambda: float(torch.linalg.vector_norm(base, dtype=torch.float64)),
            lambda: _norm([base]),
        ),
    ):
        old, new = time_call(before, repeat=args.repeat), time_call(after, repeat=args.repeat)
        rows.append({"on 134.5M float32": what, "before (s)": old, "fedtailor (s)": new, "speed-up": old / new})
    report(f"Per-reply work on a SmolLM2-135M base, {args.threads} threads", rows)


if __name__ == "__main__":
    main()
