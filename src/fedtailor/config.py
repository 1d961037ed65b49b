"""Typed run configuration (TOML or YAML), with validation errors that name the field and the allowed values.

Layout::

    seed = 41            # fixes partition, schedule, public randomness and noise
    device = "auto"      # auto | cpu | cuda[:N]
    [data]       dataset, partition scheme, clients, alpha, splits
    [federation] rounds, clients per round, evaluation cadence
    [method]     name = "compact" (default) | "fedavg" | "fedprox" | "fedper" | "fedrep" | "fedbabu" | "ditto" |
                 "fedrod", and that method's options ([method.fedlag] wraps the last seven in FedLAG)

``--set key=value`` overrides use dotted paths (``method.lr=0.05``); values are parsed as TOML literals.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    dataset: str = "mnist"
    root: str | None = Field(None, description="folder for datasets read from a path (cifar10, fashion-mnist)")
    scheme: Literal["dirichlet-equal", "dirichlet-per-class", "iid"] = "dirichlet-equal"
    num_clients: int = Field(50, ge=2)
    num_unseen: int = Field(10, ge=0)
    alpha: float = Field(0.5, gt=0)
    eval_fraction: float = Field(0.2, gt=0, lt=1)
    validation: float = Field(
        0.0, ge=0, lt=1, description="> 0: hold out this fraction of each seen client's training records and evaluate "
        "on it instead of the test split (for choosing hyperparameters; unseen clients are not evaluated)")
    context_size: int = Field(333, ge=0, description="m_c, records of each client's context (0: none)")
    min_records: int = Field(0, ge=0, description="every client gets at least this many records "
                             "(dirichlet-per-class only)")
    limit: int | None = Field(None, ge=100, description="use only the first N pooled records (quick runs)")
    pairs_per_client: int = Field(120, ge=1, description="preference data: training pairs per client")
    heldout_pairs: int = Field(30, ge=0, description="preference data: held-out pairs per client")
    preference_split: Literal["random", "length"] = Field(
        "random", description="preference data: a random split, or one by chosen-minus-rejected length so that "
        "the clients' preferences differ (docs/pfeddpo.md)")
    max_length: int = Field(64, ge=8, description="preference data: tokens per sequence (prompt + response)")

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.num_unseen >= self.num_clients:
            raise ValueError(f"num_unseen ({self.num_unseen}) must be smaller than num_clients ({self.num_clients}).")
        return self


class FederationConfig(_Section):
    rounds: int = Field(500, ge=1)
    clients_per_round: int = Field(2, ge=1)
    eval_every: int = Field(0, ge=0, description="evaluate all clients every N rounds (0: only at the end)")
    checkpoint_every: int = Field(25, ge=1)


class FedLAGConfig(_Section):
    """FedLAG around the method it sits in (docs/fedlag.md): conflicting layers become personal."""

    top_k: int = Field(2, ge=0, description="layers made personal after the warm-up")
    xi: float = Field(0.0, ge=-1, le=1, description="a client pair conflicts on a layer when its cosine is < xi")
    warmup: int | None = Field(None, ge=0, description="scoring rounds before the choice (default min(rounds/2, 30))")
    unit: Literal["tensor", "module"] = Field("tensor", description="a layer is one tensor or one module's weight+bias")
    update: Literal["delta", "gradient"] = Field("delta", description="round delta or last-minibatch gradient")
    rechoose: bool = Field(False, description="keep scoring after the warm-up and re-choose every round")
    choice: Literal["conflict", "first", "middle", "last"] = Field(
        "conflict", description="top-k by conflict score, or a fixed First/Middle/Last-K for comparison")
    cap: int | None = Field(
        None, ge=1, description="robust score: no client takes part in more than cap of a layer's counted "
        "conflicting pairs in a round, so one client moves a score by at most cap (docs/fedlag.md); none: "
        "the paper's plain pair count")


class _LocalSGDConfig(_Section):
    """Options every parameter-sharing method has (docs/pfl.md)."""

    model: Literal["lenet", "mlp", "dnn", "fedavgcnn"] = "lenet"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    vectorize: bool | Literal["auto"] = Field(
        "auto", description="run the clients of a round together (torch.func.vmap over stacked client models); "
        "false: one client after another (same results to float rounding); auto: together except convolutional "
        "models on the CPU, where it is slower (docs/pfl.md)")
    update_bound: float | None = Field(
        None, gt=0, description="bound on the norm of each client's shared update theta_i - theta_g (none: off); "
        "a longer update is rejected or clipped (update_bound_mode), which bounds one client's influence")
    update_bound_mode: Literal["reject", "clip"] = "reject"
    fedlag: FedLAGConfig | None = Field(None, description="wrap the method in FedLAG ([method.fedlag] section)")


class FedAvgConfig(_LocalSGDConfig):
    name: Literal["fedavg"] = "fedavg"


class FedProxConfig(_LocalSGDConfig):
    name: Literal["fedprox"] = "fedprox"
    mu: float = Field(0.01, ge=0, description="proximal weight: grad F_i(w) + mu (w - w_received)")


class FedPerConfig(_LocalSGDConfig):
    name: Literal["fedper"] = "fedper"


class FedRepConfig(_LocalSGDConfig):
    name: Literal["fedrep"] = "fedrep"
    head_epochs: int = Field(1, ge=1, description="epochs on the head (body frozen) before the body epochs")


class FedBABUConfig(_LocalSGDConfig):
    name: Literal["fedbabu"] = "fedbabu"
    finetune_epochs: int = Field(10, ge=0, description="whole-model fine-tuning before the final evaluation")


class DittoConfig(_LocalSGDConfig):
    name: Literal["ditto"] = "ditto"
    lam: float = Field(0.1, ge=0, description="lambda, prox weight of the personal model to the global one")
    personal_epochs: int = Field(1, ge=1, description="epochs on the personal model per round")


class FedRoDConfig(_LocalSGDConfig):
    name: Literal["fedrod"] = "fedrod"


PFL_CONFIGS = (FedAvgConfig, FedProxConfig, FedPerConfig, FedRepConfig, FedBABUConfig, DittoConfig, FedRoDConfig)


class PrivacyConfig(_Section):
    """Record-level central DP of the compact-adaptation releases (docs/privacy.md)."""

    epsilon: float = Field(16.0, gt=0, description="target eps; inf trains without noise (sigma = 0)")
    delta: float = Field(1e-5, gt=0, lt=1)
    conversion: Literal["closed-form", "balle", "exact"] = "closed-form"
    clip: float = Field(1.0, gt=0, description="C_g, per-record clipping norm of coefficient gradients")
    batch_size: int = Field(333, ge=1, description="m_g, records per coefficient-gradient release")
    randomness: Literal["secure", "simulation"] = Field(
        "secure", description="where noise and codec keys come from: 'secure' = 256-bit keys from OS entropy drawn "
        "by each client (not reproducible); 'simulation' = derived from the seed (reproducible; whoever has the "
        "config can regenerate the noise, so eps holds only while the seed is secret)")
    sigma: float | None = Field(
        None, gt=0, description="fixed noise scale instead of calibrating it from epsilon; a schedule that would "
        "exceed epsilon with it is refused before anything is released")


# Paper names (Table 1 and the geometry controls) -> settings of the four axes.
COMPACT_VARIANTS: dict[str, dict[str, str]] = {
    "ours-dg": {"generator": "factorized", "space": "coefficient", "context": "private", "codec": "dg-fp32"},
    "ours-lrsuq": {"generator": "factorized", "space": "coefficient", "context": "private", "codec": "lrsuq"},
    "dg-q12": {"generator": "factorized", "space": "coefficient", "context": "private", "codec": "dg-q12"},
    "deeplin-dg": {"generator": "deeplin", "space": "coefficient", "context": "private", "codec": "dg-fp32"},
    "full-dg": {"generator": "factorized", "space": "full", "context": "private", "codec": "dg-fp32"},
    "global": {"generator": "direct", "space": "full", "context": "public", "codec": "dg-fp32"},
    "direct": {"generator": "direct", "space": "coefficient", "context": "public", "codec": "dg-fp32"},
    "deeplin": {"generator": "deeplin", "space": "coefficient", "context": "public", "codec": "dg-fp32"},
    "factorized": {"generator": "factorized", "space": "coefficient", "context": "public", "codec": "dg-fp32"},
    "radial": {"generator": "radial", "space": "coefficient", "context": "public", "codec": "dg-fp32"},
    "replay": {"generator": "replay", "space": "coefficient", "context": "public", "codec": "dg-fp32"},
    "factorized-ctx": {"generator": "factorized", "space": "coefficient", "context": "private", "codec": "dg-fp32"},
}


class CompactConfig(_Section):
    """Compact adaptation (docs/compact.md): a_i = W h_psi(c~_i), theta_i = theta_ref + P a_i. ``variant`` names one of
    the paper's variants and fills the four axes (generator, space, context, codec); explicit axes must agree."""

    name: Literal["compact"] = "compact"
    variant: Literal[tuple(COMPACT_VARIANTS)] | None = None  # type: ignore[valid-type]
    generator: Literal["factorized", "deeplin", "direct", "radial", "replay"] = "factorized"
    space: Literal["coefficient", "full"] = "coefficient"
    context: Literal["private", "public"] = "private"
    codec: Literal["dg-fp32", "dg-q12", "layered", "lrsuq"] = "dg-fp32"
    coder: Literal["ans", "elias"] = Field("ans", description="entropy coder of the layered/lrsuq codecs")
    block_size: int = Field(4, ge=1, le=8, description="b, LRSUQ block size")
    lattice: Literal["Z", "D4"] = Field("Z", description="LRSUQ lattice (D4 needs block_size 4)")
    model: Literal["lenet", "mlp"] = "lenet"
    coef_dim: int = Field(16_384, ge=1, description="k, dimension of the coefficient subspace")
    hidden_dim: int = Field(100, ge=1, description="r, hidden dimension of h_psi")
    lr: float = Field(0.1, gt=0, description="eta, server SGD step (0.1 MNIST, 0.2 CIFAR-10 in the paper)")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "cosine", description="eta_t = eta (constant) or eta (1 + cos(pi (t - 1) / R)) / 2 over the R rounds (cosine; "
        "chosen with lr 0.1 on a validation split, docs/compact.md)")
    init_gain: float | None = Field(
        None, gt=0, description="rescale h_psi so that E||h||^2 = init_gain at the start (default: torch's init)")
    subspace_stages: int = Field(2, ge=1, le=4)
    subspace_transform: Literal["layer-kronecker", "kronecker", "blocked-dct", "dct"] = Field(
        "blocked-dct", description="how P is built and applied (docs/subspace.md): one Kronecker block per layer "
        "(coefficient gradients straight from activations and errors), Kronecker factors over the whole parameter "
        "grid, or a fast DCT")
    replay_from: str | None = Field(None, description="run directory of a 'factorized' run whose h_norm2 gains Replay uses")
    padding: bool = Field(
        True, description="pad variable-length releases (lrsuq, layered) to one fixed length set from public inputs, "
        "so that message sizes reveal nothing about the data (off: sizes depend on ||u|| and the run's eps is void)")
    pad_bytes: int | None = Field(None, ge=64, description="the padded message size (default: from public probes)")
    diagnostics: bool = Field(
        False, description="clients also report the realised noise norm, clip fraction, message size and coding "
        "time: each is outside the DP guarantee, so a run with diagnostics reports its eps as void")
    privacy: PrivacyConfig = PrivacyConfig()

    @model_validator(mode="before")
    @classmethod
    def _apply_variant(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("variant") is None:
            return data
        preset = COMPACT_VARIANTS.get(data["variant"])
        if preset is None:
            return data  # the Literal check reports the allowed names
        for axis, value in preset.items():
            if axis in data and data[axis] != value:
                raise ValueError(
                    f"variant {data['variant']!r} sets {axis}={value!r} but {axis}={data[axis]!r} was given; "
                    f"drop one of them (or set variant to none to choose every axis yourself)."
                )
        return {**data, **preset}

    @model_validator(mode="after")
    def _check(self) -> "CompactConfig":
        if self.codec in ("lrsuq", "layered", "dg-q12") and self.privacy.epsilon == float("inf"):
            raise ValueError(f"codec {self.codec!r} realises Gaussian noise; without noise (epsilon = inf) use dg-fp32.")
        if self.generator == "replay" and not self.replay_from:
            raise ValueError("generator 'replay' needs replay_from = the run directory of a 'factorized' run.")
        if self.privacy.sigma is not None and self.privacy.epsilon == float("inf"):
            raise ValueError("method.privacy.sigma fixes the noise of a private run: give a finite epsilon target too "
                             "(the schedule is checked against it), or drop sigma for a run without noise.")
        if self.space == "full" and self.codec != "dg-fp32":
            raise ValueError("the full-space variants release dense full-model gradients: use codec dg-fp32.")
        return self


class DPOConfig(_Section):
    """pFedDPO and its two baselines (docs/pfeddpo.md); defaults from the paper's hyperparameter table."""

    name: Literal["pfeddpo", "feddpo", "dpo-central"] = "pfeddpo"
    model: str = Field("smollm2", description="'smollm2' (the package on hand), a hub name or a local folder")
    beta: float = Field(0.2, gt=0)
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    local_steps: int = Field(3, ge=1, description="E, local AdamW steps per round")
    batch_size: int = Field(4, ge=1, description="pairs per step")
    grad_clip: float = Field(1.0, gt=0, description="gradient-norm clip over base and adapter together")
    lora_rank: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    precision: Literal["fp32", "bf16"] = Field(
        "bf16", description="bf16 autocast over fp32 weights (2.2x faster DPO steps here, benchmarks/"
        "bench_dpo_step.py); fp32 for exact arithmetic")
    diagnostics_every: int = Field(0, ge=0, description="kappa^2 diagnostics every K rounds (0: off; opt-in, "
                                   "clients then send base gradients)")
    diagnostic_pairs: int = Field(4, ge=1, description="pairs per client for the diagnostic gradients")
    spill_sum: bool = Field(False, description="keep a round's running sum of the client bases in a temporary "
                            "file between folds: one base less in memory while a client trains, a write and a "
                            "read of one base per client more (docs/pfeddpo.md)")


MethodConfig = Annotated[
    CompactConfig | FedAvgConfig | FedProxConfig | FedPerConfig | FedRepConfig | FedBABUConfig | DittoConfig
    | FedRoDConfig | DPOConfig, Field(discriminator="name")]
DEFAULT_METHOD = "compact"
METHOD_NAMES = ("compact", "fedavg", "fedprox", "fedper", "fedrep", "fedbabu", "ditto", "fedrod", "pfeddpo", "feddpo",
                "dpo-central")
DPO_METHODS = ("pfeddpo", "feddpo", "dpo-central")


# A name that becomes part of a path (the run directory OUT_DIR/NAME-seedSEED): one plain path component.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_plain_name(value: str) -> str:
    """``value`` if it is one plain path component (letters, digits, '.', '_', '-'; no '..', no '/'), else a
    pydantic error that says so."""
    if not PLAIN_NAME.fullmatch(value) or ".." in value:
        raise PydanticCustomError(
            "plain_name", "must be a plain name of letters, digits, '.', '_' and '-' that starts with a letter "
            "or digit and holds no '..' (it names the run directory), e.g. \"my-run\"")
    return value


class RunConfig(_Section):
    name: str = Field("run", description="names the run directory OUT_DIR/NAME-seedSEED (a plain name)")
    seed: int = 41
    device: str = "auto"
    out_dir: str = "runs"
    data: DataConfig = DataConfig()
    federation: FederationConfig = FederationConfig()
    method: MethodConfig = CompactConfig()

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return check_plain_name(value)

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        seen = self.data.num_clients - self.data.num_unseen
        if self.federation.clients_per_round > seen:
            raise ValueError(
                f"federation.clients_per_round ({self.federation.clients_per_round}) exceeds the number of seen "
                f"clients ({seen} = data.num_clients - data.num_unseen)."
            )
        return self


class ConfigError(ValueError):
    """A config that does not validate; the message names each bad field and what is allowed."""


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        parts = [str(p) for p in e["loc"] if not str(p).startswith("function-after")]
        if len(parts) > 1 and parts[0] == "method" and parts[1] in METHOD_NAMES:
            del parts[1]  # the discriminator tag pydantic inserts
        loc = ".".join(parts) or "(top level)"
        if e["type"] == "union_tag_invalid":
            ctx = e.get("ctx", {})
            lines.append(f"{loc}.name: unknown method {ctx.get('tag')!r}; allowed: {ctx.get('expected_tags')}.")
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
