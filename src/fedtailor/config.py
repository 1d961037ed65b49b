"""Typed run configuration (TOML or YAML), with validation errors that name the field and the allowed values.

Layout::

    seed = 41            # fixes partition, schedule, public randomness and noise
    device = "auto"      # auto | cpu | cuda[:N]
    [data]       dataset, partition scheme, clients, alpha, splits
    [federation] rounds, clients per round, evaluation cadence
    [method]     name = "compact" (default) or any registered method, and that method's options

The ``[method]`` section is validated by the config model its ``name`` registered
(:func:`fedtailor.fl.registry.register_method`): each method module declares its own model, so a method defined
later (a plug-in, a test) is accepted as the built-in ones are. Importing this module imports neither torch nor
a method; validating a ``[method]`` section imports the built-in method modules once (and with them torch).

``--set key=value`` overrides use dotted paths (``method.lr=0.05``); values are parsed as TOML literals.
"""

from __future__ import annotations

import json
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fedtailor.fl import registry
from fedtailor.fl.registry import DEFAULT_METHOD


class Section(BaseModel):
    """Base of every config section (a method's config model too): unknown fields are refused, and an
    assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


_Section = Section


def default_config() -> Path:
    """The embedded default config (the quick-start job)."""
    return Path(str(resources.files("fedtailor") / "configs" / "quickstart.toml"))


def _default_method() -> BaseModel:
    return registry.method_spec(DEFAULT_METHOD).config()


def method_config(value: Any) -> Any:
    """A ``[method]`` table validated by the config model of the method its ``name`` names (default
    ``"compact"``); a registered config instance as it is."""
    if isinstance(value, BaseModel):
        name = getattr(value, "name", None)
        if registry.is_method(name) and isinstance(value, registry.method_spec(name).config):
            return value
        raise PydanticCustomError(
            "method_config",
            "a method config of a registered method is expected (got {got})",
            {"got": type(value).__name__},
        )
    if not isinstance(value, dict):
        return value  # the model_type error of the field says a table is expected
    name = value.get("name", DEFAULT_METHOD)
    if not registry.is_method(name):
        raise PydanticCustomError(
            "unknown_method",
            "unknown method {tag}; allowed: {allowed}",
            {"tag": repr(name), "allowed": ", ".join(map(repr, registry.method_names()))},
        )
    return registry.method_spec(name).config.model_validate(value)


class DataConfig(_Section):
    dataset: str = "mnist"
    root: str | None = Field(None, description="folder for datasets read from a path (cifar10, fashion-mnist)")
    scheme: Literal["dirichlet-equal", "dirichlet-per-class", "iid"] = "dirichlet-equal"
    num_clients: int = Field(50, ge=2)
    num_unseen: int = Field(10, ge=0)
    alpha: float = Field(0.5, gt=0)
    eval_fraction: float = Field(0.2, gt=0, lt=1)
    validation: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="> 0: hold out this fraction of each seen client's training records as its validation split",
    )
    validation_mode: Literal["replace", "alongside"] = Field(
        "replace",
        description="with data.validation > 0: 'replace' evaluates on the validation split instead of the test "
        "split (for choosing hyperparameters; unseen clients are not evaluated); 'alongside' keeps the test split "
        "and also evaluates on the validation split (val_* metrics), so the results report the round chosen on it",
    )
    context_size: int = Field(333, ge=0, description="m_c, records of each client's context (0: none)")
    min_records: int = Field(
        0, ge=0, description="every client gets at least this many records (dirichlet-per-class only)"
    )
    limit: int | None = Field(None, ge=100, description="use only the first N pooled records (quick runs)")
    pairs_per_client: int = Field(120, ge=1, description="preference data: training pairs per client")
    heldout_pairs: int = Field(30, ge=0, description="preference data: held-out pairs per client")
    preference_split: Literal["random", "length"] = Field(
        "random",
        description="preference data: a random split, or one by chosen-minus-rejected length so that "
        "the clients' preferences differ (docs/pfeddpo.md)",
    )
    max_length: int = Field(64, ge=8, description="preference data: tokens per sequence (prompt + response)")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.num_unseen >= self.num_clients:
            raise ValueError(f"num_unseen ({self.num_unseen}) must be smaller than num_clients ({self.num_clients}).")
        return self


class FederationConfig(_Section):
    rounds: int = Field(500, ge=1)
    clients_per_round: int = Field(2, ge=1)
    eval_every: int = Field(0, ge=0, description="evaluate all clients every N rounds (0: only at the end)")
    checkpoint_every: int = Field(25, ge=1)


# A name that becomes part of a path (the run directory OUT_DIR/NAME-seedSEED): one plain path component.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_plain_name(value: str) -> str:
    """``value`` if it is one plain path component (letters, digits, '.', '_', '-'; no '..', no '/'), else a
    pydantic error that says so."""
    if not PLAIN_NAME.fullmatch(value) or ".." in value:
        raise PydanticCustomError(
            "plain_name",
            "must be a plain name of letters, digits, '.', '_' and '-' that starts with a letter "
            "or digit and holds no '..' (it names the run directory), e.g. \"my-run\"",
        )
    return value


class RunConfig(Section):
    name: str = Field("run", description="names the run directory OUT_DIR/NAME-seedSEED (a plain name)")
    seed: int = 41
    device: str = "auto"
    out_dir: str = "runs"
    data: DataConfig = DataConfig()
    federation: FederationConfig = FederationConfig()
    method: SerializeAsAny[Section] = Field(
        default_factory=_default_method, description="the method and its options (its registered config model)"
    )

    @field_validator("method", mode="before")
    @classmethod
    def _method(cls, value: Any) -> Any:
        return method_config(value)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return check_plain_name(value)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        seen = self.data.num_clients - self.data.num_unseen
        if self.federation.clients_per_round > seen:
            raise ValueError(
                f"federation.clients_per_round ({self.federation.clients_per_round}) exceeds the number of seen "
                f"clients ({seen} = data.num_clients - data.num_unseen)."
            )
        finetune = getattr(self.method, "unseen_finetune_epochs", 0)
        unseen_evaluated = not self.data.validation or self.data.validation_mode == "alongside"
        if finetune and self.data.num_unseen and not self.data.context_size and unseen_evaluated:
            raise ValueError(
                f"method.unseen_finetune_epochs = {finetune} fine-tunes each unseen client on its labelled context "
                "records, but data.context_size = 0 leaves it none; set data.context_size > 0 (e.g. 100) or "
                "method.unseen_finetune_epochs = 0 (evaluate unseen clients with the global model only)."
            )
        return self


class ConfigError(ValueError):
    """A config that does not validate; the message names each bad field and what is allowed."""


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        parts = [str(p) for p in e["loc"] if not str(p).startswith("function-after")]
        loc = ".".join(parts) or "(top level)"
        if e["type"] == "unknown_method":
            ctx = e.get("ctx", {})
            lines.append(f"{loc}.name: unknown method {ctx.get('tag')}; allowed: {ctx.get('allowed')}.")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown field; check the spelling (see `fedtailor run --help` and configs/).")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{loc}: {e['msg']}{got_s}")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as a TOML literal, else as a plain string."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r} (example: --set federation.rounds=20).")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def _apply(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {part} is not a section.")
    node[path[-1]] = value


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist.")
    if path.is_dir():
        raise ConfigError(f"config path {path} is a directory; give a .toml, .yaml or .json file.")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file; a config is TOML, YAML or JSON text.") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}.") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
            raise ConfigError(f"{path} is not valid YAML{at}: {getattr(err, 'problem', None) or err}.") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err}.") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path} is not valid TOML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must contain a table/mapping at the top level.")
    return data


def config_digest(cfg: RunConfig) -> str:
    """SHA-256 of the resolved config (every field, defaults included): what a node operator pins so that the node
    serves only the run it approved (``--node-config "config-sha256=..."``, docs/flower.md)."""
    import hashlib

    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()


def load_config(source: str | Path | dict[str, Any] | None = None, overrides: list[str] = ()) -> RunConfig:
    """Build a validated :class:`RunConfig` from a file (or dict, or defaults) plus ``key=value`` overrides."""
    tree = dict(source) if isinstance(source, dict) else read_config_file(source) if source else {}
    for item in overrides:
        path, value = parse_override(item)
        _apply(tree, path, value)
    if isinstance(tree.get("method"), dict):
        tree["method"] = {"name": DEFAULT_METHOD, **tree["method"]}
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as TOML-compatible JSON text (every default spelled out)."""
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=False)


# Names that lived here before each method declared its own config model (kept for existing imports).
_MOVED = {
    "CompactConfig": "fedtailor.methods.compact.adaptation",
    "PrivacyConfig": "fedtailor.methods.compact.adaptation",
    "COMPACT_VARIANTS": "fedtailor.methods.compact.adaptation",
    "DPOConfig": "fedtailor.methods.dpo.pfeddpo",
    "FedLAGConfig": "fedtailor.methods.pfl.local",
    "LocalSGDConfig": "fedtailor.methods.pfl.local",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    if name == "METHOD_NAMES":
        return registry.method_names()
    if name == "DPO_METHODS":
        return tuple(s.name for s in registry.methods() if s.data == "preferences")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
