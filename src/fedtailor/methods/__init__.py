"""Federated methods: compact adaptation, and the parameter-sharing methods (FedAvg, FedProx, FedPer, FedRep,
FedBABU, Ditto, FedRoD) that FedLAG wraps."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


def pfl_method(cfg: Any, *, model_fn: Callable[[], nn.Module], seed: int, device: torch.device, rounds: int,
               train_sizes: Mapping[int, int] | None = None):
    """The parameter-sharing method named by ``cfg.name`` with its options from ``cfg``; ``train_sizes`` (the
    clients' partition sizes, known to the server) cap each client's aggregation weight."""
    from fedtailor.methods.ditto import Ditto
    from fedtailor.methods.fedavg import FedAvg
    from fedtailor.methods.fedbabu import FedBABU
    from fedtailor.methods.fedper import FedPer
    from fedtailor.methods.fedprox import FedProx
    from fedtailor.methods.fedrep import FedRep
    from fedtailor.methods.fedrod import FedRoD

    common = dict(model_fn=model_fn, lr=cfg.lr, local_epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                  momentum=cfg.momentum, seed=seed, device=device, rounds=rounds,
                  vectorize=cfg.vectorize, train_sizes=train_sizes, update_bound=cfg.update_bound,
                  update_bound_mode=cfg.update_bound_mode)
    own: dict[str, tuple[type, dict[str, Any]]] = {
        "fedavg": (FedAvg, {}),
        "fedprox": (FedProx, {"mu": getattr(cfg, "mu", None)}),
        "fedper": (FedPer, {}),
        "fedrep": (FedRep, {"head_epochs": getattr(cfg, "head_epochs", None)}),
        "fedbabu": (FedBABU, {"finetune_epochs": getattr(cfg, "finetune_epochs", None)}),
        "ditto": (Ditto, {"lam": getattr(cfg, "lam", None), "personal_epochs": getattr(cfg, "personal_epochs", None)}),
        "fedrod": (FedRoD, {}),
    }
    if cfg.name not in own:
        raise ValueError(f"unknown parameter-sharing method {cfg.name!r}; choose one of {sorted(own)}.")
    cls, options = own[cfg.name]
    return cls(**common, **options)
