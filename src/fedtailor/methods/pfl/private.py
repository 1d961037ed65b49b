"""Client-level differential privacy with each client's own noise, as one wrapper around any parameter-sharing
method of :mod:`fedtailor.methods.pfl.local` (and under FedLAG), in the shape of Flower's
``DifferentialPrivacyClientSideFixedClipping``: the base runs unchanged, the wrapper changes what leaves a client
and how the server folds it in.

The mechanism (*Learning Differentially Private Recurrent Language Models*, McMahan, Ramage, Talwar, Zhang 2018,
arXiv:1710.06963, with the noise moved from the server to each client). Client ``i`` in round ``t`` holds the
shared values ``theta_g[S]`` it received and its values ``theta_i[S]`` after the base's local program. It
releases

    r_i = clip_C(theta_i[S] - theta_g[S]) + N(0, sigma^2 I),    clip_C(v) = v min{1, C / ||v||_2},

the noise drawn from a key only the client holds (``randomness = "secure"``: 256 bits of its OS entropy; nothing
the server, the config or another client has determines it), and sends ``theta_g[S] + r_i`` in float32, nothing
else: no record count, no training loss. The server's new shared values are ``theta_g[S] + (1/n) sum_i r_i`` over
the ``n`` replies it accepted (unweighted: a weight by record count would itself be released).

Privacy. Any change of client ``i``'s records, one record or all of them, moves ``clip_C(...)`` within the ball of
radius ``C``, so each release is a Gaussian mechanism of L2 sensitivity ``2 C`` (replace adjacency) for the
client's records and for the client as a whole. The ledger records every release that reaches the server
(``(client, round, 2C, sigma)``) and composes them per client (RDP; :mod:`fedtailor.privacy.accountant`); the
guard refuses, before a run starts, a schedule under which a client would pass the target, and every request
that would. The guarantee holds against the server itself (it sees each release, so no amplification by
client sampling is claimed) and against everything it stores, logs or checkpoints. Personal parameters (a
FedPer head, Ditto's personal model) never leave the client; they shape later releases, which the clip bounds
whatever they are. Evaluation metrics (accuracy and loss on a client's own records) are outside the guarantee,
as in every run (docs/privacy.md).

Hostile replies: a reply with other names, shapes or fields, a non-finite value or a release longer than
honest noise reaches (:func:`~fedtailor.privacy.mechanisms.release_norm_bound`) is rejected with the server state
unchanged; an accepted one moves the mean by at most that bound over ``n``.
"""

from __future__ import annotations

import dataclasses
import math
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedtailor.codecs import CodecError, get_codec
from fedtailor.codecs.format import abstention, fits, pad, unpad
from fedtailor.codecs.profile import public_codec_profile
from fedtailor.fl.method import Method
from fedtailor.fl.records import Abstained, ClientData, InvalidMessage, Message, Metrics, RequestRefused
from fedtailor.fl.schedule import participation_counts
from fedtailor.methods.pfl.local import (
    ClientDPConfig,
    DPConfig,
    LocalTraining,
    PersonalState,
    RecordDPConfig,
    ServerDPConfig,
    SharedState,
)
from fedtailor.privacy.calibrate import calibrate_sigma
from fedtailor.privacy.dpsgd import PrivateSGD, ReleaseFn, sampling_rate, steps_per_epoch
from fedtailor.privacy.ledger import BudgetGuard, PrivacyLedger
from fedtailor.privacy.mechanisms import release_norm_bound, unflatten_like
from fedtailor.privacy.noise import secure_gaussian_noise
from fedtailor.rng import derive_key, fresh_key

MECHANISM = "client-update"
RECORD_MECHANISM = "dp-sgd"
SERVER_MECHANISM = "server-aggregate"


@dataclass
class PrivateState(SharedState):
    """The base's server state, the privacy ledger of the releases that reached the server and, under adaptive
    clipping, the clip of the next round."""

    ledger: PrivacyLedger | None = None
    clip: float | None = None


class _PrivateRelease(Method[PrivateState, PersonalState]):
    """What the two DP wrappers share: the base's API for FedLAG, the ledger (a release is counted when it
    reaches the server, refused before it is asked for when it would pass the budget), replies that carry the
    shared values alone (no record count, no loss) within a norm bound, and the unweighted mean."""

    mechanism: str
    sigma: float
    codec_label: str = ""  # the key derivation label of this wrapper's codec releases (simulation)

    def __init__(self, base: LocalTraining, cfg: DPConfig, *, seed: int = 0, codec: str = "fp32") -> None:
        if base.update_bound is not None:
            raise ValueError("method.update_bound with DP: the DP clip already bounds every update; drop update_bound.")
        self.base, self.name, self.seed = base, base.name, seed
        self.epsilon, self.delta, self.conversion = cfg.epsilon, cfg.delta, cfg.conversion
        self.simulation = cfg.randomness == "simulation"
        self.clip = cfg.clip
        # LRSUQ or PPR realise a release u + N(0, sigma^2 I) with ||u|| <= C exactly (PPR's proposal is built for C)
        self.codec = get_codec("lrsuq", coder="ans", block_size=4, lattice="Z") if codec == "lrsuq" else None
        self.codec = get_codec("ppr", clip=cfg.clip) if codec == "ppr" else self.codec
        self._pad: dict[tuple[int, float], int] = {}

    # the parameter-sharing API a wrapper such as FedLAG reads (WRAPPER_API), the base's own
    def __getattr__(self, name: str) -> Any:
        if name in {"rounds", "batch_size", "model", "names", "shapes", "own_personal", "start_model", "logits"}:
            return getattr(self.base, name)
        raise AttributeError(name)

    @property
    def noisy(self) -> bool:
        return math.isfinite(self.epsilon)

    def _guard(self, ledger: PrivacyLedger) -> BudgetGuard:
        return BudgetGuard(ledger, target_eps=self.epsilon)

    @abstractmethod
    def release_terms(self, cid: int) -> dict[str, Any]:
        """``sensitivity``, ``sigma`` (and ``sampling_rate``, ``steps``) of client ``cid``'s release in a round."""

    @abstractmethod
    def plan(self) -> dict[int, int]:
        """Planned releases per client (its rounds in the schedule)."""

    @abstractmethod
    def release_bound(self, cid: int, dim: int) -> float:
        """The norm an honest release of ``dim`` shared values stays within, but with probability ~1e-12."""

    # ----- the codec uplink (LRSUQ / PPR) --------------------------------------------------------------------
    def pad_bytes(self, dim: int, sigma: float) -> int:
        """The fixed LRSUQ/PPR message size for ``dim`` values at ``sigma``, from public probes only (the same on
        both sides: the seed, sigma, C and ``dim``); measured once per ``(dim, sigma)``."""
        if (dim, sigma) not in self._pad:
            profile = public_codec_profile(self.codec, k=dim, sigma=sigma, clip=self.clip, seed=self.seed)
            self._pad[dim, sigma] = int(profile["pad_bytes"])
        return self._pad[dim, sigma]

    def _encode(self, u: np.ndarray, cid: int, rnd: int, sigma: float) -> tuple[Message, bytes, int]:
        """The LRSUQ/PPR release of ``u`` (``||u|| <= C``) at ``sigma``, padded to the fixed size (an abstention of
        that size if it would not fit), the unpadded message and its release key; in secure mode with that fresh key
        for the decoder (and, for PPR, the search's private randomness from another fresh key that never leaves the
        client)."""
        key = derive_key(self.seed, self.codec_label, rnd, cid) if self.simulation else fresh_key()
        noise_key = None if self.simulation else fresh_key()
        message = self.codec.encode(u, key=key, sigma=sigma, noise_key=noise_key)
        size = self.pad_bytes(len(u), sigma)
        config: dict[str, Any] = {"payload": pad(message, size=size) if fits(message, size=size) else abstention(size)}
        if not self.simulation:  # to the decoder only, over the authenticated channel (docs/privacy.md)
            config["codec_key"] = key.to_bytes(32, "little")
        return Message(config=config), message, key

    def _decode(self, server: PrivateState, rnd: int, cid: int, reply: Message, dim: int, sigma: float) -> np.ndarray:
        """The release in a codec reply (only the padded payload, and in secure mode the release key, as fields;
        a fixed-size abstention is :class:`~fedtailor.fl.records.Abstained`), counted in the ledger first."""
        self.record_arrival(server, rnd, cid)
        reply.only(config={"payload"} if self.simulation else {"payload", "codec_key"})
        if self.simulation:
            key = derive_key(self.seed, self.codec_label, rnd, cid)
        else:
            raw = reply.value("codec_key", bytes)
            if len(raw) != 32:
                raise InvalidMessage(f"release key of client {cid} has {len(raw)} bytes, expected 32.")
            key = int.from_bytes(raw, "little")
        payload = unpad(reply.value("payload", bytes), size=self.pad_bytes(dim, sigma))
        if not payload:
            raise Abstained(f"client {cid} abstained in round {rnd} (its release did not fit the fixed size).")
        try:
            g = self.codec.decode(payload, key=key, sigma=sigma, dim=dim)
        except CodecError as err:
            raise InvalidMessage(f"undecodable release: {err}") from err
        if not np.all(np.isfinite(g)):
            raise InvalidMessage("decoded release contains non-finite values.")
        return g

    def codec_bits(self) -> dict[str, float]:
        """Bits per coefficient of the padded messages (what is sent), by dimension, averaged over sigmas."""
        by_dim: dict[int, list[float]] = {}
        for (d, _), b in self._pad.items():
            by_dim.setdefault(d, []).append(8.0 * b / d)
        return {f"bits_per_coefficient_d{d}": float(np.mean(v)) for d, v in sorted(by_dim.items())}

    # ----- server side ----------------------------------------------------------------------------------
    def init_server(self) -> PrivateState:
        ledger = PrivacyLedger(delta=self.delta, conversion=self.conversion)
        if self.noisy:  # the whole schedule checked before anything is released
            plan = {}
            for c, t in self.plan().items():
                terms = self.release_terms(c)
                one = (
                    terms["sensitivity"],
                    terms["sigma"],
                    terms.get("sampling_rate", 1.0),
                    terms.get("steps", 1),
                    terms.get("population", 0),
                )
                plan[c] = [one] * t
            self._guard(ledger).check_plan(plan)
        return _with_ledger(self.base.init_server(), ledger)

    def configure_fit(self, server: PrivateState, rnd: int, cid: int) -> Message:
        if self.noisy:  # refused here if over budget; recorded when the release arrives
            self._guard(server.ledger).check_release(
                client=cid, round=rnd, mechanism=self.mechanism, **self.release_terms(cid)
            )
        return self.base.configure_fit(server, rnd, cid)

    def validate_reply(self, server: PrivateState, phase: str, rnd: int, cid: int, reply: Message) -> None:
        """Record the release (it left the client), then accept exactly the shared values as tensors of their
        dtype, finite, within the honest norm bound of ``theta_g[S]``. Without noise: the base's own check."""
        if not self.noisy:
            self.base.validate_reply(server, phase, rnd, cid, reply)
            return
        self.record_arrival(server, rnd, cid)
        names = self.base.shared_names(server)
        if set(reply.arrays) != set(names):
            raise InvalidMessage(f"a private reply carries exactly the {len(names)} shared parameters, nothing else.")
        reply.only(arrays=set(names), config=set())
        sq = 0.0
        for n in names:
            t = reply.array(n, shape=tuple(self.base.shapes[n]), dtype=self.base.theta0[n].dtype)
            sq += float((t.double() - server.params[n].double().to(t.device)).pow(2).sum())
        bound = self.release_bound(cid, sum(self.base.shapes[n].numel() for n in names))
        if not math.isfinite(sq) or math.sqrt(sq) > bound:
            raise InvalidMessage(f"release of client {cid} is longer than an honest private update reaches.")

    def record_arrival(self, server: PrivateState, rnd: int, cid: int) -> None:
        """Count the release of ``cid`` in round ``rnd`` in the ledger once: it left the client, however it is
        judged after."""
        if self.noisy and not server.ledger.recorded(client=cid, round=rnd, mechanism=self.mechanism):
            self._guard(server.ledger).record(
                client=cid, round=rnd, mechanism=self.mechanism, **self.release_terms(cid)
            )

    def aggregate_fit(
        self, server: PrivateState, rnd: int, replies: dict[int, Message]
    ) -> tuple[PrivateState, Metrics]:
        """The base's aggregation of the releases with equal weights (each reply one example, no loss); without
        noise the base's aggregation of its own replies."""
        if self.noisy:
            equal = {c: Message(arrays=r.arrays, config={"num_examples": 1, "loss": 0.0}) for c, r in replies.items()}
            base, metrics = self.base.aggregate_fit(server, rnd, equal)
            metrics = {k: v for k, v in metrics.items() if k != "loss"}  # no client sent one
            # the values the releases carried: with the loop's uplink bytes, the run's bits per coefficient
            metrics["uplink_coefficients"] = sum(int(t.numel()) for r in replies.values() for t in r.arrays.values())
        else:
            base, metrics = self.base.aggregate_fit(server, rnd, replies)
        return _with_ledger(base, server.ledger), metrics

    def configure_evaluate(self, server: PrivateState, cid: int) -> Message:
        return self.base.configure_evaluate(server, cid)

    # ----- client side ----------------------------------------------------------------------------------
    def init_client(self, cid: int) -> PersonalState:
        return self.base.init_client(cid)

    def client_fit(self, msg: Message, state: PersonalState | None, data: ClientData) -> tuple[Message, PersonalState]:
        return self.client_fit_many({data.cid: msg}, {data.cid: state}, {data.cid: data})[data.cid]

    def client_evaluate(self, msg: Message, state: PersonalState | None, data: ClientData) -> Metrics:
        return self.base.client_evaluate(msg, state, data)

    def close(self) -> None:
        self.base.close()

    def deployment_risks(self) -> dict[str, str]:
        risks = dict(self.base.deployment_risks())
        if self.simulation:
            risks["simulation-randomness"] = "DP randomness is 'simulation': every noise draw follows from the seed"
        return risks

    def artifacts(self, server: PrivateState) -> dict[str, str]:
        return {"privacy_ledger.json": server.ledger.to_json()}

    def holds_against(self) -> str:
        """Whom the reported eps covers (docs/privacy.md)."""
        if self.simulation:
            return "whoever does not know the config's seed"
        if self.codec is not None:
            return (
                "every output and observer without the clients' release keys; not the decoder (the server), whose "
                f"keys give {self.codec.name}'s shared randomness (docs/privacy.md, 'What a key holder learns')"
            )
        return "the server (state, checkpoints, logs) and every output: each client's noise from its own key"

    def _summary(self, server: PrivateState, kind: str, extra: dict[str, Any]) -> dict[str, Any]:
        eps = server.ledger.epsilons() if self.noisy else {}
        void = [] if self.noisy else ["no noise (epsilon = inf): the method without DP, bit for bit"]
        return {
            **self.base.summary(server),
            "dp": kind,
            **extra,
            "epsilon_target": self.epsilon,
            "epsilon_max": max(eps.values()) if eps else float("inf"),
            "epsilon_conversion": self.conversion,
            "delta": self.delta,
            "epsilon_per_client": {str(c): e for c, e in sorted(eps.items())},
            "randomness": "simulation" if self.simulation else "secure",
            "epsilon_holds_against": self.holds_against(),
            "epsilon_void": bool(void),
            "epsilon_void_reasons": void,
            "releases": len(server.ledger.releases),
        }


class ClientDP(_PrivateRelease):
    """``[method.client_dp]`` around ``base``: clipped shared updates with each client's own Gaussian noise."""

    mechanism = MECHANISM
    codec_label = "client-dp-codec"

    def __init__(
        self, base: LocalTraining, *, cfg: ClientDPConfig, schedule: np.ndarray, seed: int, clients: list[int]
    ) -> None:
        super().__init__(base, cfg, seed=seed, codec=cfg.codec)
        self.cfg = cfg
        self.sensitivity = 2.0 * cfg.clip  # replace adjacency: two updates in the ball of radius C
        self.planned = participations(schedule, clients)
        self.t_max = max(self.planned.values(), default=0)
        self.sigma = 0.0
        if self.noisy:
            self.sigma = cfg.sigma or calibrate_sigma(
                eps=cfg.epsilon,
                delta=cfg.delta,
                t_max=self.t_max,
                context_sensitivity=0.0,
                gradient_sensitivity=self.sensitivity,
                conversion=cfg.conversion,
            )

    def plan(self) -> dict[int, int]:
        return self.planned

    def release_terms(self, cid: int) -> dict[str, Any]:
        return {"sensitivity": self.sensitivity, "sigma": self.sigma}

    def release_bound(self, cid: int, dim: int) -> float:
        return release_norm_bound(self.cfg.clip, self.sigma, dim)

    def validate_reply(self, server: PrivateState, phase: str, rnd: int, cid: int, reply: Message) -> None:
        """With LRSUQ the payload is decoded first (only the padded payload, and in secure mode the release key, as
        fields; a fixed-size abstention is :class:`~fedtailor.fl.records.Abstained`); the reply then holds the
        decoded shared values, checked as every private reply."""
        if self.codec is not None and not reply.arrays:
            self._decode_into(server, rnd, cid, reply)
        super().validate_reply(server, phase, rnd, cid, reply)

    def _decode_into(self, server: PrivateState, rnd: int, cid: int, reply: Message) -> None:
        names = self.base.shared_names(server)
        dim = sum(self.base.shapes[n].numel() for n in names)
        g = self._decode(server, rnd, cid, reply, dim, self.sigma)
        reply.arrays, reply.config = _shift({n: server.params[n] for n in names}, torch.from_numpy(g)), {}

    def client_fit_many(
        self, msgs: dict[int, Message], states: dict[int, PersonalState | None], data: dict[int, ClientData]
    ) -> dict[int, tuple[Message, PersonalState]]:
        """The base's local programs (together when the base runs them so), then each client's release (without
        noise: the base's replies as they are)."""
        if not self.noisy:
            return self.base.client_fit_many(msgs, states, data)
        received = {c: self.base.start_model(msgs[c], states.get(c))[2] for c in msgs}
        out = self.base.client_fit_many(msgs, states, data)
        return {
            c: (self.release(received[c], reply, c, int(msgs[c].config["round"])), new)
            for c, (reply, new) in out.items()
        }

    def release(self, received: dict[str, torch.Tensor], reply: Message, cid: int, rnd: int) -> Message:
        """``theta_g[S] + clip_C(theta_i[S] - theta_g[S]) + N(0, sigma^2 I)`` as the reply, in float64 until the
        final float32; the noise from the client's own key (simulation: derived from the seed)."""
        names = list(reply.arrays)
        if set(names) != set(received):
            raise RequestRefused(f"client {cid} would release parameters it did not receive; refused.")
        update = torch.cat([(reply.arrays[n].double() - received[n].double()).reshape(-1) for n in names])
        norm = float(torch.linalg.vector_norm(update))
        update = update * min(1.0, self.cfg.clip / norm) if norm > 0 else update
        if self.codec is not None:  # LRSUQ or PPR realises u + N(0, sigma^2 I) exactly from its key
            return self._encode(update.cpu().numpy(), cid, rnd, self.sigma)[0]
        if self.noisy:
            key = derive_key(self.seed, "client-dp", rnd, cid) if self.simulation else fresh_key()
            # the hardened ChaCha20 sampler in both modes: only the key differs (simulation: from the seed)
            noise = secure_gaussian_noise(key, "client-dp", sigma=self.sigma, size=update.numel())
            update = update + torch.from_numpy(noise).to(update.device)
        return Message(arrays=_shift({n: received[n] for n in names}, update))

    def summary(self, server: PrivateState) -> dict[str, Any]:
        extra = {
            "dp_clip": self.cfg.clip,
            "sigma": self.sigma,
            "noise_multiplier": self.sigma / self.cfg.clip,
            "T_max": self.t_max,
            "codec": self.cfg.codec,
            **self.codec_bits(),
        }
        return self._summary(server, "client-level, each client's own noise", extra)


class RecordDP(_PrivateRelease):
    """``[method.record_dp]`` around ``base``: every local SGD run of a client's fit is DP-SGD
    (:mod:`fedtailor.privacy.dpsgd`), so everything the client keeps or sends is post-processing of noisy steps;
    what it sends is the base's shared values alone.

    DP-FedSGD over a codec (``codec = "lrsuq"`` or ``"ppr"``): when a client's round is exactly one DP-SGD step on
    all its ``N`` records (``local_epochs = 1``, ``batch_size >= N``) and the base trains only the shared values
    (FedAvg, FedProx), the round's release is one Gaussian mechanism, ``S + N(0, (zeta C)^2 I)`` with ``S`` the
    clipped gradient sum (``||S|| <= N C``). The client sends ``S / N`` through LRSUQ or PPR at ``sigma = zeta C / N``
    (the codec sees an input within its clip ``C``; the decoded value times ``N`` is exactly the release), with the
    padding and key rules of ``[method.client_dp]``; the server decodes it and takes the client's step itself,
    ``theta_g - eta (release / N)``, in the client's arithmetic (the same parameters bit for bit)."""

    mechanism = RECORD_MECHANISM
    codec_label = "record-dp-codec"

    def __init__(
        self,
        base: LocalTraining,
        *,
        cfg: RecordDPConfig,
        schedule: np.ndarray,
        seed: int,
        sizes: dict[int, int],
    ) -> None:
        super().__init__(base, cfg, seed=seed, codec=cfg.codec)
        self.cfg, self.sizes = cfg, sizes
        self.dim = sum(t.numel() for t in base.theta0.values())  # every parameter a step can move
        if self.noisy:  # one client at a time, in this process (its PrivateSGD runs)
            base.vectorize, base.pool = False, None
        self.planned = participations(schedule, sorted(sizes))
        self.steps = {c: base.fit_epochs() * steps_per_epoch(n, base.batch_size) for c, n in sizes.items()}
        self.rates = {c: sampling_rate(n, base.batch_size) for c, n in sizes.items()}
        self.noise_multiplier = 0.0
        if self.noisy:
            self.noise_multiplier = cfg.noise_multiplier or self._calibrate()
        self.sigma = self.noise_multiplier * cfg.clip
        if self.noisy:
            base.private_sgd = PrivateSGD(
                clip=cfg.clip, noise_multiplier=self.noise_multiplier, simulation=self.simulation, seed=seed
            )
        if self.codec is not None and base.own_personal:
            raise ValueError(
                f"record_dp.codec sends the step of the shared values, but {base.name} also trains personal "
                f"parameters with it ({sorted(base.own_personal)[0]}, ...); use fedavg or fedprox."
            )
        if self.codec is not None and (many := sorted(c for c, s in self.steps.items() if s != 1)):
            raise ValueError(
                f"record_dp.codec sends one DP-SGD step a round, but client {many[0]} takes {self.steps[many[0]]}: "
                f"set method.local_epochs = 1 and method.batch_size >= {max(sizes.values())} (the largest client)."
            )

    def _calibrate(self) -> float:
        """The smallest noise multiplier (to 0.1%) that keeps every client's planned DP-SGD within the target."""
        plans = {(self.rates[c], self.steps[c], t) for c, t in self.planned.items()}
        return calibrate_steps(plans, target=self.epsilon, delta=self.delta, conversion=self.conversion)

    def plan(self) -> dict[int, int]:
        return self.planned

    def release_terms(self, cid: int) -> dict[str, Any]:
        return {
            "sensitivity": self.cfg.clip,
            "sigma": self.sigma,
            "sampling_rate": self.rates[cid],
            "steps": self.steps[cid],
        }

    def release_bound(self, cid: int, dim: int) -> float:
        """Every step moves a parameter by ``eta ||g~||`` with ``||g~|| <= (N C + zeta C (sqrt(d) + t)) / (q N)``
        (all N records sampled at most, the Gaussian norm bound of :func:`release_norm_bound`), heavy ball at
        most ``1 / (1 - momentum)`` times that: over the round's steps a loose but fixed bound."""
        n, q = self.sizes[cid], self.rates[cid]
        step = release_norm_bound(n * self.cfg.clip, self.sigma, self.dim) / (q * n)
        return self.base.lr * self.steps[cid] * step / (1.0 - self.base.momentum)

    def client_fit_many(
        self, msgs: dict[int, Message], states: dict[int, PersonalState | None], data: dict[int, ClientData]
    ) -> dict[int, tuple[Message, PersonalState]]:
        """Each client's fit with DP-SGD in every local run, its noisy steps checked against the plan; the reply
        keeps the shared values alone. Without noise: the base's fit as it is."""
        if not self.noisy:
            return self.base.client_fit_many(msgs, states, data)
        out = {}
        for c in sorted(msgs):
            rnd = int(msgs[c].config["round"])
            sgd = self.base.private_sgd
            sgd.start(rnd, c)
            sent: list[Message] = []
            if self.codec is not None:
                sgd.release = self._codec_release(c, rnd, set(msgs[c].arrays), sent)
            try:
                reply, new = self.base.client_fit(msgs[c], states.get(c), data[c])
            finally:
                sgd.stop()
                sgd.release = None
            if sgd.steps != self.steps[c]:
                raise RuntimeError(
                    f"client {c} took {sgd.steps} DP-SGD steps in round {rnd}, its plan {self.steps[c]} "
                    f"({type(self.base).__name__}.fit_epochs does not match its local program)."
                )
            out[c] = (sent[0] if sent else Message(arrays=reply.arrays), new)
        return out

    def _codec_release(self, cid: int, rnd: int, received: set[str], sent: list[Message]) -> ReleaseFn:
        """The DP-SGD step's release through the codec (class docstring): the message goes to ``sent``, the
        decoded release back into the client's step."""
        n = self.sizes[cid]

        order = [m for m in self.base.names if m in received]  # the layout the server decodes into

        def release(step: int, names: list[str], flat: torch.Tensor) -> torch.Tensor:
            if list(names) != order or sent:
                raise RequestRefused(
                    f"client {cid}: record_dp.codec sends one step of the shared values only, but the base trains "
                    f"{sorted(set(names) - received)[:3]} it keeps (or steps again); use fedavg or fedprox."
                )
            message, raw, key = self._encode(flat.cpu().numpy() / n, cid, rnd, self.sigma / n)
            sent.append(message)
            return torch.from_numpy(self.codec.decode(raw, key=key, sigma=self.sigma / n, dim=flat.numel()) * n)

        return release

    def validate_reply(self, server: PrivateState, phase: str, rnd: int, cid: int, reply: Message) -> None:
        """A codec reply is decoded and the client's step taken here (class docstring); the reply then holds the
        client's shared values, checked as every private reply."""
        if self.codec is not None and self.noisy and not reply.arrays:
            shared = set(self.base.shared_names(server))
            names = [n for n in self.base.names if n in shared]
            n = self.sizes[cid]
            g = self._decode(server, rnd, cid, reply, sum(self.base.shapes[m].numel() for m in names), self.sigma / n)
            noisy = unflatten_like(torch.from_numpy(g * n), {m: server.params[m] for m in names})
            q, lr = self.rates[cid], self.base.lr
            step = {m: noisy[m].to(server.params[m].device).to(server.params[m].dtype) / (q * n) for m in names}
            reply.arrays, reply.config = {m: server.params[m] - lr * step[m] for m in names}, {}
        super().validate_reply(server, phase, rnd, cid, reply)

    def summary(self, server: PrivateState) -> dict[str, Any]:
        extra = {
            "dp_clip": self.cfg.clip,
            "noise_multiplier": self.noise_multiplier,
            "sigma": self.sigma,
            "steps_per_round_max": max(self.steps.values(), default=0),
            "sampling_rate_max": max(self.rates.values(), default=0.0),
            "codec": self.cfg.codec,
            **self.codec_bits(),
        }
        return self._summary(server, "record-level DP-SGD (add/remove one record), each client's own noise", extra)


class ServerDP(_PrivateRelease):
    """``[method.server_dp]`` around ``base``: a trusted server clips each client's shared update and adds the
    noise to their sum (DP-FedAvg, *Learning Differentially Private Recurrent Language Models*, McMahan, Ramage,
    Talwar, Zhang 2018, arXiv:1710.06963, with fixed-size client sampling).

    Round ``t`` asks ``m`` of the ``N`` training clients, a fixed-size uniform sample (the schedule). The server
    clips every accepted update ``clip_C(theta_i[S] - theta_g[S])``, draws ``xi ~ N(0, sigma^2 I)`` from its own
    key (``randomness = "secure"``; simulation: from the seed) and sets ``theta_g[S] + (sum_i clip_C(...) + xi) / m``,
    dividing by the public ``m`` whatever the number of replies. Replacing one client moves the sum by at most
    ``2 C``: each round is a subsampled Gaussian mechanism of noise multiplier ``z = sigma / (2 C)`` on a sample of
    ``m`` out of ``N`` (replace-one), recorded for every training client in every round (dp-accounting's
    ``SampledWithoutReplacementDpEvent``, Wang, Balle, Kasiviswanathan 2019). The guarantee covers what the server
    outputs (the shared values it sends, its logs, what it stores of the aggregate), not the server, which sees
    every update; the sampling credit assumes the schedule is secret from those observers (it follows from the
    config seed here, so the credit holds only while the seed is). FedLAG's conflict score reads the clients'
    individual updates and is refused with this wrapper.

    Adaptive clipping (``adaptive_clip``; *Differentially Private Learning with Adaptive Clipping*, Andrew,
    Thakkar, McMahan, Ramaswamy 2021, arXiv:1905.03871, Algorithm 1 with the geometric update): round ``t`` clips
    at ``C_t`` (``C_1 = clip``), counts the accepted updates within it, ``B_t = sum_i 1[||update_i|| <= C_t]``, and
    sets ``C_{t+1} = C_t exp(-eta_C (b_t - gamma))`` with ``b_t = (B_t + N(0, sigma_b^2)) / m``. Replacing one
    client moves ``B_t`` by at most 1 and the sum by at most ``2 C_t``, so the round's pair of noisy sums is one
    Gaussian mechanism of multiplier ``z = (z_u^-2 + sigma_b^-2)^(-1/2)`` (the paper's Theorem 1 under
    replace-one), ``z_u`` the update noise's ``sigma_t / (2 C_t)``: ``z`` is calibrated as without adaptive
    clipping and the update noise takes ``z_u = (z^-2 - sigma_b^-2)^(-1/2)`` (so ``sigma_b > z``); the ledger
    records ``(2 C_t, 2 C_t z)``, the equivalent release."""

    mechanism = SERVER_MECHANISM

    def __init__(
        self, base: LocalTraining, *, cfg: ServerDPConfig, schedule: np.ndarray, seed: int, clients: list[int]
    ) -> None:
        super().__init__(base, cfg)
        self.cfg, self.seed, self.clients = cfg, seed, sorted(clients)
        population = len(self.clients)
        self.rounds, self.per_round = (int(schedule.shape[0]), int(schedule.shape[1])) if schedule.size else (0, 1)
        if not 0 < self.per_round <= population:
            raise ValueError(f"server_dp needs 1 to {population} clients a round, got {self.per_round}.")
        self.population = population
        self.q = self.per_round / population
        self.sensitivity = 2.0 * cfg.clip  # replace-one: two updates in the ball of radius C
        self.noise_multiplier = 0.0
        if self.noisy:
            self.noise_multiplier = cfg.noise_multiplier or self._calibrate()
        self.sigma = self.noise_multiplier * self.sensitivity
        self.adaptive = cfg.adaptive_clip and self.noisy
        self.count_noise, self.update_multiplier = 0.0, self.noise_multiplier
        if self.adaptive:  # the count's noise takes its share of z, the update's noise the rest
            self.count_noise = cfg.count_noise or self.per_round / 20
            if self.count_noise <= self.noise_multiplier:
                raise ValueError(
                    f"server_dp.count_noise {self.count_noise:.4g} must exceed the noise multiplier "
                    f"{self.noise_multiplier:.4g} for adaptive clipping (default m/20 with m = {self.per_round} "
                    "clients a round): set a larger count_noise or ask more clients a round."
                )
            self.update_multiplier = (self.noise_multiplier**-2 - self.count_noise**-2) ** -0.5

    def _calibrate(self) -> float:
        """The smallest noise multiplier (to 0.1%) with which every client stays within the target after all
        the rounds."""
        q = min(self.q, 1.0)

        def eps(z: float) -> float:  # as the ledger will compose it (all clients sampled: plain Gaussians)
            ledger = PrivacyLedger(delta=self.delta, conversion=self.conversion)
            return ledger.epsilon_with(0, [(1.0, z, q, self.rounds, self.population if q < 1 else 0)])

        return smallest_multiplier(eps, self.epsilon)

    def plan(self) -> dict[int, int]:
        return dict.fromkeys(self.clients, self.rounds)

    def release_terms(self, cid: int) -> dict[str, Any]:
        return self._terms(self.cfg.clip)

    def _terms(self, clip: float) -> dict[str, Any]:
        """The ledger's record of a round that clips at ``clip``: sensitivity ``2 C``, noise ``z 2 C``."""
        sensitivity = 2.0 * clip  # at the configured clip: self.sensitivity and self.sigma, the same floats
        sigma = self.noise_multiplier * sensitivity
        if self.q >= 1.0:  # every client every round: plain Gaussian releases
            return {"sensitivity": sensitivity, "sigma": sigma}
        return {"sensitivity": sensitivity, "sigma": sigma, "sampling_rate": self.q, "population": self.population}

    def init_server(self) -> PrivateState:
        server = super().init_server()
        return dataclasses.replace(server, clip=self.cfg.clip) if self.adaptive else server

    def release_bound(self, cid: int, dim: int) -> float:
        return math.inf  # the server clips every update itself

    def configure_fit(self, server: PrivateState, rnd: int, cid: int) -> Message:
        return self.base.configure_fit(server, rnd, cid)  # the round's release is the aggregate, checked there

    def validate_reply(self, server: PrivateState, phase: str, rnd: int, cid: int, reply: Message) -> None:
        self.base.validate_reply(server, phase, rnd, cid, reply)  # the trusted server sees the update as it is

    def aggregate_fit(
        self, server: PrivateState, rnd: int, replies: dict[int, Message]
    ) -> tuple[PrivateState, Metrics]:
        """``theta_g[S] + (sum_i clip_C(update_i) + N(0, sigma^2 I)) / m``, recorded for every training client;
        then the base's aggregation of that one value (each reply replaced by it, equal weights); under adaptive
        clipping also the next round's clip from the noisy count of updates within this round's."""
        if not self.noisy:
            base, metrics = self.base.aggregate_fit(server, rnd, replies)
            return _with_ledger(base, server.ledger), metrics
        clip = server.clip if self.adaptive else self.cfg.clip
        guard = self._guard(server.ledger)
        for c in self.clients:  # every training client's records shape the output, sampled or not
            if not server.ledger.recorded(client=c, round=rnd, mechanism=self.mechanism):
                guard.record(client=c, round=rnd, mechanism=self.mechanism, **self._terms(clip))
        names = self.base.shared_names(server)
        start = {n: server.params[n] for n in names}
        total = torch.zeros(sum(t.numel() for t in start.values()), dtype=torch.float64)
        within = 0
        for reply in replies.values():
            update = torch.cat([(reply.arrays[n].double() - start[n].double()).reshape(-1).cpu() for n in names])
            norm = float(torch.linalg.vector_norm(update))
            within += norm <= clip
            total += update * min(1.0, clip / norm) if norm > 0 else update
        sigma = self.update_multiplier * 2.0 * clip if self.adaptive else self.sigma
        key = derive_key(self.seed, "server-dp", rnd) if self.simulation else fresh_key()
        total += torch.from_numpy(secure_gaussian_noise(key, "server-dp", sigma=sigma, size=total.numel()))
        shared = _shift(start, total / self.per_round)
        equal = {c: Message(arrays=dict(shared), config={"num_examples": 1, "loss": 0.0}) for c in replies}
        base, metrics = self.base.aggregate_fit(server, rnd, equal)
        state = _with_ledger(base, server.ledger)
        metrics = {k: v for k, v in metrics.items() if k != "loss"}
        if self.adaptive:
            key = derive_key(self.seed, "server-dp-count", rnd) if self.simulation else fresh_key()
            noise = float(secure_gaussian_noise(key, "server-dp-count", sigma=self.count_noise, size=1)[0])
            unclipped = (within + noise) / self.per_round
            state.clip = clip * math.exp(-self.cfg.clip_lr * (unclipped - self.cfg.target_quantile))
            metrics |= {"dp_clip": clip, "dp_unclipped_fraction": unclipped}
        return state, metrics

    def client_fit_many(
        self, msgs: dict[int, Message], states: dict[int, PersonalState | None], data: dict[int, ClientData]
    ) -> dict[int, tuple[Message, PersonalState]]:
        return self.base.client_fit_many(msgs, states, data)

    def holds_against(self) -> str:
        seed = "the config's seed" if self.simulation else "the server's noise key"
        return (
            "every output of the server (the shared values it sends, its logs and stored aggregates) for observers "
            f"who do not know {seed} or the schedule (it follows from the config seed); not the server itself, "
            "which sees every client's update (a trusted server)"
        )

    def summary(self, server: PrivateState) -> dict[str, Any]:
        extra = {
            "dp_clip": self.cfg.clip,
            "sigma": self.sigma,
            "noise_multiplier": self.noise_multiplier,
            "client_sampling": f"{self.per_round} of {self.population} a round (q = {self.q:.4g})",
            "rounds": self.rounds,
        }
        if self.adaptive:
            extra |= {
                "adaptive_clip": f"target quantile {self.cfg.target_quantile:g}, eta_C {self.cfg.clip_lr:g}",
                "count_noise": self.count_noise,
                "update_noise_multiplier": self.update_multiplier,
                "dp_clip_next": server.clip,
            }
        return self._summary(server, "client-level, a trusted server's noise on the aggregate", extra)


def smallest_multiplier(eps: Callable[[float], float], target: float) -> float:
    """The smallest noise multiplier ``z`` (to 0.1%) with ``eps(z) <= target`` (``eps`` decreasing in ``z``):
    bracketed from 1 by factors of 4, then bisected on ``log z``."""
    lo, hi = 0.05, 1.0
    while eps(hi) > target:
        lo, hi = hi, hi * 4
        if hi > 1e6:
            raise ValueError(f"no noise multiplier reaches eps = {target}; raise the target.")
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eps(mid) > target else (lo, mid)
    return hi


def _with_ledger(base: SharedState, ledger: PrivacyLedger) -> PrivateState:
    """The base's server state with the ledger beside it."""
    return PrivateState(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, ledger=ledger)


def _shift(start: dict[str, torch.Tensor], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """``start + flat`` per tensor (``flat`` in ``start``'s order), summed in float64, in each tensor's dtype."""
    moved = unflatten_like(flat.double(), start)
    return {n: (t.double() + moved[n].to(t.device)).to(t.dtype) for n, t in start.items()}


def calibrate_steps(plans: set[tuple[float, int, int]], *, target: float, delta: float, conversion: str) -> float:
    """The smallest noise multiplier (to 0.1%) under which every plan ``(sampling rate, steps a release,
    releases)`` of DP-SGD steps stays within ``target``, each eps computed as the ledger will compose it (RDP for
    subsampled steps, the run's conversion for unsampled ones, e.g. a full-batch step at q = 1)."""
    ledger = PrivacyLedger(delta=delta, conversion=conversion)

    def worst(z: float) -> float:
        return max(ledger.epsilon_with(0, [(1.0, z, q, steps)] * releases) for q, steps, releases in plans)

    return smallest_multiplier(worst, target)


def participations(schedule: np.ndarray, clients: list[int]) -> dict[int, int]:
    """Each client's number of rounds in the schedule (those with at least one)."""
    counts = participation_counts(schedule, max(clients) + 1) if len(schedule) else np.zeros(1, dtype=int)
    return {c: int(counts[c]) for c in clients if c < len(counts) and counts[c]}
