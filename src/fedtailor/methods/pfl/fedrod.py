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
import torch.nn.functional as F
from torch.func import functional_call

from fedtailor.fl.records import ClientData
from fedtailor.methods.pfl.local import (
    ClientBatch,
    LocalSGDConfig,
    LocalTraining,
    Params,
    per_client,
)
from fedtailor.methods.pfl.register import register_base
from fedtailor.models.parts import head_module, head_names


class FedRoDConfig(LocalSGDConfig):
    name: Literal["fedrod"] = "fedrod"


class FedRoD(LocalTraining):
    name = "fedrod"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.head = head_module(self.model)
        self.head_params = sorted(head_names(self.model))
        self.head_mod = dict(self.model.named_modules())[self.head]

    def init_extra(self) -> Params:
        return {n: self.theta0[n].clone() for n in self.head_params}

    def _forward(self, theta: Params, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(representation r entering the head, generic logits z_g)."""
        seen: list[torch.Tensor] = []
        handle = self.head_mod.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
        try:
            logits = functional_call(self.model, theta, (x,))
        finally:
            handle.remove()
        return seen[0], logits

    def _personal(self, phi: Params, rep: torch.Tensor) -> torch.Tensor:
        prefix = self.head + "."
        return functional_call(self.head_mod, {n[len(prefix) :]: t for n, t in phi.items()}, (rep,))

    def local_program(
        self, theta: Params, extra: Params, received: Params, data: ClientData | ClientBatch, rnd: int
    ) -> tuple[Params, Params, Any]:
        classes = self.num_classes(data)
        log_counts = per_client(data, lambda d: torch.bincount(d.train[1], minlength=classes).to(torch.float32).log())
        keys = {f"personal/{n}": n for n in self.head_params}

        def loss(p: Params, aux: Params, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            rep, z_g = self._forward({n: p[n] for n in self.names}, xb)
            bsm = F.cross_entropy(z_g + aux["log_counts"], yb)  # -inf for absent classes: never a target
            z_p = z_g.detach() + self._personal({n: p[k] for k, n in keys.items()}, rep.detach())
            return bsm + F.cross_entropy(z_p, yb)

        joint = {**theta, **{k: extra[n] for k, n in keys.items()}}
        joint, value = self.sgd(joint, data, rnd, loss=loss, aux={"log_counts": log_counts}, trainable=frozenset(joint))
        return ({n: joint[n] for n in self.names}, {n: joint[k] for k, n in keys.items()}, value)

    def num_classes(self, data: ClientData | ClientBatch) -> int:
        one = data.clients[0] if isinstance(data, ClientBatch) else data
        with torch.no_grad():
            return int(self.logits(self.theta0, one.train[0][:1]).shape[1])

    def eval_logits(self, params: Params, extra: Params, x: torch.Tensor) -> torch.Tensor:
        rep, z_g = self._forward(params, x)
        return z_g + self._personal(extra, rep)


register_base(FedRoDConfig, FedRoD)
