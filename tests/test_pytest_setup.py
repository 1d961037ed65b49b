"""The repository conftest gives each xdist worker one torch thread (unless the caller chose a count)."""

import os

import pytest
import torch


def test_xdist_workers_run_one_torch_thread() -> None:
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2:
        pytest.skip("only xdist runs with two or more workers are pinned to one thread")
    if os.environ["OMP_NUM_THREADS"] != "1":
        pytest.skip("the caller chose its own OMP_NUM_THREADS")
    assert torch.get_num_threads() == 1
