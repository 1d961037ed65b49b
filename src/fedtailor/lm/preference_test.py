"""Preference data: the HH-RLHF split reconstructs the dialogues, SHP rows read in their real format, response
masks cover exactly the response tokens, the federated split and its validation pairs are disjoint and fixed by
the seed, and each validation mode gives the clients the pairs it says."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtailor.lm.preference import (
    HH_FILE,
    PreferencePair,
    federated_pairs,
    hold_out_validation,
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


def test_validation_pairs_come_out_of_the_training_pairs_alone_and_are_seeded():
    pairs = [PreferencePair("p", "x" * (i % 7 + 1), "y") for i in range(200)]
    split = federated_pairs(pairs, num_clients=4, per_client=30, heldout=5, seed=3)
    held = hold_out_validation(split, 0.2, seed=3)
    for c in range(4):
        train, val = set(held.train[c].tolist()), set(held.validation[c].tolist())
        assert len(val) == 6 and len(train) == 24 and not train & val  # round(0.2 * 30) held out
        assert train | val == set(split.train[c].tolist())  # out of the training pairs, nothing else
        assert np.array_equal(held.heldout[c], split.heldout[c])  # the held-out pairs untouched
    again, other = hold_out_validation(split, 0.2, seed=3), hold_out_validation(split, 0.2, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(held.validation, again.validation))
    assert any(not np.array_equal(a, b) for a, b in zip(held.validation, other.validation))
    positions = {tuple(np.searchsorted(t, v)) for t, v in zip(split.train, held.validation)}
    assert len(positions) == 4  # a key per client: not the same places of each client's pairs
    with pytest.raises(ValueError, match="holds out 0 of client 0's 30 training pairs; choose a fraction"):
        hold_out_validation(split, 0.01, seed=3)


@pytest.mark.parametrize("mode", ["replace", "alongside"])
def test_each_validation_mode_gives_the_clients_the_pairs_it_says(mode):
    from fedtailor.lm.setup import preference_clients

    pairs = [PreferencePair("p", "x" * (i % 7 + 1), "y" * (i % 5 + 1)) for i in range(100)]
    split = hold_out_validation(federated_pairs(pairs, num_clients=2, per_client=20, heldout=4, seed=1), 0.25, seed=1)
    clients = preference_clients(CharTokenizer(), pairs, split, max_length=16, validation_mode=mode)
    tok = lambda idx: tokenize_pairs(CharTokenizer(), [pairs[i] for i in idx], max_length=16)
    same = lambda a, b: a is not None and all(torch.equal(a[k], b[k]) for k in b)
    for c, data in clients.items():
        assert same(data.train, tok(split.train[c])) and len(data.train["chosen_ids"]) == 15
        if mode == "replace":  # evaluated on the validation pairs; no held-out pair used
            assert same(data.eval, tok(split.validation[c])) and data.val is None
        else:
            assert same(data.eval, tok(split.heldout[c])) and same(data.val, tok(split.validation[c]))
