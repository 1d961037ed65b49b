"""FedRep: *Exploiting Shared Representations for Personalized Federated Learning* (Collins, Hassani,
Mokhtari, Shakkottai, 2021, arXiv:2102.07078).

Each round a client first trains its personal head with the body frozen (``head_epochs``, default 1), then
the body with the head frozen (``local_epochs``); only the body is shared (Algorithm 1 of the paper, as
PFLlib runs it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from fedtailor.fl.records import ClientData
from fedtailor.methods.pfl.local import UNSEEN_TAG, ClientBatch, LocalSGDConfig, LocalTraining, Params
from fedtailor.methods.pfl.register import register_base
from fedtailor.models.parts import head_names


class FedRepConfig(LocalSGDConfig):
    name: Literal["fedrep"] = "fedrep"
    head_epochs: int = Field(1, ge=1, description="epochs on the head (body frozen) before the body epochs")


class FedRep(LocalTraining):
    name = "fedrep"

    def __init__(self, *, head_epochs: int, **kw) -> None:
        super().__init__(**kw)
        self.head_epochs = head_epochs
        self.own_personal = head_names(self.model)
        self.body = frozenset(self.names) - self.own_personal

    def fit_epochs(self) -> int:
        return self.head_epochs + self.local_epochs

    def local_program(
        self, theta: Params, extra: Params, received: Params, data: ClientData | ClientBatch, rnd: int
    ) -> tuple[Params, Params, Any]:
        theta, _ = self.sgd(theta, data, rnd, trainable=self.own_personal, epochs=self.head_epochs, tag=("head",))
        theta, loss = self.sgd(theta, data, rnd, trainable=self.body)
        return theta, extra, loss

    def finetune(
        self, theta: Params, extra: Params, received: Params, data: ClientData, rnd: int, epochs: int
    ) -> tuple[Params, Params]:
        """An unseen client learns its own head on the global body, frozen (the paper's new-client protocol)."""
        theta, _ = self.sgd(theta, data, rnd, trainable=self.own_personal, epochs=epochs, tag=(UNSEEN_TAG,))
        return theta, extra


register_base(FedRepConfig, FedRep, ("head_epochs",))
