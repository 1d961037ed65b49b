"""From a validated config to the pieces of a preference run: the model, tokenized pairs per client, the
schedule. The image path is :func:`fedtailor.experiment.build_setup`; this one is chosen for the DPO methods.

``data.dataset``: ``"hh-rlhf"`` (the harmless-base file kept beside the project, else the hub's
``Anthropic/hh-rlhf`` through ``datasets``), ``"hh-rlhf:<path>"`` (a ``.jsonl[.gz]`` of that format) or
``"shp:<path>"`` (Stanford SHP rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedtailor.config import RunConfig
from fedtailor.device import select_device
from fedtailor.fl.records import ClientData
from fedtailor.fl.schedule import uniform_schedule
from fedtailor.lm.preference import (
    HH_FILE,
    PreferencePair,
    federated_pairs,
    load_hh_rlhf,
    load_shp,
    shared_data_file,
    tokenize_pairs,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferenceData:
    name: str
    pairs: list[PreferencePair]


@dataclass
class PreferenceSetup:
    cfg: RunConfig
    device: torch.device
    dataset: PreferenceData
    clients: dict[int, ClientData]
    schedule: np.ndarray
    model: Any  # the loaded causal LM (one copy)


def check_preference_name(name: str) -> None:
    if name != "hh-rlhf" and not name.startswith(("hh-rlhf:", "shp:")):
        raise ValueError(f"preference data {name!r} is not known; use 'hh-rlhf', 'hh-rlhf:<path>' or 'shp:<path>'.")


def load_pairs(name: str) -> PreferenceData:
    check_preference_name(name)
    if name == "hh-rlhf":
        path = shared_data_file(*HH_FILE)
        return PreferenceData(name, load_hh_rlhf(path))  # None: the hub (needs a network)
    kind, _, path = name.partition(":")
    return PreferenceData(kind, load_hh_rlhf(path) if kind == "hh-rlhf" else load_shp(path))


def build_preference_setup(cfg: RunConfig) -> PreferenceSetup:
    from fedtailor.lm.model import load_causal_lm

    d, m = cfg.data, cfg.method
    if d.num_unseen:
        raise ValueError("preference runs have no unseen clients; set data.num_unseen = 0.")
    device = select_device(cfg.device)
    data = load_pairs(d.dataset)
    split = federated_pairs(data.pairs, num_clients=d.num_clients, per_client=d.pairs_per_client,
                            heldout=d.heldout_pairs, scheme=d.preference_split, seed=cfg.seed)
    lm = load_causal_lm(m.model, device=str(device))
    clients = {}
    for cid, (train, held) in enumerate(zip(split.train, split.heldout)):
        tok = lambda idx: tokenize_pairs(lm.tokenizer, [data.pairs[i] for i in idx], max_length=d.max_length)  # noqa: E731
        clients[cid] = ClientData(cid=cid, seen=True, train=tok(train), eval=tok(held) if len(held) else None)
    order = uniform_schedule(num_clients=d.num_clients, rounds=cfg.federation.rounds,
                             per_round=cfg.federation.clients_per_round, seed=cfg.seed)
    log.info("%s: %d pairs, %d clients x %d (+%d held out), model %s", data.name, len(data.pairs), d.num_clients,
             d.pairs_per_client, d.heldout_pairs, lm.source)
    return PreferenceSetup(cfg=cfg, device=device, dataset=data, clients=clients, schedule=order, model=lm.model)


def build_dpo_method(setup: PreferenceSetup):
    from fedtailor.methods.pfeddpo import CentralizedDPO, PFedDPO

    m = setup.cfg.method
    kw = dict(model=setup.model, beta=m.beta, lr=m.lr, local_steps=m.local_steps, batch_size=m.batch_size,
              grad_clip=m.grad_clip, seed=setup.cfg.seed, rounds=setup.cfg.federation.rounds, precision=m.precision,
              lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, diagnostics_every=m.diagnostics_every,
              diagnostic_pairs=m.diagnostic_pairs, spill_sum=m.spill_sum,
              train_sizes={cid: len(d.train["chosen_ids"]) for cid, d in setup.clients.items()})
    if m.name == "dpo-central":
        return CentralizedDPO(pair_length=setup.cfg.data.max_length, **kw)
    return PFedDPO(personal=m.name == "pfeddpo", **kw)
