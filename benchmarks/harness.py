"""Shared benchmark harness: times callables, prints a markdown table with the command, machine and date.

Every script in this folder measures the project's path against a baseline *in the same run* and reports the
ratio, so the figures are comparable even on a noisy machine. ``report`` appends each table to
``benchmarks/RESULTS.md``; the docs quote the latest entries.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    """One line describing the machine and library versions."""
    import numpy as np
    import torch

    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}"
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB: ``VmHWM`` of ``/proc/self/status`` on Linux (its own memory
    since its last exec; ``ru_maxrss`` would carry over the parent's resident size from before the exec), else
    ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KB elsewhere
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def time_call(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(rows[0])
    for r in rows[1:]:
        cols += [c for c in r if c not in cols]

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def report(title: str, rows: list[dict], *, notes: str = "", save: bool = True) -> str:
    """Print a markdown section (title, command, machine, date, table, notes) and append it to RESULTS.md."""
    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    when = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"## {title}\n\n- command: `{cmd}`\n- machine: {machine()}\n- date: {when}\n\n"
        + markdown_table(rows)
        + (f"\n{notes.strip()}\n" if notes.strip() else "")
    )
    print(text)
    if save:
        with RESULTS.open("a") as fh:
            fh.write(text + "\n")
    return text
