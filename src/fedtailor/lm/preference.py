"""Preference pairs: Anthropic HH-RLHF and the Stanford SHP format, tokenization with response masks, and the
federated split of pFedDPO.

* HH-RLHF (Bai et al., *Training a Helpful and Harmless Assistant with Reinforcement Learning from Human
  Feedback*, 2022, arXiv:2204.05862): each row holds two whole dialogues (``chosen``, ``rejected``) that share
  their history and differ in the final assistant turn. :func:`split_dialogues` cuts them into the shared
  prompt (up to and including the last ``"\\n\\nAssistant:"``) and the two responses, so that
  ``prompt + chosen`` is exactly the original chosen dialogue.
* SHP (Ethayarajh, Choi, Swayamdipta, *Understanding Dataset Difficulty with V-Usable Information*, 2022): rows
  with ``history`` (the post), ``human_ref_A`` / ``human_ref_B`` (two comments) and ``labels`` (1: A preferred).
  The prompt is written in the same dialogue format as HH-RLHF.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fedtailor.rng import numpy_rng

HH_FILE = ("hh-rlhf-harmless-base", "test.jsonl.gz")
ASSISTANT = "\n\nAssistant:"
HUMAN = "\n\nHuman:"


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


def split_dialogues(chosen: str, rejected: str) -> PreferencePair:
    """The shared prompt and the two final assistant turns of an HH-RLHF row."""
    cut = chosen.rfind(ASSISTANT)
    if cut < 0:
        raise ValueError("an HH-RLHF dialogue must contain an '\\n\\nAssistant:' turn.")
    prompt = chosen[: cut + len(ASSISTANT)]
    if not rejected.startswith(prompt):  # histories differ: back off to the last shared assistant marker
        common = 0
        for a, b in zip(chosen, rejected):
            if a != b:
                break
            common += 1
        cut = chosen.rfind(ASSISTANT, 0, common - len(ASSISTANT) + 1)
        if cut < 0:
            raise ValueError("the two dialogues share no assistant turn; not an HH-RLHF preference row.")
        prompt = chosen[: cut + len(ASSISTANT)]
    return PreferencePair(prompt=prompt, chosen=chosen[len(prompt) :], rejected=rejected[len(prompt) :])


def shared_data_roots() -> list[Path]:
    """Where :func:`shared_data_file` looks, in order: ``$FEDTAILOR_DATA``, then ``shared/data`` beside the
    repository and beside each of its parent folders."""
    import os

    roots = [Path(os.environ["FEDTAILOR_DATA"])] if "FEDTAILOR_DATA" in os.environ else []
    here = Path(__file__).resolve()
    return roots + [parent / "shared" / "data" for parent in here.parents[3:]]  # the repository, then upwards


def shared_data_file(*parts: str) -> Path | None:
    """A file of the data kept beside the project: ``$FEDTAILOR_DATA/...`` or ``shared/data/...`` beside the
    repository or beside one of its parent folders (None if absent)."""
    for root in shared_data_roots():
        if (root.joinpath(*parts)).is_file():
            return root.joinpath(*parts)
    return None


def _read_jsonl(path: Path) -> Iterable[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError:
                    raise ValueError(f"{path} line {i} is not JSON; expected one JSON object per line.") from None


def load_hh_rlhf(
    path: str | Path | None = None, *, subset: str = "harmless-base", split: str = "test"
) -> list[PreferencePair]:
    """HH-RLHF pairs from a ``.jsonl`` / ``.jsonl.gz`` file of ``{"chosen", "rejected"}`` rows, or (``path`` None,
    network needed) from the hub dataset ``Anthropic/hh-rlhf`` through ``datasets``. Rows whose two responses
    are identical carry no preference and are dropped."""
    if path is not None:
        rows = list(_read_jsonl(Path(path)))
    else:
        from datasets import load_dataset

        rows = list(load_dataset("Anthropic/hh-rlhf", data_dir=subset, split=split))
    pairs = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not {"chosen", "rejected"} <= set(row):
            raise ValueError(f"row {i} lacks 'chosen'/'rejected'; not HH-RLHF data.")
        pair = split_dialogues(row["chosen"], row["rejected"])
        if pair.chosen != pair.rejected:
            pairs.append(pair)
    return pairs


def load_shp(path: str | Path) -> list[PreferencePair]:
    """Stanford SHP rows (``history``, ``human_ref_A``, ``human_ref_B``, ``labels``) from a ``.jsonl[.gz]`` file."""
    pairs = []
    for i, row in enumerate(_read_jsonl(Path(path))):
        missing = {"history", "human_ref_A", "human_ref_B", "labels"} - set(row)
        if missing:
            raise ValueError(f"{path} row {i} lacks {sorted(missing)}; not SHP data.")
        a, b = row["human_ref_A"], row["human_ref_B"]
        chosen, rejected = (a, b) if int(row["labels"]) == 1 else (b, a)
        pairs.append(
            PreferencePair(prompt=f"{HUMAN} {row['history']}{ASSISTANT}", chosen=" " + chosen, rejected=" " + rejected)
        )
    return pairs


def tokenize_pairs(
    tokenizer: Any, pairs: Sequence[PreferencePair], *, max_length: int = 64, max_prompt_length: int | None = None
) -> dict[str, torch.Tensor]:
    """Token ids, attention masks and response masks of both sides of every pair, right-padded to
    ``max_length``.

    The prompt keeps its *last* ``max_prompt_length`` tokens (default half of ``max_length``: the turns right
    before the answer matter most), the response its first ``max_length - len(prompt)`` tokens, with the end
    token appended when it fits. Both sides share the same prompt tokens. The response mask is 1 exactly on
    response tokens (the end token included), so only they are scored."""
    budget = max_length // 2 if max_prompt_length is None else max_prompt_length
    if not 1 <= budget < max_length:
        raise ValueError(f"need 1 <= max_prompt_length < max_length, got {budget} and {max_length}.")
    eos, pad = (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    out = {
        f"{side}_{k}": torch.full((len(pairs), max_length), pad if k == "ids" else 0, dtype=torch.long)
        for side in ("chosen", "rejected")
        for k in ("ids", "attention", "response")
    }
    for i, pair in enumerate(pairs):
        prompt = tokenizer.encode(pair.prompt, add_special_tokens=False)[-budget:]
        for side, text in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            resp = tokenizer.encode(text, add_special_tokens=False) + ([eos] if eos is not None else [])
            resp = resp[: max_length - len(prompt)]
            ids = prompt + resp
            out[f"{side}_ids"][i, : len(ids)] = torch.tensor(ids)
            out[f"{side}_attention"][i, : len(ids)] = 1
            out[f"{side}_response"][i, len(prompt) : len(ids)] = 1
    return out


Scheme = Literal["random", "length"]


@dataclass(frozen=True)
class PairSplit:
    train: list[np.ndarray]  # per client: indices into the pair list
    heldout: list[np.ndarray]
    validation: list[np.ndarray] | None = None  # per client, held out of its training pairs (hold_out_validation)


def federated_pairs(
    pairs: Sequence[PreferencePair],
    *,
    num_clients: int = 5,
    per_client: int = 120,
    heldout: int = 30,
    scheme: Scheme = "random",
    seed: int,
) -> PairSplit:
    """Disjoint pairs per client (``per_client`` training and ``heldout`` held-out each), fixed by ``seed``.

    ``random``: a uniform random assignment (the clients' preferences differ only by chance). ``length``: the
    pairs are ranked by how much longer the chosen response is than the rejected one (characters), and client
    ``i`` gets the ``i``-th of ``num_clients`` contiguous blocks of that ranking, so client 0's chosen answers
    are the much shorter ones and the last client's the much longer ones: the clients genuinely prefer
    different things (brevity against detail), which a shared model cannot fit at once and a personal adapter
    can. Within a block, pairs are split into training and held-out at random."""
    need = num_clients * (per_client + heldout)
    if need > len(pairs):
        raise ValueError(
            f"{num_clients} clients x ({per_client} + {heldout}) pairs need {need}, have {len(pairs)}; "
            "use fewer clients or pairs."
        )
    rng = numpy_rng(seed, "preference-split", scheme)
    if scheme == "random":
        chosen = rng.permutation(len(pairs))[:need]
        blocks = np.split(chosen, num_clients)
    elif scheme == "length":
        gap = np.array([len(p.chosen) - len(p.rejected) for p in pairs], dtype=np.float64)
        order = np.lexsort((rng.random(len(pairs)), gap))  # ties broken at random
        # take the blocks from evenly spaced parts of the whole ranking, so the extremes are represented
        edges = np.linspace(0, len(pairs), num_clients + 1).astype(int)
        blocks = [rng.permutation(order[a:b])[: per_client + heldout] for a, b in itertools.pairwise(edges)]
    else:
        raise ValueError(f"unknown scheme {scheme!r}; use 'random' or 'length'.")
    return PairSplit(train=[np.sort(b[:per_client]) for b in blocks], heldout=[np.sort(b[per_client:]) for b in blocks])


def hold_out_validation(split: PairSplit, fraction: float, *, seed: int) -> PairSplit:
    """``split`` with ``round(fraction * |train|)`` of each client's training pairs held out as its validation
    pairs (key (seed, "preference-split", "validation", client)) and removed from its training pairs; its held-out
    pairs are untouched (the preference data's ``data.validation``)."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must lie in (0, 1), got {fraction!r} (for example 0.2).")
    train, validation = [], []
    for client, pairs in enumerate(split.train):
        n_val = round(fraction * len(pairs))
        if not 0 < n_val < len(pairs):
            raise ValueError(
                f"data.validation = {fraction} holds out {n_val} of client {client}'s {len(pairs)} training pairs; "
                "choose a fraction that leaves it both validation and training pairs."
            )
        order = numpy_rng(seed, "preference-split", "validation", client).permutation(pairs)
        validation.append(np.sort(order[:n_val]))
        train.append(np.sort(order[n_val:]))
    return PairSplit(train=train, heldout=split.heldout, validation=validation)
