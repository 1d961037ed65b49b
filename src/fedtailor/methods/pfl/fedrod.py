"""FedRoD: *On Bridging Generic and Personalized Federated Learning for Image Classification* (Chen, Chao,
2022, arXiv:2107.00778).

The model's body and its declared head form the *generic* model, trained with the balanced softmax loss
    l_BSM(z, y) = CE(z + log n_i, y)      (n_i: the client's per-class training counts)
and averaged as in FedAvg. A *personal head* ``phi_i`` of the same shape as the head (client state, never
sent, initialised as the common head) is trained on
    CE(z_g.detach() + phi_i(r.detach()), y),     r the body's representation, z_g the generic logits,
in the same minibatch steps (one SGD step on the sum, which equals PFLlib's two optimizers with one learning
rate since the gradients do not mix). A client predicts ``z_g + phi_i(r)``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from fedtailor.fl.batched import Objective
from fedtailor.fl.records import ClientData
from fedtailor.methods.pfl.local import (
    UNSEEN_TAG,
    ClientBatch,
    LocalSGDConfig,
    LocalTraining,
    Params,
    per_client,
)
from fedtailor.methods.pfl.register import register_base
from fedtailor.models.parts import head_names


class FedRoDConfig(LocalSGDConfig):
    name: Literal["fedrod"] = "fedrod"


class FedRoD(LocalTraining):
    name = "fedrod"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.head_params = sorted(head_names(self.model))

    def init_extra(self) -> Params:
        return {n: self.theta0[n].clone() for n in self.head_params}

    def local_program(
        self, theta: Params, extra: Params, received: Params, data: ClientData | ClientBatch, rnd: int
    ) -> tuple[Params, Params, Any]:
        return self._joint_sgd(theta, extra, data, rnd)

    def unseen_extra(self, theta: Params, extra: Params) -> Params:
        """An unseen client's personal head starts as a copy of the generic head (as every client's does at
        round 0, when both are the common initialisation): it predicts ``2 z_g``, the generic model's classes
        (accuracy), its logits doubled (loss)."""
        return {n: theta[n] for n in self.head_params}

    def finetune(
        self, theta: Params, extra: Params, received: Params, data: ClientData, rnd: int, epochs: int
    ) -> tuple[Params, Params]:
        """An unseen client runs the local program (generic model and personal head together) for ``epochs``."""
        theta, extra, _ = self._joint_sgd(theta, extra, data, rnd, epochs=epochs, tag=(UNSEEN_TAG,))
        return theta, extra

    def _joint_sgd(
        self, theta: Params, extra: Params, data: ClientData | ClientBatch, rnd: int, **sgd: Any
    ) -> tuple[Params, Params, Any]:
        classes = self.num_classes(data)
        log_counts = per_client(data, lambda d: torch.bincount(d.train[1], minlength=classes).to(torch.float32).log())
        keys = {f"personal/{n}": n for n in self.head_params}
        # CE(z_g + log n_i, y) (-inf for absent classes: never a target) + CE(z_g.detach() + phi_i(r.detach()), y)
        objective = Objective(offset=log_counts, personal_head=keys)
        joint = {**theta, **{k: extra[n] for k, n in keys.items()}}
        joint, value = self.sgd(joint, data, rnd, objective=objective, trainable=frozenset(joint), **sgd)
        return ({n: joint[n] for n in self.names}, {n: joint[k] for k, n in keys.items()}, value)

    def num_classes(self, data: ClientData | ClientBatch) -> int:
        one = data.clients[0] if isinstance(data, ClientBatch) else data
        with torch.no_grad():
            return int(self.logits(self.theta0, one.train[0][:1]).shape[1])

    def eval_logits(self, params: Params, extra: Params, x: torch.Tensor) -> torch.Tensor:
        rep, z_g = self.head_input_and_logits(params, x)
        return z_g + self.apply_head(extra, rep)


register_base(FedRoDConfig, FedRoD)
