"""Shared fixtures of the end-to-end tests: a tiny real-data run (digits) that finishes in about a second."""

import pytest

TINY_TOML = """
name = "tiny"
[data]
dataset = "digits"
num_clients = 6
num_unseen = 1
context_size = 20
[federation]
rounds = 4
clients_per_round = 3
eval_every = 2
checkpoint_every = 1
[method]
name = "fedavg"
model = "mlp"
lr = 0.1
"""


@pytest.fixture()
def tiny(tmp_path) -> list[str]:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_TOML)
    return [str(path)]
