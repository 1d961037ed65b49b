"""Preference data: the HH-RLHF split reconstructs the dialogues, SHP rows read in their real format, response
masks cover exactly the response tokens, and the federated split is disjoint and fixed by the seed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from fedtailor.lm.preference import (
    HH_FILE,
    PreferencePair,
    federated_pairs,
    load_hh_rlhf,
    load_shp,
    shared_data_file,
    split_dialogues,
    tokenize_pairs,
)

HH = shared_data_file(*HH_FILE) or Path("missing")


class CharTokenizer:
    """One token per character (id = code point), end token 1, pad token 0: enough to check the masking."""

    eos_token_id, pad_token_id = 1, 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_split_dialogues_on_a_hand_built_row():
    chosen = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: help me\n\nAssistant: Sure."
    rejected = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: help me\n\nAssistant: No."
    pair = split_dialogues(chosen, rejected)
    assert pair.prompt.endswith("help me\n\nAssistant:") and pair.chosen == " Sure." and pair.rejected == " No."
    with pytest.raises(ValueError, match="Assistant"):
        split_dialogues("no turns", "here")


@pytest.mark.skipif(not HH.exists(), reason="needs ../shared/data/hh-rlhf-harmless-base")
def test_the_real_hh_rlhf_file_splits_into_prompts_and_final_turns():
    pairs = load_hh_rlhf(HH)
    with gzip.open(HH, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2312 and 2200 <= len(pairs) <= 2312
    by_prompt = {(p.prompt + p.chosen): p for p in pairs}
    exact = sum(
        1
        for r in rows
        if r["chosen"] in by_prompt and by_prompt[r["chosen"]].prompt + by_prompt[r["chosen"]].rejected == r["rejected"]
    )
    assert exact >= 0.99 * len(pairs)  # prompt + response is the original dialogue
    assert all(p.prompt.endswith("Assistant:") and p.chosen != p.rejected for p in pairs)


def test_shp_rows_in_their_real_format(tmp_path):
    row = {
        "post_id": "x",
        "domain": "askscience_train",
        "upvote_ratio": 0.9,
        "history": "Why is the sky blue?",
        "c_root_id_A": "a",
        "c_root_id_B": "b",
        "created_at_utc_A": 1,
        "created_at_utc_B": 2,
        "score_A": 30,
        "score_B": 4,
        "human_ref_A": "Rayleigh scattering.",
        "human_ref_B": "Because.",
        "labels": 1,
        "seconds_difference": 1.0,
        "score_ratio": 7.5,
    }
    path = tmp_path / "train.json"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "labels": 0}) + "\n")
    a, b = load_shp(path)
    assert a.chosen == " Rayleigh scattering." and a.rejected == " Because." and b.chosen == " Because."
    assert a.prompt == "\n\nHuman: Why is the sky blue?\n\nAssistant:"
    path.write_text(json.dumps({"history": "x"}) + "\n")
    with pytest.raises(ValueError, match="not SHP"):
        load_shp(path)


def test_response_masks_cover_exactly_the_response_tokens():
    tok = CharTokenizer()
    pair = PreferencePair(prompt="abcdefgh", chosen="XY", rejected="Zwvutsrqp")
    t = tokenize_pairs(tok, [pair], max_length=10, max_prompt_length=5)
    ids, resp, att = t["chosen_ids"][0].tolist(), t["chosen_response"][0].tolist(), t["chosen_attention"][0].tolist()
    assert ids == [ord(c) for c in "defgh"] + [ord("X"), ord("Y"), 1, 0, 0]  # prompt kept from its end
    assert resp == [0] * 5 + [1, 1, 1, 0, 0] and att == [1] * 8 + [0, 0]
    r_ids, r_resp = t["rejected_ids"][0].tolist(), t["rejected_response"][0].tolist()
    assert r_ids[:5] == ids[:5] and r_ids[5:] == [ord(c) for c in "Zwvut"]  # truncated response, no room for end
    assert r_resp == [0] * 5 + [1] * 5


def test_the_federated_split_is_disjoint_sized_and_seeded():
    rng = np.random.default_rng(0)
    pairs = [PreferencePair("p", "x" * int(rng.integers(1, 200)), "y" * int(rng.integers(1, 200))) for _ in range(1000)]
    for scheme in ("random", "length"):
        split = federated_pairs(pairs, num_clients=5, per_client=120, heldout=30, scheme=scheme, seed=3)
        every = np.concatenate(split.train + split.heldout)
        assert len(every) == len(set(every.tolist())) == 750
        assert all(len(t) == 120 for t in split.train) and all(len(h) == 30 for h in split.heldout)
        again = federated_pairs(pairs, num_clients=5, per_client=120, heldout=30, scheme=scheme, seed=3)
        assert all(np.array_equal(a, b) for a, b in zip(split.train, again.train))
    split = federated_pairs(pairs, num_clients=5, per_client=120, heldout=30, scheme="length", seed=3)
    gaps = [np.mean([len(pairs[i].chosen) - len(pairs[i].rejected) for i in t]) for t in split.train]
    assert gaps == sorted(gaps) and gaps[0] < -50 < 50 < gaps[-1]  # from "prefers shorter" to "prefers longer"
    with pytest.raises(ValueError, match="need 1500"):
        federated_pairs(pairs, num_clients=10, per_client=120, heldout=30, seed=3)
