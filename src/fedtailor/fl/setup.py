"""The pieces of a run every driver needs, whatever the data: the :class:`Setup` protocol.

A data kind (:func:`fedtailor.fl.registry.register_data`) turns a validated config into a Setup: images
(:mod:`fedtailor.data.setup`: dataset, partition, client tensors, a model builder) and preference pairs
(:mod:`fedtailor.lm.setup`: tokenized pairs and the loaded language model) are two such kinds. A method's
builder receives the setup of its method's data kind and may read that kind's extra fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from fedtailor.fl.records import ClientData


class Setup(Protocol):
    """What the loop, the runner and the Flower adapters read of a run: the config, the device, every client's
    records and the fixed schedule (``(rounds, per_round)`` client ids)."""

    cfg: Any  # fedtailor.config.RunConfig
    device: torch.device
    clients: dict[int, ClientData]
    schedule: np.ndarray


def train_sizes(clients: Mapping[int, ClientData]) -> dict[int, int]:
    """Each client's number of training records: what the server knows of the partition (it caps a client's
    aggregation weight, so a reply claiming 1e15 examples cannot take over the model)."""
    return {
        cid: len(d.train[1]) if isinstance(d.train, tuple) else len(next(iter(d.train.values())))
        for cid, d in clients.items()
    }
