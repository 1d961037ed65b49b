"""Compact adaptation: privacy-aligned personalized FL with a context-conditioned generator.

The method of *Privacy-Aligned Personalized Federated Learning with Compact Adaptation and Variable-Length
Gaussian Communication*; equation numbers below are that paper's, every detail it leaves open is in docs/compact.md.

Notation:

* c~_i = (1/m_c) sum_{x in C_i} phi(x) + N(0, sigma^2 I_2s): client i's one-shot private context, cached
  by the server and reused every round and for unseen (Future) clients;
* h_i = h_psi(c~_i) in R^r, a_i = W h_i in R^k, theta_i = theta_ref + P a_i: the generated model, with P the
  fixed orthonormal coefficient basis (P^T P = I_k, applied implicitly) and omega = (W, psi) trainable;
* g~_{i,t} = (1/m_g) sum_{z in B_it} clip_C(P^T grad loss(theta_i; z)) + N(0, sigma^2 I_k): the coefficient
  gradient release (Eq. 5), realised by a codec (dense Gaussian, or exactly by LRSUQ's quantisation error);
* omega <- omega - (eta/|S_t|) sum_{i in S_t} J_i^T g~_{i,t}, J_i = d a_i / d omega (Eq. 6), computed as one
  backward pass of sum_i <a_i, stopgrad(g~_i)> / |S_t|.

Privacy: client i's RDP is alpha (Delta_c^2 + T_i Delta_g^2) / (2 sigma^2) (Eq. 7); sigma is calibrated from
the fixed schedule's T_max before training and every release is written to the ledger, whose guard refuses a
release beyond the target. Randomness (``privacy.randomness``): in ``secure`` mode (the default) each client
draws the noise of every context and dense (DG FP32, DG+Q12) release from a fresh key of its own OS entropy that
never leaves it, and a codec secret it gives the decoder in the setup reply: for the dense codecs the secret
only makes the header's check tag, for LRSUQ it is the shared randomness decoding needs (its holder learns each
block's layer, docs/privacy.md); ``simulation`` derives every key from the seed (reproducible, but the config
then determines the noise). A reply carries the (padded) encoded release alone unless ``diagnostics`` is on,
which voids the reported eps. A client checks every request against its own plan (noise scale, message size,
its scheduled rounds, one release per round) and refuses any other; a release that does not fit the fixed
message size is replaced by a fixed-size abstention.

The paper's variants are four axes of one method (:data:`COMPACT_VARIANTS`): the generator
(factorized W h_psi(c), deep-linear W V c, direct a, radial, replay), the space (coefficient subspace or full
d_theta), the context (private release or one public vector u0) and the codec of the release.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn
from torch.func import functional_call

from fedtailor.codecs import CodecError, get_codec, release_key
from fedtailor.codecs.format import abstention, fits, pad, unpad
from fedtailor.codecs.profile import public_codec_profile
from fedtailor.config import Section
from fedtailor.data.context import context_sensitivity, release_context
from fedtailor.fl.method import Method
from fedtailor.fl.records import Abstained, ClientData, InvalidMessage, Message, Metrics, RequestRefused
from fedtailor.fl.registry import register_method
from fedtailor.fl.schedule import participation_counts
from fedtailor.models.flat import FlatLayout, get_flat
from fedtailor.models.layerwise import Allocation, LayerKroneckerSubspace, model_layers
from fedtailor.models.parts import channels_last_convolutions
from fedtailor.models.subspace import SubspaceKind, make_subspace
from fedtailor.privacy.calibrate import calibrate_sigma, gradient_sensitivity
from fedtailor.privacy.dpsgd import layer_clipped_sum
from fedtailor.privacy.ledger import BudgetGuard, PrivacyLedger
from fedtailor.privacy.mechanisms import RELEASE_TAIL, clipped_mean, per_example_gradients, release_norm_bound
from fedtailor.rng import derive_key, derive_seed, fresh_key, torch_generator


class PrivacyConfig(Section):
    """Record-level central DP of the compact-adaptation releases (docs/privacy.md)."""

    epsilon: float = Field(16.0, gt=0, description="target eps; inf trains without noise (sigma = 0)")
    delta: float = Field(1e-5, gt=0, lt=1)
    conversion: Literal["closed-form", "balle", "exact"] = "closed-form"
    clip: float = Field(1.0, gt=0, description="C_g, per-record clipping norm of coefficient gradients")
    batch_size: int = Field(333, ge=1, description="m_g, records per coefficient-gradient release")
    randomness: Literal["secure", "simulation"] = Field(
        "secure",
        description="where noise and codec keys come from: 'secure' = 256-bit keys from OS entropy drawn "
        "by each client (not reproducible); 'simulation' = derived from the seed (reproducible; whoever has the "
        "config can regenerate the noise, so eps holds only while the seed is secret)",
    )
    sigma: float | None = Field(
        None,
        gt=0,
        description="fixed noise scale instead of calibrating it from epsilon; a schedule that would "
        "exceed epsilon with it is refused before anything is released",
    )


# Paper names (Table 1 and the geometry controls) -> settings of the four axes.
COMPACT_VARIANTS: dict[str, dict[str, str]] = {
    "ours-dg": {"generator": "factorized", "space": "coefficient", "context": "private", "codec": "dg-fp32"},
    "ours-lrsuq": {"generator": "factorized", "space": "coefficient", "context": "private", "codec": "lrsuq"},
    "ours-ppr": {"generator": "factorized", "space": "coefficient", "context": "private", "codec": "ppr"},
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
    "factorized-clean": {"generator": "factorized", "space": "coefficient", "context": "noiseless", "codec": "dg-fp32"},
}


class CompactConfig(Section):
    """Compact adaptation (docs/compact.md): a_i = W h_psi(c~_i), theta_i = theta_ref + P a_i. ``variant`` names one of
    the paper's variants and fills the four axes (generator, space, context, codec); explicit axes must agree."""

    name: Literal["compact"] = "compact"
    variant: Literal[tuple(COMPACT_VARIANTS)] | None = None  # type: ignore[valid-type]
    generator: Literal["factorized", "deeplin", "direct", "radial", "replay"] = "factorized"
    space: Literal["coefficient", "full"] = "coefficient"
    context: Literal["private", "public", "noiseless"] = Field(
        "private",
        description="the generator's input: each client's private context release, the one public vector u0, or "
        "(a control, eps void) each client's context mean released without noise while the gradient releases keep "
        "the private variant's sigma",
    )
    codec: Literal["dg-fp32", "dg-q12", "layered", "lrsuq", "ppr"] = "dg-fp32"
    coder: Literal["ans", "elias"] = Field(
        "ans", description="entropy coder of the layered/lrsuq codecs and of PPR's index"
    )
    block_size: int = Field(4, ge=1, le=32, description="b, block size of LRSUQ (1-8) and PPR (1-32)")
    ppr_alpha: float = Field(
        8.0, gt=1, description="PPR's alpha: the index is 2 alpha eps-DP against the decoder for an eps-DP mechanism"
    )
    ppr_spread: float = Field(
        2.5, gt=0, description="PPR's proposal N(0, sigma^2 + spread C_g^2 / k), public (docs/codecs.md)"
    )
    lattice: Literal["Z", "D4"] = Field("Z", description="LRSUQ lattice (D4 needs block_size 4)")
    model: Literal["lenet", "mlp"] = "lenet"
    coef_dim: int = Field(16_384, ge=1, description="k, dimension of the coefficient subspace")
    hidden_dim: int = Field(100, ge=1, description="r, hidden dimension of h_psi")
    lr: float = Field(0.1, gt=0, description="eta, server SGD step (0.1 MNIST, 0.2 CIFAR-10 in the paper)")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "cosine",
        description="eta_t = eta (constant) or eta (1 + cos(pi (t - 1) / R)) / 2 over the R rounds (cosine; "
        "chosen with lr 0.1 on a validation split, docs/compact.md)",
    )
    init_gain: float | None = Field(
        None, gt=0, description="rescale h_psi so that E||h||^2 = init_gain at the start (default: torch's init)"
    )
    subspace_stages: int = Field(2, ge=1, le=4)
    subspace_transform: SubspaceKind = Field(
        "layer-kronecker",
        description="how P is built and applied (docs/subspace.md): one Kronecker block per layer "
        "(coefficient gradients straight from activations and errors; the default: level with the blocked DCT "
        "over 3 seeds and about 3x faster, docs/compact.md), Kronecker factors over the whole parameter "
        "grid, or a fast DCT (any model)",
    )
    layer_allocation: Allocation = Field(
        "sqrt",
        description="with subspace_transform 'layer-kronecker': each layer's share of the k coefficients, in "
        "proportion to its size, to the square root of its size, or equal (capped at the layer's size; "
        "docs/compact.md)",
    )
    replay_from: str | None = Field(
        None, description="run directory of a 'factorized' run whose h_norm2 gains Replay uses"
    )
    padding: bool = Field(
        True,
        description="pad variable-length releases (lrsuq, layered, ppr) to one fixed length set from public inputs, "
        "so that message sizes reveal nothing about the data (off: sizes depend on ||u|| and the run's eps is void)",
    )
    pad_bytes: int | None = Field(None, ge=64, description="the padded message size (default: from public probes)")
    diagnostics: bool = Field(
        False,
        description="clients also report the realised noise norm, clip fraction, message size and coding "
        "time: each is outside the DP guarantee, so a run with diagnostics reports its eps as void",
    )
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
    def _check(self) -> CompactConfig:
        if self.codec == "lrsuq" and self.block_size > 8:
            raise ValueError(f"LRSUQ blocks hold at most 8 coefficients, got block_size={self.block_size}")
        if self.codec in ("lrsuq", "layered", "dg-q12", "ppr") and self.privacy.epsilon == float("inf"):
            raise ValueError(
                f"codec {self.codec!r} realises Gaussian noise; without noise (epsilon = inf) use dg-fp32."
            )
        if self.generator == "replay" and not self.replay_from:
            raise ValueError("generator 'replay' needs replay_from = the run directory of a 'factorized' run.")
        if self.privacy.sigma is not None and self.privacy.epsilon == float("inf"):
            raise ValueError(
                "method.privacy.sigma fixes the noise of a private run: give a finite epsilon target too "
                "(the schedule is checked against it), or drop sigma for a run without noise."
            )
        if self.space == "full" and self.codec != "dg-fp32":
            raise ValueError("the full-space variants release dense full-model gradients: use codec dg-fp32.")
        return self


log = logging.getLogger(__name__)

#: Config fields of a fit reply with diagnostics on; without them a reply carries the payload alone.
DIAGNOSTIC_FIELDS = frozenset({"perturbation_norm", "clip_fraction", "message_bytes", "encode_ms"})


class Generator(nn.Module):
    """a = G_omega(c): context -> coefficients (k) or full-space displacement (d_theta).

    ``factorized``: a = W h_psi(c) with h_psi a two-layer tanh MLP; ``deeplin``: a = W V c; ``radial``: h =
    s h_psi0(c) with psi0 frozen at its initial value and only the scalar gain s trained (the hidden direction
    never moves); ``direct``/``replay``: a is itself the trainable parameter (no context). W and a start at 0,
    so every client starts at theta_ref; the MLP has torch's default initialisation, optionally rescaled so that
    E||h||^2 = ``init_gain`` at the start. The factorized and radial maps read contexts standardised with fixed
    (non-trainable) statistics of the seen clients' releases; the deep-linear map reads the raw release (its V
    rescaled once to the factorized map's initial gain, ``CompactAdaptation.aggregate_setup``).
    """

    def __init__(
        self, *, kind: str, context_dim: int, hidden_dim: int, out_dim: int, seed: int, init_gain: float | None = None
    ) -> None:
        super().__init__()
        self.kind = kind
        self.register_buffer("c_mean", torch.zeros(context_dim))
        self.register_buffer("c_scale", torch.ones(context_dim))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "generator-init"))
            if kind in ("direct", "replay"):
                self.a = nn.Parameter(torch.zeros(out_dim))
                return
            if kind == "deeplin":
                bound = 1 / math.sqrt(context_dim)  # nn.Linear's default (Kaiming-uniform) range, no bias
                self.V = nn.Parameter(torch.empty(hidden_dim, context_dim).uniform_(-bound, bound))
            else:
                self.psi = nn.Sequential(
                    nn.Linear(context_dim, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, hidden_dim)
                )
            self.W = nn.Parameter(torch.zeros(out_dim, hidden_dim))
            if init_gain is not None:
                self._rescale(init_gain, context_dim)
        if kind == "radial":
            self.psi.requires_grad_(False)
            self.s = nn.Parameter(torch.ones(()))

    @torch.no_grad()
    def _rescale(self, gain: float, context_dim: int) -> None:
        """Scale the last map so that E ||h(z)||^2 = gain over standardised inputs z ~ N(0, I): the W-block kernel
        (h_j . h_i) I_k then starts at that scalar gain (without it: torch's default initialisation)."""
        scale = math.sqrt(gain / float(self.hidden(torch.randn(1024, context_dim)).pow(2).sum(1).mean()))
        if self.kind == "deeplin":
            self.V.mul_(scale)
        else:
            self.psi[2].weight.mul_(scale)
            self.psi[2].bias.mul_(scale)

    def hidden(self, c: torch.Tensor) -> torch.Tensor | None:
        """h(c), shape (n, r); None for the direct generators."""
        if self.kind in ("direct", "replay"):
            return None
        z = (c - self.c_mean) / self.c_scale
        if self.kind == "deeplin":
            return z @ self.V.T
        h = self.psi(z)
        return self.s * h if hasattr(self, "s") else h

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.hidden(c)
        a = self.a.expand(c.shape[0], -1) if h is None else h @ self.W.T
        return a, h


@dataclass
class CompactState:
    """Server state: generator parameters omega (+ input statistics), cached context releases, the ledger, and
    the decoder's key ring (secure mode: each client's codec secret; inside the trust boundary, never output)."""

    omega: dict[str, torch.Tensor]
    sigma: float
    ledger: PrivacyLedger
    contexts: dict[int, torch.Tensor] = field(default_factory=dict)
    codec_secrets: dict[int, int] = field(default_factory=dict)
    pad_bytes: int | None = None
    public_codec: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Decoded:
    """One accepted release of a round, decoded (the round's accumulator holds these by client)."""

    g: torch.Tensor
    reply: Message
    decode_ms: float


@dataclass
class CompactClient:
    """What a client keeps between rounds: the secret it shares with the decoder only (every release key of the
    client is ``release_key(codec_secret, client, round)``), whether it took part in the setup exchange, and the
    rounds it has released for (a round asked again would reuse its key on a new input: refused)."""

    codec_secret: int
    set_up: bool = False
    released: frozenset[int] = frozenset()


class CompactAdaptation(Method[CompactState, CompactClient]):
    name = "compact"

    def __init__(
        self,
        *,
        cfg: CompactConfig,
        model_fn: Callable[[], nn.Module],
        input_shape: tuple[int, int, int],
        schedule: np.ndarray,
        seen: list[int],
        seed: int,
        device: torch.device,
        context_size: int,
    ) -> None:
        self.cfg, self.seed, self.device = cfg, seed, device
        self.model = model_fn().to(device)  # its default init drawn from the public seed is theta_ref
        self.layout = FlatLayout.of(self.model)
        self.theta_ref = get_flat(self.model).to(device)
        self.d = self.layout.size
        self.coefficient = cfg.space == "coefficient"
        if self.coefficient and cfg.coef_dim > self.d:
            raise ValueError(f"coef_dim k={cfg.coef_dim} exceeds the model's d_theta={self.d}; choose k <= d_theta.")
        self.k = cfg.coef_dim if self.coefficient else self.d
        self.P = (
            make_subspace(
                dim=self.d,
                rank=self.k,
                seed=seed,
                transform=cfg.subspace_transform,
                stages=cfg.subspace_stages,
                model=self.model,
                device=device,
                allocation=cfg.layer_allocation,
            )
            if self.coefficient
            else None
        )
        self.context_dim = 2 * input_shape[0]
        self.m_c, self.m_g, self.clip = context_size, cfg.privacy.batch_size, cfg.privacy.clip
        # A context release at all (private or noiseless), and whether it carries noise (the noiseless control's
        # does not: it separates the context's signal from its noise and voids the run's eps).
        self.uses_context = cfg.context != "public"
        self.private_context = cfg.context == "private"
        # u0: the one public context of the geometry controls, already in standardised units.
        self.u0 = torch.randn(self.context_dim, generator=torch_generator(seed, "public-context")).to(device)
        self.generator = Generator(
            kind=cfg.generator,
            context_dim=self.context_dim,
            hidden_dim=cfg.hidden_dim,
            out_dim=self.k,
            seed=seed,
            init_gain=cfg.init_gain,
        ).to(device)
        self.omega0 = {k: v.detach().clone() for k, v in self.generator.state_dict().items()}  # public init
        # the last fit reply validate_reply decoded: (round, client, payload, g~, ms), for fold_fit of that reply
        self._checked: tuple[int, int, bytes, np.ndarray, float] | None = None
        self.codec = get_codec(cfg.codec, **_codec_options(cfg))
        self.simulation = cfg.privacy.randomness == "simulation"
        self.variable_length = cfg.codec in ("lrsuq", "layered", "ppr")
        self.schedule, self.seen = schedule, sorted(seen)
        self.replay_gains = _load_replay_gains(cfg.replay_from, len(schedule)) if cfg.generator == "replay" else None
        self.replay_ledger = _load_replay_ledger(cfg.replay_from) if cfg.generator == "replay" else None

    # ----- privacy plan ----------------------------------------------------------------------------------
    @property
    def noisy(self) -> bool:
        return math.isfinite(self.cfg.privacy.epsilon)

    def _sensitivities(self) -> tuple[float, float]:
        # The noiseless control calibrates sigma as the private variant does, so that only the context's noise differs.
        dc = context_sensitivity(self.m_c) if self.uses_context else 0.0
        return dc, gradient_sensitivity(batch_size=self.m_g, clip=self.clip)

    def _guard(self, ledger: PrivacyLedger) -> BudgetGuard:
        return BudgetGuard(ledger, target_eps=self.cfg.privacy.epsilon)

    def init_server(self) -> CompactState:
        return self._plan(announce=True)

    def _plan(self, *, announce: bool) -> CompactState:
        """The initial state: sigma calibrated from the fixed schedule (the whole plan checked by the guard), the
        public codec profile and the fixed message size; ``announce`` logs the calibration."""
        p = self.cfg.privacy
        ledger = PrivacyLedger(delta=p.delta, conversion=p.conversion)
        state = CompactState(omega={k: v.clone() for k, v in self.omega0.items()}, sigma=0.0, ledger=ledger)
        if self.noisy:
            counts = participation_counts(self.schedule, max(self.seen) + 1)
            dc, dg = self._sensitivities()
            sigma = p.sigma or calibrate_sigma(
                eps=p.epsilon,
                delta=p.delta,
                t_max=int(counts.max()),
                context_sensitivity=dc,
                gradient_sensitivity=dg,
                conversion=p.conversion,
            )
            plan = {c: ([(dc, sigma)] if dc else []) + [(dg, sigma)] * int(counts[c]) for c in self.seen}
            self._guard(ledger).check_plan(plan)  # refused before anything is released
            if announce:
                log.info("sigma=%.6g for eps=%g (T_max=%d, %s)", sigma, p.epsilon, counts.max(), p.conversion)
            state.sigma = sigma
            state.public_codec = public_codec_profile(self.codec, k=self.k, sigma=sigma, clip=self.clip, seed=self.seed)
            probe_pad = int(state.public_codec.pop("pad_bytes"))
            if self.variable_length and self.cfg.padding:
                state.pad_bytes = self.cfg.pad_bytes or probe_pad
        return state

    # ----- one-shot context release (setup phase) ------------------------------------------------------------
    def configure_setup(self, server: CompactState, cid: int) -> Message | None:
        """The one-shot exchange: the private context release (if the variant uses contexts) and, in secure mode,
        the client's codec secret for the decoder."""
        if not self.uses_context and self.simulation:
            return None
        if self.noisy and self.private_context:  # refused here if over budget; recorded when it arrives
            self._guard(server.ledger).check_release(
                client=cid, round=0, sensitivity=context_sensitivity(self.m_c), sigma=server.sigma, mechanism="context"
            )
        return Message(config={"sigma": server.sigma, "context": self.uses_context})

    def _simulation_secret(self, cid: int) -> int:
        return derive_key(self.seed, "release-secret", cid)

    def client_setup(
        self, msg: Message, state: CompactClient | None, data: ClientData
    ) -> tuple[Message, CompactClient]:
        if state is not None and state.set_up:
            raise RequestRefused(f"client {data.cid} already made its one-shot setup release; a second is refused.")
        if msg.config.get("context") and self.noisy and self.private_context:
            self._check_sigma(msg, data.cid)
        if self.simulation:
            secret, noise_key = self._simulation_secret(data.cid), derive_key(self.seed, "context-noise", data.cid)
        else:  # secret local entropy: nothing the server or the config knows determines this client's noise
            secret, noise_key = fresh_key(), fresh_key()
        reply = Message()
        if msg.config.get("context"):
            # the client's own config decides whether its context carries noise: no request can remove it
            sigma = float(msg.config["sigma"]) if self.private_context else 0.0
            secure = not self.simulation
            reply.arrays["context"] = release_context(data.context, sigma=sigma, key=noise_key, secure=secure)
        if not self.simulation:  # to the decoder only, over the authenticated channel (docs/privacy.md)
            reply.config["codec_secret"] = secret.to_bytes(32, "little")
        return reply, CompactClient(codec_secret=secret, set_up=True)

    # ----- the client's own plan: what it accepts to release ---------------------------------------------------
    @functools.cached_property
    def client_plan(self) -> CompactState:
        """What this client's own config calibrates (sigma, the fixed message size): it refuses a request below it."""
        return self._plan(announce=False)

    def _check_sigma(self, msg: Message, cid: int) -> float:
        sigma, want = msg.config.get("sigma"), self.client_plan.sigma
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma >= want:
            raise RequestRefused(
                f"client {cid} was asked for a release with sigma {sigma!r}, below its own "
                f"calibration {want:.6g}; refused."
            )
        return float(sigma)

    def _check_request(self, msg: Message, state: CompactClient, cid: int) -> tuple[int, float]:
        """(round, sigma) of a fit request this client accepts: a round it is scheduled in and has not released
        for, a sigma not below its own calibration, and exactly its own fixed message size."""
        rnd = msg.config.get("round")
        if isinstance(rnd, bool) or not isinstance(rnd, int) or not 1 <= rnd <= len(self.schedule):
            raise RequestRefused(f"client {cid} was asked for a release in round {rnd!r}, outside the schedule.")
        if cid not in {int(c) for c in self.schedule[rnd - 1]}:
            raise RequestRefused(f"client {cid} is not scheduled in round {rnd}; the release is refused.")
        if rnd in state.released:
            raise RequestRefused(f"client {cid} has already released for round {rnd} (its key would be reused).")
        sigma = self._check_sigma(msg, cid) if self.noisy else float(msg.config.get("sigma", 0.0))
        if msg.config.get("pad_bytes") != self.client_plan.pad_bytes:
            raise RequestRefused(
                f"client {cid} was asked for messages of {msg.config.get('pad_bytes')!r} bytes; its "
                f"own fixed size is {self.client_plan.pad_bytes!r}. Refused."
            )
        return rnd, sigma

    def deployment_risks(self) -> dict[str, str]:
        risks = {}
        if self.simulation:
            risks["simulation-randomness"] = (
                "method.privacy.randomness is 'simulation': every noise draw follows from the public seed"
            )
        if self.uses_context and not self.private_context:
            risks["noiseless-context"] = "method.context is 'noiseless': each context mean leaves without noise"
        if self.cfg.diagnostics:
            risks["diagnostics"] = "method.diagnostics is on: replies carry functions of the unprotected input"
        if self.variable_length and not self.cfg.padding:
            risks["unpadded"] = "method.padding is off: every message's size depends on the input"
        return risks

    def _decoder_secret(self, server: CompactState, cid: int) -> int:
        if self.simulation:
            return self._simulation_secret(cid)
        if cid not in server.codec_secrets:
            raise InvalidMessage(
                f"client {cid} gave no codec secret in the setup phase; its releases cannot be decoded."
            )
        return server.codec_secrets[cid]

    def aggregate_setup(self, server: CompactState, replies: dict[int, Message]) -> CompactState:
        """A new state with the key ring, the cached contexts and the generator's input statistics."""
        server = dataclasses.replace(
            server,
            omega=dict(server.omega),
            codec_secrets={
                cid: int.from_bytes(r.config["codec_secret"], "little")
                for cid, r in replies.items()
                if "codec_secret" in r.config
            },
        )
        if not self.uses_context:
            return server
        server.contexts = {cid: r.arrays["context"].to(self.device).float() for cid, r in replies.items()}
        seen = [server.contexts[c] for c in self.seen if c in server.contexts]
        if len(seen) < 2:
            return server
        stacked = torch.stack(seen)  # statistics of seen clients' releases only (post-processing of DP outputs)
        z = (stacked - stacked.mean(0)) / stacked.std(0).clamp_min(1e-6)
        if self.cfg.generator == "deeplin":
            # The paper's a = W V c~ on the raw release. Centred inputs would make the mean over seen clients of
            # a_i = W V z_i zero for every (W, V), so the shared part of the model could never be learned. The
            # scale of V is set so that the initial kernel gain mean_i ||h_i||^2 equals the factorized
            # generator's on the same contexts (or init_gain), which makes the two comparable at one step size.
            gain = self.cfg.init_gain or _factorized_gain(self.seed, self.context_dim, self.cfg.hidden_dim, z)
            v = server.omega["V"]
            server.omega["V"] = v * math.sqrt(gain / float((stacked @ v.T).pow(2).sum(1).mean()))
        else:
            server.omega["c_mean"] = stacked.mean(0)
            server.omega["c_scale"] = stacked.std(0).clamp_min(1e-6)
        return server

    # ----- generator ------------------------------------------------------------------------------------
    def _context(self, server: CompactState, cid: int) -> torch.Tensor:
        if not self.uses_context:
            return self.u0
        if cid not in server.contexts:
            raise KeyError(f"client {cid} has no cached context release; it must take part in the setup phase.")
        return server.contexts[cid]

    def coefficients(
        self, server: CompactState, cids: list[int], *, trainable: dict[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(a_i, h_i) for the clients ``cids`` under omega (``server.omega``, with ``trainable`` in place of its
        entries of those names), with autograd enabled. The generator module only supplies the function: omega
        is never copied into it."""
        c = torch.stack([self._context(server, cid) for cid in cids])
        return functional_call(self.generator, {**server.omega, **(trainable or {})}, (c,))

    def _model_message(self, server: CompactState, cid: int, config: dict[str, Any]) -> Message:
        with torch.no_grad():
            a, _ = self.coefficients(server, [cid])
        return Message(arrays={"a": a[0].clone()}, config=config)  # a copy: never a view of the generator

    def theta(self, a: torch.Tensor) -> torch.Tensor:
        """theta_i = theta_ref + P a_i (coefficient space) or theta_ref + a_i (full space)."""
        a = a.to(self.device)
        return self.theta_ref + (self.P.expand(a) if self.coefficient else a)

    # ----- training round ------------------------------------------------------------------------------
    def configure_fit(self, server: CompactState, rnd: int, cid: int) -> Message:
        if self.noisy:  # refused here if over budget; recorded when the release arrives (validate_reply)
            self._guard(server.ledger).check_release(
                client=cid,
                round=rnd,
                sensitivity=self._sensitivities()[1],
                sigma=server.sigma,
                mechanism=f"coef-gradient/{self.codec.name}",
            )
        config: dict[str, Any] = {"round": rnd, "sigma": server.sigma}
        if server.pad_bytes is not None:
            config["pad_bytes"] = server.pad_bytes
        return self._model_message(server, cid, config)

    def init_client(self, cid: int) -> CompactClient | None:
        # in simulation a client that skipped the setup exchange (public-context controls) still has its secret
        return CompactClient(codec_secret=self._simulation_secret(cid)) if self.simulation else None

    def batch_indices(self, rnd: int, cid: int, x: torch.Tensor) -> torch.Tensor:
        """B_it: m_g of the client's training records drawn without replacement (key (seed, "batch", t, i)). The
        guarantee does not rest on this choice being secret (no amplification by sampling is claimed)."""
        gen = torch_generator(self.seed, "batch", rnd, cid, device=x.device)
        return torch.randperm(len(x), generator=gen, device=x.device)[: self.m_g]

    def record_gradients(self, x: torch.Tensor, y: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """Each record's gradient at ``theta``: ``P^T grad_theta l`` (m_g, k) in coefficient space (for a layer-wise
        P straight from activations and errors, never building the (m_g, d) parameter gradients), else (m_g, d)."""
        params = self.layout.unflatten(theta)
        if isinstance(self.P, LayerKroneckerSubspace):
            return self.P.per_record_coefficients(self.model, F.cross_entropy, x, y, params=params)
        grads = per_example_gradients(self.model, F.cross_entropy, x, y, params=params)
        return self.P.project(grads) if self.coefficient else grads

    @functools.cached_property
    def _batched_full_space(self) -> bool:
        """Full space and a model of Linear and Conv2d layers only: the clipped sum from one batched pass."""
        try:
            model_layers(self.model)
        except ValueError:  # per-record autograd instead
            return False
        return not self.coefficient

    def release_input(self, a: torch.Tensor, rnd: int, data: ClientData) -> tuple[torch.Tensor | None, np.ndarray]:
        """(per-record coefficient gradients, the clipped mean u in float64) of client ``data.cid`` in round
        ``rnd`` at coefficients ``a``: the input of the release ``u + N(0, sigma^2 I_k)``. In the full space
        without diagnostics the per-record gradients are never formed (None): the clipped sum comes from one
        batched pass (:func:`fedtailor.privacy.dpsgd.layer_clipped_sum`, ghost clipping), the same u up to
        float rounding at about a third of the time."""
        x, y = data.train
        if len(x) < self.m_g:
            raise ValueError(f"client {data.cid} has {len(x)} training records, fewer than m_g={self.m_g}.")
        idx = self.batch_indices(rnd, data.cid, x)
        theta = self.theta(a)
        if self._batched_full_space and not self.cfg.diagnostics:
            params = self.layout.unflatten(theta)
            sums, _ = layer_clipped_sum(self.model, params, list(params), x[idx], y[idx], clip=self.clip)
            return None, (self.layout.flatten(sums) / self.m_g).detach().double().cpu().numpy()
        grads = self.record_gradients(x[idx], y[idx], theta)
        u = clipped_mean(grads, clip=self.clip, denominator=self.m_g)
        return grads, u.detach().double().cpu().numpy()

    def client_fit(self, msg: Message, state: CompactClient | None, data: ClientData) -> tuple[Message, CompactClient]:
        state = state or self.init_client(data.cid)
        if state is None:
            raise ValueError(f"client {data.cid} has no codec secret: it must take part in the setup phase first.")
        rnd, sigma = self._check_request(msg, state, data.cid)
        grads, u_np = self.release_input(msg.arrays["a"], rnd, data)
        key = release_key(state.codec_secret, data.cid, rnd)
        # the dense codecs' noise: a fresh key that never leaves this client (simulation: from the release key)
        noise_key = None if self.simulation else fresh_key()
        t0 = time.perf_counter()
        message = self.codec.encode(u_np, key=key, sigma=sigma, noise_key=noise_key)
        encode_ms = 1e3 * (time.perf_counter() - t0)
        size = self.client_plan.pad_bytes
        # a release too long for the fixed size is replaced by an abstention of that size: nothing raises with
        # (or logs) the true length, and the reply looks like any other
        payload = message if size is None else pad(message, size=size) if fits(message, size=size) else abstention(size)
        config: dict[str, Any] = {"payload": payload}
        if self.cfg.diagnostics and grads is not None:  # outside the DP guarantee: functions of the unprotected u
            decoded = self.codec.decode(message, key=key, sigma=sigma, dim=len(u_np))
            config["perturbation_norm"] = float(np.linalg.norm(decoded - u_np))
            config["clip_fraction"] = float((torch.linalg.vector_norm(grads, dim=1) > self.clip).float().mean())
            config["message_bytes"] = len(message)
            config["encode_ms"] = encode_ms
        return Message(config=config), CompactClient(
            codec_secret=state.codec_secret, set_up=state.set_up, released=state.released | {rnd}
        )

    def _record_arrival(self, server: CompactState, phase: str, rnd: int, cid: int) -> None:
        """The ledger counts every release that reached the server (even one rejected below: it left the client)
        and none that did not (a client lost before answering released nothing)."""
        if phase == "fit" and not (1 <= rnd <= len(self.schedule) and cid in {int(c) for c in self.schedule[rnd - 1]}):
            raise InvalidMessage(f"client {cid} was not asked for a release in round {rnd}.")
        if not self.noisy or (phase == "setup" and not self.private_context):
            return
        if phase == "setup":
            sens, mechanism = context_sensitivity(self.m_c), "context"
        else:
            sens, mechanism = self._sensitivities()[1], f"coef-gradient/{self.codec.name}"
        if not server.ledger.recorded(client=cid, round=rnd, mechanism=mechanism):  # one release per request
            self._guard(server.ledger).record(
                client=cid, round=rnd, sensitivity=sens, sigma=server.sigma, mechanism=mechanism
            )

    def validate_reply(self, server: CompactState, phase: str, rnd: int, cid: int, reply: Message) -> None:
        self._record_arrival(server, phase, rnd, cid)
        if phase == "setup":
            reply.only(
                arrays={"context"} if self.uses_context else set(),
                config=set() if self.simulation else {"codec_secret"},
            )
            if self.uses_context:
                c = reply.array("context", shape=(self.context_dim,), dtype=torch.float32)
                bound = release_norm_bound(1.0, server.sigma if self.private_context else 0.0, self.context_dim)
                if float(torch.linalg.vector_norm(c.double())) > bound:
                    raise InvalidMessage(
                        f"context release of client {cid} has a norm no bounded context plus noise "
                        f"reaches (> {bound:.4g})."
                    )
            if not self.simulation:
                secret = reply.value("codec_secret", bytes)
                if len(secret) != 32:
                    raise InvalidMessage(f"codec secret of client {cid} has {len(secret)} bytes, expected 32.")
            return
        t0 = time.perf_counter()
        g = self.decode(server, rnd, cid, reply)
        self._checked = (rnd, cid, reply.config["payload"], g, 1e3 * (time.perf_counter() - t0))

    def decode(self, server: CompactState, rnd: int, cid: int, reply: Message) -> np.ndarray:
        """The release ``g~`` a fit reply carries (float64, length k), after every check: only the payload (and
        the diagnostics when on), a padded message of the fixed size, decodable with the client's key, finite,
        and of a norm that a clipped input plus noise reaches (:func:`release_norm_bound`). Raises
        InvalidMessage, or :class:`~fedtailor.fl.records.Abstained` for a fixed-size abstention."""
        reply.only(config={"payload"} | (DIAGNOSTIC_FIELDS if self.cfg.diagnostics else set()))
        for name in DIAGNOSTIC_FIELDS & set(reply.config):
            reply.value(name, (int, float))
        payload = reply.value("payload", bytes)
        try:
            if server.pad_bytes is not None:
                payload = unpad(payload, size=server.pad_bytes)
                if not payload:
                    raise Abstained(f"client {cid} abstained in round {rnd} (its release did not fit the fixed size).")
            g = self.codec.decode(
                payload, key=release_key(self._decoder_secret(server, cid), cid, rnd), sigma=server.sigma, dim=self.k
            )
        except CodecError as err:
            raise InvalidMessage(f"undecodable release: {err}") from err
        if not np.all(np.isfinite(g)):
            raise InvalidMessage("decoded release contains non-finite values.")
        bound = release_norm_bound(self.clip, server.sigma, self.k, slack=_quantisation_slack(self.codec.name, g))
        if float(np.linalg.norm(g)) > bound:
            raise InvalidMessage(
                f"decoded release of client {cid} has norm {float(np.linalg.norm(g)):.4g}, which no "
                f"clipped input plus noise reaches (> {bound:.4g} at tail {RELEASE_TAIL:g})."
            )
        return g

    def step_size(self, rnd: int) -> float:
        """eta_t of round ``rnd`` (1-based) under ``lr_schedule``."""
        if self.cfg.lr_schedule == "cosine":
            return self.cfg.lr * 0.5 * (1.0 + math.cos(math.pi * (rnd - 1) / len(self.schedule)))
        return self.cfg.lr

    def fold_fit(
        self, server: CompactState, rnd: int, acc: dict[int, _Decoded] | None, cid: int, reply: Message
    ) -> dict[int, _Decoded]:
        """The round's accepted releases so far, with this one decoded (once: the release validate_reply just
        decoded is taken from it when it is this very payload)."""
        checked, self._checked = self._checked, None
        if checked is not None and checked[:2] == (rnd, cid) and checked[2] is reply.config.get("payload"):
            g_np, ms = checked[3], checked[4]
        else:
            t0 = time.perf_counter()
            g_np = self.decode(server, rnd, cid, reply)
            ms = 1e3 * (time.perf_counter() - t0)
        g = torch.as_tensor(g_np, dtype=torch.float32, device=self.device)
        return {**(acc or {}), cid: _Decoded(g=g, reply=reply, decode_ms=ms)}

    def aggregate_fit(
        self, server: CompactState, rnd: int, replies: dict[int, Message]
    ) -> tuple[CompactState, Metrics]:
        acc = None
        for cid in sorted(replies):
            acc = self.fold_fit(server, rnd, acc, cid, replies[cid])
        return self.finish_fit(server, rnd, acc)

    def finish_fit(self, server: CompactState, rnd: int, acc: dict[int, _Decoded]) -> tuple[CompactState, Metrics]:
        """omega <- omega - eta_t sum_i J_i^T g~_i / |S_t| (Eq. 6) from the round's decoded releases: a new state."""
        cids = sorted(acc)
        g = torch.stack([acc[c].g for c in cids])
        names = [n for n, p in self.generator.named_parameters() if p.requires_grad]
        trainable = {n: server.omega[n].detach().requires_grad_(True) for n in names}
        a, h = self.coefficients(server, cids, trainable=trainable)
        # sum_i J_i^T g~_i / |S_t| as the gradient of sum_i <a_i, stopgrad(g~_i)> / |S_t| (Eq. 6)
        grads = torch.autograd.grad((a * g).sum() / len(cids), list(trainable.values()))
        gain = 1.0 if self.replay_gains is None else self.replay_gains[rnd - 1]
        step = self.step_size(rnd) * gain
        with torch.no_grad():  # new tensors for the trained entries; the others are shared with the old state
            omega = {**server.omega, **{n: server.omega[n] - step * dp for n, dp in zip(names, grads)}}
        replies = {c: acc[c].reply for c in cids}
        nbytes = [len(replies[c].config["payload"]) for c in cids]  # fixed when padded
        metrics: Metrics = {
            "uplink_payload_bytes": float(sum(nbytes)),
            "bits_per_coefficient": 8.0 * float(np.mean(nbytes)) / self.k,
            "update_norm": float(torch.linalg.vector_norm(g, dim=1).mean()),  # of the DP releases: post-processing
        }
        if h is not None:
            metrics["h_norm2"] = float((h.detach() ** 2).sum(1).mean())
        if self.replay_gains is not None:
            metrics["replay_gain"] = gain
        if self.cfg.diagnostics:
            metrics["decode_ms"] = float(np.mean([acc[c].decode_ms for c in cids]))
        for key in sorted(DIAGNOSTIC_FIELDS if self.cfg.diagnostics else ()):
            vals = [float(replies[c].config[key]) for c in cids if key in replies[c].config]
            if vals:
                metrics[key] = float(np.mean(vals))
        return dataclasses.replace(server, omega=omega), metrics

    # ----- evaluation -------------------------------------------------------------------------------------
    def configure_evaluate(self, server: CompactState, cid: int) -> Message:
        return self._model_message(server, cid, {})

    @torch.no_grad()
    def client_evaluate(self, msg: Message, state: None, data: ClientData) -> Metrics:
        x, y = data.eval
        params = self.layout.unflatten(self.theta(msg.arrays["a"]))
        correct, loss = 0, 0.0
        with channels_last_convolutions(self.model):
            for start in range(0, len(x), 2048):
                logits = functional_call(self.model, params, (x[start : start + 2048],))
                correct += int((logits.argmax(1) == y[start : start + 2048]).sum())
                loss += float(F.cross_entropy(logits, y[start : start + 2048], reduction="sum"))
        return {"accuracy": correct / len(x), "loss": loss / len(x), "num_examples": float(len(x))}

    # ----- run summary ------------------------------------------------------------------------------------
    def privacy_status(self) -> tuple[str, list[str]]:
        """(randomness mode, reasons why the reported eps does not cover this run's outputs; empty if it does).

        Evaluation metrics (accuracy and loss on the clients' own records) are outside the guarantee in every run
        and are documented as such; they are not listed here."""
        void = []
        if not self.noisy:
            void.append("no noise (epsilon = inf)")
        elif self.uses_context and not self.private_context:
            void.append("the context is released without noise (the noiseless-context control)")
        if self.replay_ledger is not None and not self.replay_ledger.releases:
            void.append(f"the Factorized run whose gains Replay reads ({self.cfg.replay_from}) had no noise")
        if self.cfg.diagnostics:
            void.append(
                "diagnostics on: the noise norm, clip fraction, message sizes and coding times are functions "
                "of the unprotected clipped mean"
            )
        if self.variable_length and not self.cfg.padding:
            void.append("padding off: the size of every LRSUQ message depends on ||u|| and is in the metrics")
        mode = (
            "simulation (noise and codec keys derived from the config seed: whoever has the config can "
            "regenerate the noise, so eps holds only while the seed is secret)"
            if self.simulation
            else "secure (256-bit keys from each client's OS entropy)"
        )
        return mode, void

    def holds_against(self) -> str:
        """Whom the reported eps covers, given the randomness and the codec (docs/privacy.md, "What a key holder
        learns")."""
        if self.simulation:
            return "whoever does not know the config's seed"
        if self.codec.private_noise:
            return "the server (key ring, state, checkpoints, logs) and every output"
        return (
            "every output and observer without the clients' codec secrets; not the decoder, whose key ring "
            f"holds the shared randomness of {self.codec.name}"
        )

    def summary(self, server: CompactState) -> dict[str, Any]:
        ledger = server.ledger
        eps = ledger.epsilons() if self.noisy else {}
        if self.replay_ledger is not None and not self.replay_ledger.releases:
            eps = {}  # its outputs depend on a run without noise: no DP guarantee
        elif self.replay_ledger is not None:  # Replay's outputs also depend on the Factorized run it reads
            imported = {
                c: [(r.sensitivity, r.sigma) for r in self.replay_ledger.releases if r.client == c]
                for c in self.replay_ledger.clients
            }
            eps = {c: ledger.epsilon_with(c, imported.get(c, [])) for c in sorted(set(eps) | set(imported))}
        counts = participation_counts(self.schedule, max(self.seen) + 1)
        mode, void = self.privacy_status()
        return {
            "variant": self.cfg.variant or "custom",
            "generator": self.cfg.generator,
            "space": self.cfg.space,
            "context": self.cfg.context,
            "codec": self.codec.name,
            "k": self.k,
            "d_theta": self.d,
            "sigma": server.sigma,
            "T_max": int(counts[self.seen].max()),
            "epsilon_target": self.cfg.privacy.epsilon,
            "epsilon_max": max(eps.values()) if eps else float("inf"),  # no noise: no DP guarantee
            "epsilon_conversion": self.cfg.privacy.conversion,
            "delta": self.cfg.privacy.delta,
            "epsilon_per_client": {str(c): e for c, e in sorted(eps.items())},
            "epsilon_includes": "this run" if self.replay_ledger is None else f"this run and {self.cfg.replay_from}",
            "randomness": mode,
            "epsilon_holds_against": self.holds_against(),
            "epsilon_void": bool(void),
            "epsilon_void_reasons": void,
            "releases": len(ledger.releases),
            "message_bytes_fixed": server.pad_bytes,
            **{f"public_{k}": v for k, v in server.public_codec.items()},
        }

    def artifacts(self, server: CompactState) -> dict[str, str]:
        return {"privacy_ledger.json": server.ledger.to_json()}


def _quantisation_slack(codec: str, g: np.ndarray) -> float:
    """DG+Q12's rounding on top of the Gaussian: at most half a step of (max - min) / 4095 per coordinate."""
    return math.sqrt(g.size) * float(g.max() - g.min()) / (2 * 4095) if codec == "dg-q12" else 0.0


def _factorized_gain(seed: int, context_dim: int, hidden_dim: int, z: torch.Tensor) -> float:
    """mean_i ||h_psi(z_i)||^2 of the factorized generator's public initialisation on standardised contexts z."""
    ref = Generator(kind="factorized", context_dim=context_dim, hidden_dim=hidden_dim, out_dim=1, seed=seed).to(
        z.device
    )
    with torch.no_grad():
        return float(ref.hidden(z).pow(2).sum(1).mean())


def _codec_options(cfg: CompactConfig) -> dict[str, Any]:
    if cfg.codec == "lrsuq":
        return {"coder": cfg.coder, "block_size": cfg.block_size, "lattice": cfg.lattice}
    if cfg.codec == "ppr":  # the proposal is built for the clipped mean's bound ||u|| <= C_g
        return {
            "block_size": cfg.block_size,
            "alpha": cfg.ppr_alpha,
            "clip": cfg.privacy.clip,
            "spread": cfg.ppr_spread,
            "coder": cfg.coder,
        }
    return {"coder": cfg.coder} if cfg.codec == "layered" else {}


def _load_replay_ledger(run_dir: str | None) -> PrivacyLedger | None:
    """The privacy ledger of the Factorized run whose gains Replay reads (no releases if that run had no noise)."""
    path = Path(str(run_dir)) / "privacy_ledger.json"
    if not path.exists():
        raise FileNotFoundError(
            f"replay_from: {path} not found; Replay's eps must include the run whose gains it "
            "reads, so pass the directory of a finished 'factorized' run."
        )
    return PrivacyLedger.from_json(path.read_text())


def _load_replay_gains(run_dir: str | None, rounds: int) -> list[float]:
    """gamma_t = ||h_t||^2 per round, recorded by a 'factorized' run (its metrics.jsonl)."""
    path = Path(str(run_dir)) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(
            f"replay_from: {path} not found; run a 'factorized' variant first and pass its run directory."
        )
    gains = [json.loads(line).get("h_norm2") for line in path.read_text().splitlines() if line.strip()]
    if len(gains) < rounds or any(g is None for g in gains[:rounds]):
        raise ValueError(
            f"replay_from: {path} has h_norm2 for {sum(g is not None for g in gains)} rounds, need {rounds}; "
            "use a finished 'factorized' run with the same number of rounds."
        )
    return [float(g) for g in gains[:rounds]]


def build_compact(setup: Any) -> CompactAdaptation:
    """Compact adaptation on an image setup (:class:`fedtailor.data.setup.ImageSetup`)."""
    m = setup.cfg.method
    return CompactAdaptation(
        cfg=m,
        model_fn=setup.model_fn(m.model),
        input_shape=setup.dataset.input_shape,
        schedule=setup.schedule,
        seen=list(setup.partition.seen),
        seed=setup.cfg.seed,
        device=setup.device,
        context_size=setup.cfg.data.context_size,
    )


register_method("compact", config=CompactConfig, build=build_compact, family="compact", data="images")
