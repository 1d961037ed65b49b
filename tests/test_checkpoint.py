"""Checkpoints: every method resumes from one to exactly the uninterrupted run, and a checkpoint is unpickled
with ``weights_only=True`` on fedtailor's state classes alone, so a crafted file cannot run code."""

from __future__ import annotations

import pickle

import pytest
import torch
from test_flower import FLOWER_PATHS

from fedtailor.fl.checkpoint import CheckpointError, load_checkpoint
from fedtailor.fl.loop import run_federated

# every registered image method (each base with FedLAG; compact with LRSUQ and its ledger), 4 rounds
RESUMED = {name: [*sets, "federation.rounds=4"] for name, sets in FLOWER_PATHS.items() if "no FedLAG" not in name}


def _flat(server) -> torch.Tensor:
    from test_flower import _tensors

    return torch.cat([t.reshape(-1).double() for t in _tensors(server)])


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_a_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path, name):
    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup

    setup = build_setup(load_config(None, RESUMED[name]))
    full = run_federated(build_method(setup), setup.clients, setup.schedule, progress=False)
    ckpt = tmp_path / "checkpoint.pt"
    run_federated(
        build_method(setup),
        setup.clients,
        setup.schedule,
        progress=False,
        checkpoint=ckpt,
        checkpoint_every=1,
        stop_after=2,
    )
    resumed = run_federated(build_method(setup), setup.clients, setup.schedule, progress=False, checkpoint=ckpt)
    assert torch.equal(_flat(full.state.server), _flat(resumed.state.server))  # bit for bit
    assert full.evaluation == resumed.evaluation
    strip = lambda hist: [{k: v for k, v in h.items() if k != "seconds"} for h in hist]
    assert strip(full.history) == strip(resumed.history)[-len(full.history) :]


class _Boom:  # what a hostile checkpoint carries: unpickling it would call os.system
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_a_checkpoint_that_would_run_code_is_refused_before_unpickling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": 1, "schedule": "x", "state": _Boom()}, path)
    with pytest.raises(CheckpointError, match="refers to 'posix.system'.*not loaded"):
        load_checkpoint(path, torch.zeros((1, 1), dtype=torch.int64).numpy())
    assert not (tmp_path / "pwned").exists()
    # a fedtailor function is code too, not state
    torch.save({"state": pickle.loads(pickle.dumps(run_federated))}, path)
    with pytest.raises(CheckpointError, match="run_federated"):
        load_checkpoint(path, torch.zeros((1, 1), dtype=torch.int64).numpy())


@pytest.mark.parametrize("personal", [True, False], ids=["pfeddpo", "feddpo"])
def test_pfeddpo_resumes_exactly_with_its_adapters_and_their_optimizer_state(tmp_path, personal):
    pytest.importorskip("peft")
    import numpy as np

    from fedtailor.lm.model import tiny_llama
    from fedtailor.methods.dpo.pfeddpo import PFedDPO
    from fedtailor.methods.dpo.pfeddpo_test import _clients

    def method():
        return PFedDPO(
            model=tiny_llama(seed=3),
            personal=personal,
            beta=0.5,
            lr=3e-3,
            local_steps=2,
            batch_size=4,
            grad_clip=1.0,
            seed=0,
            rounds=4,
            lora_rank=2,
            lora_alpha=4,
        )

    clients, schedule = _clients(), np.tile(np.arange(3), (4, 1))
    full = run_federated(method(), clients, schedule, progress=False)
    ckpt = tmp_path / "checkpoint.pt"
    run_federated(method(), clients, schedule, progress=False, checkpoint=ckpt, checkpoint_every=1, stop_after=2)
    resumed = run_federated(method(), clients, schedule, progress=False, checkpoint=ckpt)
    assert torch.equal(_flat(full.state.server), _flat(resumed.state.server))
    assert full.evaluation == resumed.evaluation
