"""The Flower apps' defaults in a deployment: risky settings refused unless allowed, and a failing client that
tells the server nothing of why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")

from fedtailor.flower import apps


class _Risky:
    def deployment_risks(self):
        return {"simulation-randomness": "noise from the seed", "diagnostics": "functions of the input"}


def test_the_server_refuses_risky_settings_unless_the_run_config_allows_them():
    with pytest.raises(RuntimeError, match="allow='simulation-randomness,diagnostics'"):
        apps.refuse_unsafe(_Risky(), "")
    with pytest.raises(RuntimeError, match="diagnostics: functions of the input") as err:
        apps.refuse_unsafe(_Risky(), "simulation-randomness")
    assert "simulation-randomness:" not in str(err.value)
    apps.refuse_unsafe(_Risky(), " simulation-randomness , diagnostics")  # both allowed: no error


def test_the_quick_start_config_is_refused_in_a_deployment():
    """Without a config the apps fall back to the quick start, which sets simulation randomness: a deployment
    started that way is refused instead of deriving its noise from a public seed."""
    from fedtailor.cli.run import default_config
    from fedtailor.config import load_config

    cfg = load_config(default_config(), [])
    assert cfg.method.privacy.randomness == "simulation"
    from fedtailor.experiment import build_method, build_setup

    small = [
        'data.dataset="mnist-5k"',
        "data.num_clients=4",
        "data.num_unseen=1",
        "data.context_size=60",
        "federation.rounds=1",
        "method.coef_dim=256",
        "method.hidden_dim=8",
        "method.privacy.batch_size=60",
    ]
    method = build_method(build_setup(load_config(default_config(), small)))
    with pytest.raises(RuntimeError, match="simulation-randomness"):
        apps.refuse_unsafe(method, "")


def test_a_client_failure_reaches_the_server_without_its_reason(monkeypatch, caplog):
    """The reason of a failure on a node may hold a function of its data (an exact message length, a norm): it
    stays in the node's log, and the server gets a generic error."""
    secret = "a release of 1,913 bytes"

    class _Method:
        def deployment_risks(self):
            return {}

        def init_client(self, cid):
            return None

    def boom(*_):
        raise ValueError(secret)

    monkeypatch.setattr(apps, "_client", lambda ctx: (SimpleNamespace(clients={0: None}), _Method(), 0))
    monkeypatch.setattr(apps, "handle", boom)
    monkeypatch.setattr(apps, "from_records", lambda content: content)
    context = SimpleNamespace(node_config={"partition-id": 0}, state={})
    with pytest.raises(apps.ClientFailed) as err:
        apps._on_node("train", SimpleNamespace(content={}), context)
    assert secret not in str(err.value) and err.value.__cause__ is None
    assert secret in caplog.text  # the node's own log keeps it


def test_a_node_refuses_risky_settings_its_own_operator_did_not_allow(monkeypatch):
    monkeypatch.setattr(apps, "_client", lambda ctx: (SimpleNamespace(clients={0: None}), _Risky(), 0))
    calls = []
    monkeypatch.setattr(apps, "handle", lambda *a: calls.append(a))
    with pytest.raises(apps.ClientFailed):
        apps._on_node("train", SimpleNamespace(content={}), SimpleNamespace(node_config={"partition-id": 0}, state={}))
    assert not calls  # refused before any work


def test_a_node_pinned_to_a_config_refuses_any_other(monkeypatch):
    """A node's operator pins the resolved config it approved (``config-sha256``): a run started with another
    config (here the same run with a 16x larger epsilon target) is refused before any work."""
    from fedtailor.config import config_digest, load_config

    approved = load_config(None, ["method.privacy.epsilon=4"])
    other = load_config(None, ["method.privacy.epsilon=64"])
    assert config_digest(approved) != config_digest(other)
    assert config_digest(approved) == config_digest(load_config(None, ["method.privacy.epsilon=4.0"]))
    monkeypatch.setattr(apps, "_build", lambda *a: (SimpleNamespace(cfg=other, clients={0: None}), _Risky()))
    context = SimpleNamespace(
        node_config={"partition-id": 0, "config-sha256": config_digest(approved)}, run_config={}, state={}
    )
    with pytest.raises(apps.RequestRefused, match="not the pinned"):
        apps._client(context)
    context.node_config["config-sha256"] = config_digest(other)
    assert apps._client(context)[2] == 0
