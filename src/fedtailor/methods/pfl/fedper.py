"""FedPer: *Federated Learning with Personalization Layers* (Arivazhagan, Aggarwal, Singh, Choudhary, 2019,
arXiv:1912.00818).

The whole model trains locally; only the base (body) is shared and averaged, the personalization layers (the
model's declared head, :mod:`fedtailor.models.parts`) stay on the client.
"""

from __future__ import annotations

from typing import Literal

from fedtailor.methods.pfl.local import LocalSGDConfig, LocalTraining
from fedtailor.methods.pfl.register import register_base
from fedtailor.models.parts import head_names


class FedPerConfig(LocalSGDConfig):
    name: Literal["fedper"] = "fedper"


class FedPer(LocalTraining):
    name = "fedper"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.own_personal = head_names(self.model)


register_base(FedPerConfig, FedPer)
