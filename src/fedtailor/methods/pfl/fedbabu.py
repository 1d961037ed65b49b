"""FedBABU: *FedBABU: Towards Enhanced Representation for Federated Image Classification* (Oh, Kim, Yun,
2022, arXiv:2106.06042).

The head stays frozen at its common random initialisation (drawn from the public seed, the same on every
client), so it is never sent; only the body trains and is shared. Before the run's final evaluation each
client fine-tunes its whole model on its training records for ``finetune_epochs`` (default 10, PFLlib's
setting) at step ``finetune_lr`` (default: the training ``lr``, as in PFLlib); the fine-tuned model is evaluated and
not kept. Earlier evaluations show the model without it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from fedtailor.fl.records import ClientData
from fedtailor.methods.pfl.local import ClientBatch, LocalSGDConfig, LocalTraining, Params
from fedtailor.methods.pfl.register import register_base
from fedtailor.models.parts import head_names


class FedBABUConfig(LocalSGDConfig):
    name: Literal["fedbabu"] = "fedbabu"
    finetune_epochs: int = Field(10, ge=0, description="whole-model fine-tuning before the final evaluation")
    finetune_lr: float | None = Field(None, gt=0, description="the fine-tuning's step; None: the training lr")


class FedBABU(LocalTraining):
    name = "fedbabu"

    def __init__(self, *, finetune_epochs: int, finetune_lr: float | None = None, **kw) -> None:
        super().__init__(**kw)
        self.finetune_epochs, self.finetune_lr = finetune_epochs, finetune_lr
        self.own_personal = head_names(self.model)
        self.body = frozenset(self.names) - self.own_personal

    def local_program(
        self, theta: Params, extra: Params, received: Params, data: ClientData | ClientBatch, rnd: int
    ) -> tuple[Params, Params, Any]:
        theta, loss = self.sgd(theta, data, rnd, trainable=self.body)
        return theta, extra, loss

    def predict(self, theta: Params, extra: Params, *, data: ClientData, final: bool) -> tuple[Params, Params]:
        if not final or self.finetune_epochs == 0:
            return theta, extra
        tuned, _ = self.sgd(
            theta, data, self.rounds + 1, epochs=self.finetune_epochs, tag=("finetune",), lr=self.finetune_lr
        )
        return tuned, extra


register_base(FedBABUConfig, FedBABU, ("finetune_epochs", "finetune_lr"))
