"""APFL: *Adaptive Personalized Federated Learning* (Deng, Kamani, Mahdavi, 2020, arXiv:2003.13461).

Each client keeps a personal model ``v_i`` and a mixing weight ``alpha_i`` (client state, never sent) and
predicts with the mixed model
    v_bar_i = alpha_i v_i + (1 - alpha_i) w,
``w`` the global model. Every local minibatch step (Algorithm 1 of the paper, one learning rate ``eta`` for all
three), from the same point ``(w, v, alpha)`` and on the same batch ``xi``:
    w     <- w - eta grad_w f_i(w; xi)                                  (the copy of the global model)
    v     <- v - eta grad_v f_i(v_bar; xi) = v - eta alpha grad f_i(v_bar; xi)
    alpha <- clip_[0,1](alpha - eta <v - w, grad f_i(v_bar; xi)>)        (adaptive alpha, projected)
computed as one SGD step on ``f_i(w) + f_i(alpha v + (1 - alpha) stopgrad(w))`` (the two terms' gradients do not
mix) followed by the projection of ``alpha`` onto [0, 1]. The copies of ``w`` are averaged as in FedAvg; the
reported training loss is the sum of the two terms. Defaults: ``alpha`` starts at 0.25 (the paper's
experiments use alpha in {0.25, 0.5, 0.75}, with adaptive alpha as its main variant), adaptive (``adaptive =
false`` keeps it fixed); ``v_i`` starts at the common initialisation. Under FedLAG, a FedLAG-personal layer of
``w`` is the client's own copy (never replaced by the server's), mixed in the same way.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from fedtailor.fl.batched import Objective
from fedtailor.fl.records import ClientData
from fedtailor.methods.pfl.local import UNSEEN_TAG, ClientBatch, LocalSGDConfig, LocalTraining, Params
from fedtailor.methods.pfl.register import register_base

ALPHA = "apfl.alpha"  # the mixing weight's key in a client's extra state (never a parameter name)
PERSONAL = "personal/"  # prefix of v_i's parameters in the joint SGD state


class APFLConfig(LocalSGDConfig):
    name: Literal["apfl"] = "apfl"
    alpha: float = Field(0.25, ge=0, le=1, description="the mixing weight alpha_i every client starts with")
    adaptive: bool = Field(True, description="learn each client's alpha_i by projected SGD (false: fixed)")


class APFL(LocalTraining):
    name = "apfl"

    def __init__(self, *, alpha: float, adaptive: bool, **kw) -> None:
        super().__init__(**kw)
        self.alpha0, self.adaptive = float(alpha), bool(adaptive)

    def init_extra(self) -> Params:
        v = {n: t.clone() for n, t in self.theta0.items()}
        return {**v, ALPHA: torch.tensor(self.alpha0, dtype=torch.float32, device=self.device)}

    def mixed(self, w: Params, v: Params, alpha: torch.Tensor) -> Params:
        """``alpha v + (1 - alpha) w`` by parameter name (``alpha``: a scalar for one client)."""
        return {n: alpha * v[n] + (1 - alpha) * w[n] for n in self.names}

    def local_program(
        self, theta: Params, extra: Params, received: Params, data: ClientData | ClientBatch, rnd: int
    ) -> tuple[Params, Params, Any]:
        return self._joint_sgd(theta, extra, data, rnd)

    def _joint_sgd(
        self, theta: Params, extra: Params, data: ClientData | ClientBatch, rnd: int, **sgd: Any
    ) -> tuple[Params, Params, Any]:
        keys = {f"{PERSONAL}{n}": n for n in self.names}
        # f_i(w) + f_i(alpha v + (1 - alpha) stopgrad(w)), alpha projected onto [0, 1] after every step
        objective = Objective(mixture=keys, alpha=ALPHA)
        joint = {**theta, **{k: extra[n] for k, n in keys.items()}, ALPHA: extra[ALPHA]}
        trainable = frozenset(joint) if self.adaptive else frozenset(joint) - {ALPHA}
        joint, value = self.sgd(joint, data, rnd, objective=objective, trainable=trainable, **sgd)
        new_extra = {**{n: joint[k] for k, n in keys.items()}, ALPHA: joint[ALPHA]}
        return {n: joint[n] for n in self.names}, new_extra, value

    def unseen_extra(self, theta: Params, extra: Params) -> Params:
        """An unseen client's ``v_i`` starts at the global model, so its mixed model is ``w`` whatever ``alpha``."""
        return {**{n: theta[n] for n in self.names}, ALPHA: extra[ALPHA]}

    def finetune(
        self, theta: Params, extra: Params, received: Params, data: ClientData, rnd: int, epochs: int
    ) -> tuple[Params, Params]:
        """An unseen client runs the local program (``w``, ``v_i`` and ``alpha_i`` together) for ``epochs``."""
        theta, extra, _ = self._joint_sgd(theta, extra, data, rnd, epochs=epochs, tag=(UNSEEN_TAG,))
        return theta, extra

    def predict(self, theta: Params, extra: Params, *, data: ClientData, final: bool) -> tuple[Params, Params]:
        """The mixed model of the received global ``w`` and the client's ``v_i``, ``alpha_i``."""
        return self.mixed(theta, extra, extra[ALPHA]), extra


register_base(APFLConfig, APFL, ("alpha", "adaptive"))
