"""FedProx: *Federated Optimization in Heterogeneous Networks* (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith,
2020, arXiv:1812.06127).

FedAvg whose local objective adds a proximal term to the model the client received,
    h_i(w) = F_i(w) + (mu / 2) ||w - w^t||^2,
so each SGD step follows grad F_i(w) + mu (w - w^t) (Eq. 2 of the paper; PFLlib's PerturbedGradientDescent).
The anchor ``w^t`` is refreshed every round to what was just received; only received (shared) names are
anchored. Default mu = 0.01 (the paper's grid is {0.001, 0.01, 0.1, 1}; the FedLAG scripts left mu = 0,
which is FedAvg).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from fedtailor.fl.batched import Objective
from fedtailor.fl.records import ClientData
from fedtailor.methods.pfl.local import UNSEEN_TAG, ClientBatch, LocalSGDConfig, LocalTraining, Params
from fedtailor.methods.pfl.register import register_base


class FedProxConfig(LocalSGDConfig):
    name: Literal["fedprox"] = "fedprox"
    mu: float = Field(0.01, ge=0, description="proximal weight: grad F_i(w) + mu (w - w_received)")


class FedProx(LocalTraining):
    name = "fedprox"

    def __init__(self, *, mu: float, **kw) -> None:
        super().__init__(**kw)
        self.mu = mu

    def local_program(
        self, theta: Params, extra: Params, received: Params, data: ClientData | ClientBatch, rnd: int
    ) -> tuple[Params, Params, Any]:
        # F_i(w) + (mu / 2) ||w - w^t||^2, w^t the received model
        objective = Objective(mu=self.mu, anchor={n: t.detach() for n, t in received.items()})
        theta, value = self.sgd(theta, data, rnd, objective=objective)
        return theta, extra, value

    def finetune(
        self, theta: Params, extra: Params, received: Params, data: ClientData, rnd: int, epochs: int
    ) -> tuple[Params, Params]:
        """An unseen client's fine-tuning: the local objective, anchored to the received global model."""
        objective = Objective(mu=self.mu, anchor={n: t.detach() for n, t in received.items()})
        theta, _ = self.sgd(theta, data, rnd, objective=objective, epochs=epochs, tag=(UNSEEN_TAG,))
        return theta, extra


register_base(FedProxConfig, FedProx, ("mu",))
