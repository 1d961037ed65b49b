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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedtailor.fl.method import Method
from fedtailor.fl.records import ClientData, InvalidMessage, Message, Metrics, RequestRefused
from fedtailor.fl.schedule import participation_counts
from fedtailor.methods.pfl.local import ClientDPConfig, LocalTraining, PersonalState, SharedState
from fedtailor.privacy.calibrate import calibrate_sigma
from fedtailor.privacy.ledger import BudgetGuard, PrivacyLedger
from fedtailor.privacy.mechanisms import release_norm_bound
from fedtailor.privacy.noise import gaussian_noise, secure_gaussian_noise
from fedtailor.rng import derive_key, fresh_key

MECHANISM = "client-update"


@dataclass
class PrivateState(SharedState):
    """The base's server state and the privacy ledger of the releases that reached the server."""

    ledger: PrivacyLedger | None = None


class ClientDP(Method[PrivateState, PersonalState]):
    """``[method.client_dp]`` around ``base``: clipped shared updates with each client's own Gaussian noise."""

    def __init__(
        self, base: LocalTraining, *, cfg: ClientDPConfig, schedule: np.ndarray, seed: int, clients: list[int]
    ) -> None:
        if base.update_bound is not None:
            raise ValueError(
                "method.update_bound with [method.client_dp]: the DP clip already bounds every update; "
                "drop update_bound (or set client_dp.clip)."
            )
        self.base, self.cfg, self.seed = base, cfg, seed
        self.name = base.name
        self.simulation = cfg.randomness == "simulation"
        self.sensitivity = 2.0 * cfg.clip  # replace adjacency: two updates in the ball of radius C
        counts = participation_counts(schedule, max(clients) + 1) if len(schedule) else np.zeros(1, dtype=int)
        self.t_max = int(counts.max())
        self.planned = {c: int(counts[c]) for c in clients if c < len(counts) and counts[c]}
        if self.noisy:
            self.sigma = cfg.sigma or calibrate_sigma(
                eps=cfg.epsilon,
                delta=cfg.delta,
                t_max=self.t_max,
                context_sensitivity=0.0,
                gradient_sensitivity=self.sensitivity,
                conversion=cfg.conversion,
            )
        else:
            self.sigma = 0.0

    # the parameter-sharing API a wrapper such as FedLAG reads (WRAPPER_API), the base's own
    def __getattr__(self, name: str) -> Any:
        if name in {"rounds", "batch_size", "model", "names", "shapes", "own_personal", "start_model", "logits"}:
            return getattr(self.base, name)
        raise AttributeError(name)

    @property
    def noisy(self) -> bool:
        return math.isfinite(self.cfg.epsilon)

    def _guard(self, ledger: PrivacyLedger) -> BudgetGuard:
        return BudgetGuard(ledger, target_eps=self.cfg.epsilon)

    # ----- server side ----------------------------------------------------------------------------------
    def init_server(self) -> PrivateState:
        ledger = PrivacyLedger(delta=self.cfg.delta, conversion=self.cfg.conversion)
        if self.noisy:  # the whole schedule checked before anything is released
            self._guard(ledger).check_plan({c: [(self.sensitivity, self.sigma)] * t for c, t in self.planned.items()})
        base = self.base.init_server()
        return PrivateState(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, ledger=ledger)

    def configure_fit(self, server: PrivateState, rnd: int, cid: int) -> Message:
        if self.noisy:  # refused here if over budget; recorded when the release arrives
            self._guard(server.ledger).check_release(
                client=cid, round=rnd, sensitivity=self.sensitivity, sigma=self.sigma, mechanism=MECHANISM
            )
        return self.base.configure_fit(server, rnd, cid)

    def validate_reply(self, server: PrivateState, phase: str, rnd: int, cid: int, reply: Message) -> None:
        """Record the release (it left the client), then accept exactly the shared values as float32 tensors,
        finite, within the honest norm bound of ``theta_g[S]``."""
        if self.noisy and not server.ledger.recorded(client=cid, round=rnd, mechanism=MECHANISM):
            self._guard(server.ledger).record(
                client=cid, round=rnd, sensitivity=self.sensitivity, sigma=self.sigma, mechanism=MECHANISM
            )
        names = self.base.shared_names(server)
        if set(reply.arrays) != set(names):
            raise InvalidMessage(f"a private reply carries exactly the {len(names)} shared parameters, nothing else.")
        reply.only(arrays=set(names), config=set())
        sq = 0.0
        for n in names:
            t = reply.array(n, shape=tuple(self.base.shapes[n]), dtype=self.base.theta0[n].dtype)
            sq += float((t.double() - server.params[n].double().to(t.device)).pow(2).sum())
        bound = release_norm_bound(self.cfg.clip, self.sigma, self._dim(names))
        if not math.isfinite(sq) or math.sqrt(sq) > bound:
            raise InvalidMessage(f"release of client {cid} is longer than a clipped update plus noise reaches.")

    def _dim(self, names: tuple[str, ...] | list[str]) -> int:
        return sum(self.base.shapes[n].numel() for n in names)

    def aggregate_fit(
        self, server: PrivateState, rnd: int, replies: dict[int, Message]
    ) -> tuple[PrivateState, Metrics]:
        """The base's aggregation of the releases with equal weights (each reply one example, no loss)."""
        equal = {c: Message(arrays=r.arrays, config={"num_examples": 1, "loss": 0.0}) for c, r in replies.items()}
        base, metrics = self.base.aggregate_fit(server, rnd, equal)
        metrics = {k: v for k, v in metrics.items() if k != "loss"}  # no client sent one
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return PrivateState(**fields, ledger=server.ledger), metrics

    def configure_evaluate(self, server: PrivateState, cid: int) -> Message:
        return self.base.configure_evaluate(server, cid)

    # ----- client side ----------------------------------------------------------------------------------
    def init_client(self, cid: int) -> PersonalState:
        return self.base.init_client(cid)

    def client_fit(self, msg: Message, state: PersonalState | None, data: ClientData) -> tuple[Message, PersonalState]:
        return self.client_fit_many({data.cid: msg}, {data.cid: state}, {data.cid: data})[data.cid]

    def client_fit_many(
        self, msgs: dict[int, Message], states: dict[int, PersonalState | None], data: dict[int, ClientData]
    ) -> dict[int, tuple[Message, PersonalState]]:
        """The base's local programs (together when the base runs them so), then each client's release."""
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
        if self.noisy:
            key = derive_key(self.seed, "client-dp", rnd, cid) if self.simulation else fresh_key()
            sampler = gaussian_noise if self.simulation else secure_gaussian_noise
            noise = sampler(key, "client-dp", sigma=self.sigma, size=update.numel())
            update = update + torch.from_numpy(noise).to(update.device)
        arrays, start = {}, 0
        for n in names:
            size = received[n].numel()
            value = received[n].double() + update[start : start + size].reshape(received[n].shape)
            arrays[n] = value.to(received[n].dtype)
            start += size
        return Message(arrays=arrays)

    def client_evaluate(self, msg: Message, state: PersonalState | None, data: ClientData) -> Metrics:
        return self.base.client_evaluate(msg, state, data)

    def close(self) -> None:
        self.base.close()

    # ----- run summary ------------------------------------------------------------------------------------
    def deployment_risks(self) -> dict[str, str]:
        risks = dict(self.base.deployment_risks())
        if self.simulation:
            risks["simulation-randomness"] = (
                "method.client_dp.randomness is 'simulation': every noise draw follows from the public seed"
            )
        return risks

    def summary(self, server: PrivateState) -> dict[str, Any]:
        eps = server.ledger.epsilons() if self.noisy else {}
        void = [] if self.noisy else ["no noise (client_dp.epsilon = inf): updates clipped only"]
        return {
            **self.base.summary(server),
            "dp": "client-level, each client's own noise",
            "dp_clip": self.cfg.clip,
            "sigma": self.sigma,
            "noise_multiplier": self.sigma / self.cfg.clip,
            "T_max": self.t_max,
            "epsilon_target": self.cfg.epsilon,
            "epsilon_max": max(eps.values()) if eps else float("inf"),
            "epsilon_conversion": self.cfg.conversion,
            "delta": self.cfg.delta,
            "epsilon_per_client": {str(c): e for c, e in sorted(eps.items())},
            "randomness": self.cfg.randomness,
            "epsilon_holds_against": (
                "whoever does not know the config's seed"
                if self.simulation
                else "the server (state, checkpoints, logs) and every output: each client's noise from its own key"
            ),
            "epsilon_void": bool(void),
            "epsilon_void_reasons": void,
            "releases": len(server.ledger.releases),
        }

    def artifacts(self, server: PrivateState) -> dict[str, str]:
        return {"privacy_ledger.json": server.ledger.to_json()}
