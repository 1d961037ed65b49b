"""From a validated config to the pieces of a run: data, partition, client data, schedule, method.

Methods register a builder in :data:`METHOD_BUILDERS`; the runner and the Flower adapters share this code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedtailor.config import DPO_METHODS, RunConfig
from fedtailor.data.datasets import ImageDataset, check_dataset_name, load_dataset
from fedtailor.data.partition import FederatedPartition, federated_partition, holdout_validation
from fedtailor.device import select_device
from fedtailor.fl.method import Method
from fedtailor.fl.records import ClientData
from fedtailor.fl.schedule import uniform_schedule
from fedtailor.models import build_model
from fedtailor.rng import numpy_rng

log = logging.getLogger(__name__)


@dataclass
class Setup:
    """Everything a method builder may need."""

    cfg: RunConfig
    device: torch.device
    dataset: ImageDataset
    partition: FederatedPartition
    clients: dict[int, ClientData]
    schedule: np.ndarray  # (rounds, per_round) client ids

    def model_fn(self, name: str) -> Callable[[], torch.nn.Module]:
        """A builder of the named model with its default initialisation drawn from the run's public seed."""
        shape, classes, seed = self.dataset.input_shape, self.dataset.num_classes, self.cfg.seed
        return lambda: build_model(name, input_shape=shape, num_classes=classes, seed=seed)


def train_sizes(clients: dict[int, ClientData]) -> dict[int, int]:
    """Each client's number of training records: what the server knows of the partition (it caps a client's
    aggregation weight, so a reply claiming 1e15 examples cannot take over the model)."""
    return {cid: len(d.train[1]) if isinstance(d.train, tuple) else len(next(iter(d.train.values())))
            for cid, d in clients.items()}


def _local_training(setup: Setup) -> Method:
    """A parameter-sharing method (fedavg, fedprox, ...), wrapped in FedLAG when [method.fedlag] is given."""
    from fedtailor.methods import pfl_method
    from fedtailor.methods.fedlag import FedLAG

    m = setup.cfg.method
    base = pfl_method(m, model_fn=setup.model_fn(m.model), seed=setup.cfg.seed, device=setup.device,
                      rounds=setup.cfg.federation.rounds, train_sizes=train_sizes(setup.clients))
    if m.fedlag is None:
        return base
    f = m.fedlag
    return FedLAG(base, top_k=f.top_k, xi=f.xi, warmup=f.warmup, unit=f.unit, update=f.update,
                  rechoose=f.rechoose, choice=f.choice, cap=f.cap)


def _compact(setup: Setup) -> Method:
    from fedtailor.methods.compact import CompactAdaptation

    m = setup.cfg.method
    return CompactAdaptation(cfg=m, model_fn=setup.model_fn(m.model), input_shape=setup.dataset.input_shape,
                             schedule=setup.schedule, seen=list(setup.partition.seen), seed=setup.cfg.seed,
                             device=setup.device, context_size=setup.cfg.data.context_size)


METHOD_BUILDERS: dict[str, Callable[[Setup], Method]] = {
    "compact": _compact, **dict.fromkeys(("fedavg", "fedprox", "fedper", "fedrep", "fedbabu", "ditto", "fedrod"),
                                         _local_training)}


def client_data(dataset: ImageDataset, partition: FederatedPartition, device: torch.device) -> dict[int, ClientData]:
    """Each client's records as tensors on ``device``: train (x, y), eval (x, y) (None when the client has no
    evaluation records: it is then not evaluated) and the context inputs."""

    def take(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        i = np.asarray(idx, dtype=np.int64)  # fancy indexing copies, so the cached arrays stay read-only
        return torch.from_numpy(dataset.x[i]).to(device), torch.from_numpy(dataset.y[i]).to(device)

    return {
        c.client_id: ClientData(cid=c.client_id, seen=c.seen, train=take(c.train),
                                eval=take(c.eval) if c.eval.size else None, context=take(c.context)[0])
        for c in partition.clients
    }


def build_setup(cfg: RunConfig) -> Setup:
    if cfg.method.name in DPO_METHODS:  # preference data and a language model (imported only here)
        from fedtailor.lm.setup import build_preference_setup

        return build_preference_setup(cfg)  # type: ignore[return-value]
    device = select_device(cfg.device)
    d = cfg.data
    dataset = load_dataset(d.dataset, root=d.root)
    labels = dataset.y
    if d.limit is not None and d.limit < len(dataset):
        keep = np.sort(numpy_rng(cfg.seed, "limit").permutation(len(dataset))[: d.limit])
        dataset = ImageDataset(name=dataset.name, x=dataset.x[keep], y=dataset.y[keep], num_classes=dataset.num_classes)
        labels = dataset.y
    partition = federated_partition(
        labels, num_clients=d.num_clients, num_unseen=d.num_unseen, alpha=d.alpha, scheme=d.scheme,
        eval_fraction=d.eval_fraction, context_size=d.context_size, min_records=d.min_records, seed=cfg.seed,
    )
    if d.validation > 0:
        partition = holdout_validation(partition, fraction=d.validation, seed=cfg.seed)
    seen = np.asarray(partition.seen, dtype=np.int64)
    order = uniform_schedule(num_clients=len(seen), rounds=cfg.federation.rounds,
                             per_round=cfg.federation.clients_per_round, seed=cfg.seed)
    log.info("%s: %d records, %d seen + %d unseen clients, device %s", dataset.name, len(dataset),
             len(partition.seen), len(partition.unseen), device)
    return Setup(cfg=cfg, device=device, dataset=dataset, partition=partition,
                 clients=client_data(dataset, partition, device), schedule=seen[order])


def build_method(setup: Setup) -> Method:
    return METHOD_BUILDERS[setup.cfg.method.name](setup)


def _dpo(setup: Setup) -> Method:
    from fedtailor.lm.setup import build_dpo_method

    return build_dpo_method(setup)  # type: ignore[arg-type]


METHOD_BUILDERS.update(dict.fromkeys(DPO_METHODS, _dpo))


def check_data_name(cfg: RunConfig) -> None:
    """The config's data name is one this project can load (cheap: nothing is read)."""
    if cfg.method.name in DPO_METHODS:
        from fedtailor.lm.setup import check_preference_name

        check_preference_name(cfg.data.dataset)
    else:
        check_dataset_name(cfg.data.dataset)
