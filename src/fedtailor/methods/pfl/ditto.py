"""Ditto: *Ditto: Fair and Robust Federated Learning Through Personalization* (Li, Hu, Beirami, Smith, 2021,
arXiv:2012.04221).

Each client keeps a personal model ``v_i`` (client state, never sent). In a round it first trains ``v_i`` for
``personal_epochs`` on
    F_i(v) + (lambda / 2) ||v - w^t||^2
against the just-received global model ``w^t`` (Algorithm 1, as PFLlib's PerturbedGradientDescent), then trains
its copy of the global model normally (``local_epochs``), which is averaged as in FedAvg. Clients are
evaluated with their personal models. Default lambda = 0.1 (in the paper's range; the FedLAG scripts left it
at 0, which removes the coupling).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from fedtailor.fl.batched import Objective
from fedtailor.fl.records import ClientData
from fedtailor.methods.pfl.local import UNSEEN_TAG, ClientBatch, LocalSGDConfig, LocalTraining, Params
from fedtailor.methods.pfl.register import register_base


class DittoConfig(LocalSGDConfig):
    name: Literal["ditto"] = "ditto"
    lam: float = Field(0.1, ge=0, description="lambda, prox weight of the personal model to the global one")
    personal_epochs: int = Field(1, ge=1, description="epochs on the personal model per round")


class Ditto(LocalTraining):
    name = "ditto"

    def __init__(self, *, lam: float, personal_epochs: int, **kw) -> None:
        super().__init__(**kw)
        self.lam, self.personal_epochs = lam, personal_epochs

    def init_extra(self) -> Params:
        return {n: t.clone() for n, t in self.theta0.items()}  # v_i starts at the common initialisation

    def fit_epochs(self) -> int:
        return self.personal_epochs + self.local_epochs

    def local_program(
        self, theta: Params, extra: Params, received: Params, data: ClientData | ClientBatch, rnd: int
    ) -> tuple[Params, Params, Any]:
        anchor = {n: theta[n].detach() for n in self.names}  # w^t as the client starts the round

        # F_i(v) + (lambda / 2) ||v - w^t||^2
        personal, _ = self.sgd(
            extra,
            data,
            rnd,
            objective=Objective(mu=self.lam, anchor=anchor),
            epochs=self.personal_epochs,
            tag=("personal",),
        )
        theta, loss = self.sgd(theta, data, rnd)
        return theta, personal, loss

    def predict(self, theta: Params, extra: Params, *, data: ClientData, final: bool) -> tuple[Params, Params]:
        return extra, extra

    def unseen_extra(self, theta: Params, extra: Params) -> Params:
        """An unseen client's personal model starts at the global model (it predicts with ``w`` as it is)."""
        return {n: theta[n] for n in self.names}

    def finetune(
        self, theta: Params, extra: Params, received: Params, data: ClientData, rnd: int, epochs: int
    ) -> tuple[Params, Params]:
        """An unseen client trains its personal model as in a round, against the global model it received;
        the global copy's half of the round would not change its prediction and is skipped."""
        anchor = {n: theta[n].detach() for n in self.names}
        objective = Objective(mu=self.lam, anchor=anchor)
        personal, _ = self.sgd(extra, data, rnd, objective=objective, epochs=epochs, tag=(UNSEEN_TAG,))
        return theta, personal


register_base(DittoConfig, Ditto, ("lam", "personal_epochs"))
