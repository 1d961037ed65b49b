"""Repository-wide pytest setup: one torch thread per xdist worker unless the caller chose a thread count.

Two workers of two torch threads each oversubscribe a 2-core machine (the compact resume tests go from 5 s to
90 s), so a bare ``python -m pytest -n 2`` behaves as CI's ``OMP_NUM_THREADS=1`` run does. The variable is set
before any test imports torch, so subprocesses started by tests (the CLI runs) inherit it too.
"""

import os
import sys


def pytest_configure(config) -> None:
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
