"""The image data kind: from a validated config to a dataset, its federated partition, each client's records
as tensors and the schedule (:class:`ImageSetup`, a :class:`fedtailor.fl.setup.Setup`). Registered as the data
kind ``"images"``, the one every image method (compact adaptation, the parameter-sharing bases) runs on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedtailor.data.datasets import ImageDataset, check_dataset_name, load_dataset
from fedtailor.data.partition import FederatedPartition, federated_partition, holdout_validation
from fedtailor.device import select_device
from fedtailor.fl.records import ClientData
from fedtailor.fl.registry import register_data
from fedtailor.fl.schedule import uniform_schedule
from fedtailor.models import build_model
from fedtailor.rng import numpy_rng

log = logging.getLogger(__name__)


@dataclass
class ImageSetup:
    """An image run: the :class:`~fedtailor.fl.setup.Setup` fields plus the dataset and its partition."""

    cfg: Any  # fedtailor.config.RunConfig
    device: torch.device
    dataset: ImageDataset
    partition: FederatedPartition
    clients: dict[int, ClientData]
    schedule: np.ndarray  # (rounds, per_round) client ids

    def model_fn(self, name: str) -> Callable[[], torch.nn.Module]:
        """A builder of the named model with its default initialisation drawn from the run's public seed."""
        shape, classes, seed = self.dataset.input_shape, self.dataset.num_classes, self.cfg.seed
        return lambda: build_model(name, input_shape=shape, num_classes=classes, seed=seed)


def client_data(dataset: ImageDataset, partition: FederatedPartition, device: torch.device) -> dict[int, ClientData]:
    """Each client's records as tensors on ``device``: train (x, y), eval (x, y) (None when the client has no
    evaluation records: it is then not evaluated), the context inputs and val (x, y) (None without validation
    records beside the evaluation ones). An unseen client's train is its context with labels: it is never
    scheduled, and the parameter-sharing methods fine-tune on it when they evaluate it (docs/pfl.md, "Unseen
    clients")."""

    def take(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        i = np.asarray(idx, dtype=np.int64)  # fancy indexing copies, so the cached arrays stay read-only
        return torch.from_numpy(dataset.x[i]).to(device), torch.from_numpy(dataset.y[i]).to(device)

    return {
        c.client_id: ClientData(
            cid=c.client_id,
            seen=c.seen,
            train=take(c.train if c.seen else c.context),
            eval=take(c.eval) if c.eval.size else None,
            context=take(c.context)[0],
            val=take(c.val) if c.val.size else None,
        )
        for c in partition.clients
    }


def partition_of(cfg: Any, labels: np.ndarray) -> FederatedPartition:
    """The run's partition of records with ``labels`` (``cfg.data``'s scheme, clients, splits and, with
    ``data.validation``, the validation split), from ``cfg.seed``."""
    d = cfg.data
    partition = federated_partition(
        labels,
        num_clients=d.num_clients,
        num_unseen=d.num_unseen,
        alpha=d.alpha,
        scheme=d.scheme,
        eval_fraction=d.eval_fraction,
        context_size=d.context_size,
        min_records=d.min_records,
        seed=cfg.seed,
    )
    if d.validation > 0:
        partition = holdout_validation(
            partition, fraction=d.validation, seed=cfg.seed, alongside=d.validation_mode == "alongside"
        )
    return partition


def build_image_setup(cfg: Any) -> ImageSetup:
    """The dataset (``data.limit``: a seeded subset), the partition (``data.validation``: held-out training
    records, instead of or beside the test split by ``data.validation_mode``), the client tensors on the run's
    device and the schedule over the seen clients."""
    device = select_device(cfg.device)
    d = cfg.data
    dataset = load_dataset(d.dataset, root=d.root)
    labels = dataset.y
    if d.limit is not None and d.limit < len(dataset):
        keep = np.sort(numpy_rng(cfg.seed, "limit").permutation(len(dataset))[: d.limit])
        dataset = ImageDataset(name=dataset.name, x=dataset.x[keep], y=dataset.y[keep], num_classes=dataset.num_classes)
        labels = dataset.y
    partition = partition_of(cfg, labels)
    seen = np.asarray(partition.seen, dtype=np.int64)
    order = uniform_schedule(
        num_clients=len(seen), rounds=cfg.federation.rounds, per_round=cfg.federation.clients_per_round, seed=cfg.seed
    )
    log.info(
        "%s: %d records, %d seen + %d unseen clients, device %s",
        dataset.name,
        len(dataset),
        len(partition.seen),
        len(partition.unseen),
        device,
    )
    return ImageSetup(
        cfg=cfg,
        device=device,
        dataset=dataset,
        partition=partition,
        clients=client_data(dataset, partition, device),
        schedule=seen[order],
    )


register_data("images", build_setup=build_image_setup, check_name=check_dataset_name)
