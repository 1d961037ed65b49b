"""From a validated config to the pieces of a preference run: the model, tokenized pairs per client, the
schedule: the data kind ``"preferences"`` (:func:`fedtailor.fl.registry.register_data`), which the DPO methods
run on; the image kind is :mod:`fedtailor.data.setup`.

``data.dataset``: ``"hh-rlhf"`` (the harmless-base file kept beside the project, else the hub's
``Anthropic/hh-rlhf`` through ``datasets``), ``"hh-rlhf:<path>"`` (a ``.jsonl[.gz]`` of that format) or
``"shp:<path>"`` (Stanford SHP rows). Without the local file and without the hub (offline: ``HF_HUB_OFFLINE``,
or the hub not answering within a few seconds) the run stops at once with one line that names the local path,
where to get the file and ``data.dataset`` to point at a copy.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedtailor.config import RunConfig
from fedtailor.data.datasets import DatasetNotAvailable
from fedtailor.device import select_device
from fedtailor.fl.records import ClientData
from fedtailor.fl.registry import register_data
from fedtailor.fl.schedule import uniform_schedule
from fedtailor.lm.preference import (
    HH_FILE,
    PairSplit,
    PreferencePair,
    federated_pairs,
    hold_out_validation,
    load_hh_rlhf,
    load_shp,
    shared_data_file,
    shared_data_roots,
    tokenize_pairs,
)
from fedtailor.lm.training import precision_warning

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
        return PreferenceData(name, load_hh_rlhf(path) if path is not None else _hh_rlhf_from_hub())
    kind, _, path = name.partition(":")
    if not Path(path).is_file():
        raise DatasetNotAvailable(
            f"data.dataset {name!r}: {path} is not a file; give the path of a .jsonl or .jsonl.gz file of "
            f"{'HH-RLHF' if kind == 'hh-rlhf' else 'SHP'} rows."
        )
    return PreferenceData(kind, load_hh_rlhf(path) if kind == "hh-rlhf" else load_shp(path))


HUB_DATASET, HUB_TIMEOUT = "Anthropic/hh-rlhf", 5.0  # seconds to wait for the hub before calling it offline


def _hh_rlhf_from_hub() -> list[PreferencePair]:
    """The hub's HH-RLHF harmless-base test split, or one line naming the local file and how to get it when
    the hub is offline, unreachable or fails (no 30 s of retries first)."""
    local = shared_data_roots()[0].joinpath(*HH_FILE)

    def missing(reason: str) -> DatasetNotAvailable:
        return DatasetNotAvailable(
            f"data.dataset 'hh-rlhf': no local copy at {local} and the hub's {HUB_DATASET} is unavailable "
            f"({reason}). Put HH-RLHF's harmless-base test.jsonl.gz (hub dataset {HUB_DATASET}, file "
            f"harmless-base/test.jsonl.gz) at {local} (or $FEDTAILOR_DATA/{'/'.join(HH_FILE)}), or point the "
            "config at a copy: --set 'data.dataset=\"hh-rlhf:/path/to/test.jsonl.gz\"'."
        )

    flags = [
        v
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
        if os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
    ]
    if flags:
        raise missing(f"{flags[0]} is set")
    reason = _hub_unreachable()
    if reason is not None:
        raise missing(reason)
    try:
        return load_hh_rlhf(None)
    except ImportError:
        raise missing("the datasets package is not installed: pip install datasets") from None
    except Exception as err:
        raise missing(f"{type(err).__name__}: {' '.join(str(err).split())[:120]}") from None


def _hub_unreachable() -> str | None:
    """None when the hub answers within :data:`HUB_TIMEOUT` seconds, else why not (one request, proxies of the
    environment honoured, ``HF_ENDPOINT`` too)."""
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        probe = urllib.request.Request(f"{endpoint}/api/datasets/{HUB_DATASET}", method="HEAD")
        urllib.request.urlopen(probe, timeout=HUB_TIMEOUT).close()
    except urllib.error.HTTPError:
        return None  # the hub answered (its answer is for datasets to interpret)
    except (OSError, ValueError) as err:  # URLError, a timeout, a refused connection, a bad HF_ENDPOINT
        return f"{endpoint} did not answer: {getattr(err, 'reason', err)}"
    return None


def preference_clients(
    tokenizer: Any,
    pairs: list[PreferencePair],
    split: PairSplit,
    *,
    max_length: int,
    validation_mode: str = "replace",
) -> dict[int, ClientData]:
    """Each client's tokenized pairs: ``train``, ``eval`` its held-out pairs (None when it has none: it is then not
    evaluated) and, with a validation split (``data.validation``), in ``"replace"`` mode ``eval`` its validation
    pairs instead (for choosing hyperparameters: no held-out pair is used), in ``"alongside"`` mode ``val`` its
    validation pairs beside the held-out ones (so the results report the round chosen on them)."""
    tok = lambda idx: tokenize_pairs(tokenizer, [pairs[i] for i in idx], max_length=max_length) if len(idx) else None
    clients = {}
    for cid, (train, held) in enumerate(zip(split.train, split.heldout)):
        val = tok(split.validation[cid]) if split.validation is not None else None
        if val is not None and validation_mode == "replace":
            clients[cid] = ClientData(cid=cid, seen=True, train=tok(train), eval=val)
        else:
            clients[cid] = ClientData(cid=cid, seen=True, train=tok(train), eval=tok(held), val=val)
    return clients


def build_preference_setup(cfg: RunConfig) -> PreferenceSetup:
    from fedtailor.lm.model import load_causal_lm

    d, m = cfg.data, cfg.method
    if d.num_unseen:
        raise ValueError("preference runs have no unseen clients; set data.num_unseen = 0.")
    device = select_device(cfg.device)
    data = load_pairs(d.dataset)
    split = federated_pairs(
        data.pairs,
        num_clients=d.num_clients,
        per_client=d.pairs_per_client,
        heldout=d.heldout_pairs,
        scheme=d.preference_split,
        seed=cfg.seed,
    )
    if d.validation:
        split = hold_out_validation(split, d.validation, seed=cfg.seed)
    if warning := precision_warning(getattr(m, "precision", "fp32"), device):
        log.warning(warning)
    lm = load_causal_lm(m.model, device=str(device))
    clients = preference_clients(
        lm.tokenizer, data.pairs, split, max_length=d.max_length, validation_mode=d.validation_mode
    )
    order = uniform_schedule(
        num_clients=d.num_clients,
        rounds=cfg.federation.rounds,
        per_round=cfg.federation.clients_per_round,
        seed=cfg.seed,
    )
    log.info(
        "%s: %d pairs, %d clients x %d (+%d held out), model %s",
        data.name,
        len(data.pairs),
        d.num_clients,
        d.pairs_per_client,
        d.heldout_pairs,
        lm.source,
    )
    return PreferenceSetup(cfg=cfg, device=device, dataset=data, clients=clients, schedule=order, model=lm.model)


register_data("preferences", build_setup=build_preference_setup, check_name=check_preference_name)
