"""Worker processes for the per-client path (``fl/workers.py``): the same run bit for bit as in process (a base
with personal state on a convolutional model the batched engine cannot read, and FedLAG around it), the pool
closed by ``close()`` and by the runner however a run ends (Ctrl-C included), and a failing or dying worker as
one clear error. The in-process runs use one torch thread, as each worker does here."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedtailor.config import load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.loop import RunInterrupted, RunResult, run_federated
from fedtailor.fl.records import ClientData, Message
from fedtailor.fl.workers import RemoteTraceback, WorkerError, WorkerPool
from fedtailor.methods.pfl.ditto import Ditto
from fedtailor.methods.pfl.fedavg import FedAvg
from fedtailor.methods.pfl.fedlag import FedLAG
from fedtailor.methods.pfl.fedlag_test import BASE
from fedtailor.methods.pfl.local import PersonalState
from fedtailor.runner import run_experiment


class SmallConv(nn.Module):
    """A convolutional model outside the batched engine (tanh, average pooling): its clients run one by one."""

    head = "fc"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.avg_pool2d(torch.tanh(self.conv(x)), 2).flatten(1))


class Failing(FedAvg):
    """FedAvg whose client 1 raises and whose client 2 kills its process."""

    def client_fit(self, msg: Message, state: PersonalState | None, data: ClientData) -> tuple[Message, Any]:
        if data.cid == 1:
            raise ValueError("client 1 cannot train")
        if data.cid == 2:
            os._exit(7)
        return super().client_fit(msg, state, data)


SCHEDULE = np.array([[0, 1, 2], [1, 2, 3], [0, 2, 3]])


def _clients() -> dict[int, ClientData]:
    gen = torch.Generator().manual_seed(1)
    out = {}
    for cid, n in enumerate([19, 30, 41, 26]):  # ragged last batches of 8
        x, y = torch.rand(n, 1, 8, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen)
        out[cid] = ClientData(cid=cid, seen=True, train=(x[6:], y[6:]), eval=(x[:6], y[:6]))
    return out


def _kw(**extra: Any) -> dict[str, Any]:
    common = {
        "lr": 0.1,
        "local_epochs": 1,
        "batch_size": 8,
        "seed": 3,
        "device": torch.device("cpu"),
        "rounds": 3,
        "momentum": 0.5,
    }
    return {**common, **extra}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _identical(a: Any, b: Any, where: str = "") -> None:
    """Equal bit for bit: tensors by ``torch.equal`` and dtype, containers and dataclasses field by field."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _identical(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _same_run(a: RunResult, b: RunResult) -> None:
    _identical(a.state.server, b.state.server, "server")
    _identical(a.state.clients, b.state.clients, "clients")
    _identical(a.evaluation, b.evaluation, "evaluation")
    drop = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h]
    _identical(drop(a.history), drop(b.history), "history")


def test_workers_give_the_in_process_run_bit_for_bit_for_ditto_and_fedlag_around_it(one_thread):
    clients = _clients()
    here = Ditto(lam=0.2, personal_epochs=1, model_fn=SmallConv, **_kw())
    pooled = Ditto(lam=0.2, personal_epochs=1, model_fn=SmallConv, **_kw(workers=2))
    assert here.chain is None and not here.vectorize and here.pool is None  # the per-client path, in process
    run = lambda m: run_federated(m, clients, SCHEDULE, eval_every=1, progress=False)
    try:
        _same_run(run(here), run(pooled))
        assert pooled.pool.running and pooled.pool.threads == 1
        wrap = lambda base: FedLAG(
            base, top_k=1, xi=0.0, warmup=1, unit="tensor", update="delta", rechoose=True, choice="conflict"
        )
        wrapped_here, wrapped = wrap(here), wrap(pooled)
        _same_run(run(wrapped_here), run(wrapped))  # personal layers kept on the clients, deltas reported
        procs = list(pooled.pool._procs)
        wrapped.close()  # FedLAG closes its base, the base its pool
    finally:
        pooled.close()
    assert not pooled.pool.running
    assert all(p.exitcode == 0 for p in procs)


def test_a_failing_client_is_raised_with_its_traceback_and_a_dead_worker_is_an_error():
    clients = _clients()
    method = Failing(model_fn=SmallConv, **_kw(workers=1))
    server = method.init_server()
    msgs = lambda cids: {c: method.configure_fit(server, 1, c) for c in cids}
    with pytest.raises(ValueError, match="client 1 cannot train") as err:
        method.client_fit_many(msgs([0, 1]), {}, clients)
    assert "worker process" in err.value.__notes__[0] and "running client 1" in err.value.__notes__[0]
    assert isinstance(err.value.__cause__, RemoteTraceback) and "client_fit" in err.value.__cause__.text
    assert not method.pool.running  # closed on the error
    with pytest.raises(WorkerError, match=r"exited with code 7 .* while running client 2"):
        method.client_fit_many(msgs([0, 2]), {}, clients)  # started again, then its worker dies
    assert not method.pool.running


def test_the_runner_closes_the_pool_when_a_run_is_interrupted(tmp_path):
    cfg = load_config(None, [*BASE, 'method.name="fedper"', "method.vectorize=false", "method.workers=1"])
    setup = build_setup(cfg)
    method = build_method(setup)
    seen = []

    def ctrl_c(record: dict[str, Any]) -> None:
        seen.extend(method.pool._procs)
        raise KeyboardInterrupt

    with pytest.raises(RunInterrupted):
        run_experiment(cfg, tmp_path / "run", progress=False, built=(setup, method), on_round=ctrl_c)
    assert seen and not method.pool.running and all(not p.is_alive() for p in seen)


def test_the_workers_option():
    pool = lambda *s: build_method(build_setup(load_config(None, [*BASE, 'method.name="fedavg"', *s]))).pool
    assert pool() is None  # default: in process
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        auto = pool('method.workers="auto"')
        assert isinstance(auto, WorkerPool) and auto.workers == 2 and not auto.running  # started at first use
        torch.set_num_threads(1)
        assert pool('method.workers="auto"') is None
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="method.workers"):
        load_config(None, [*BASE, 'method.name="fedavg"', "method.workers=-1"])
    with pytest.raises(ValueError, match="on the CPU"):
        FedAvg(model_fn=SmallConv, **{**_kw(workers=2), "device": torch.device("meta")})
