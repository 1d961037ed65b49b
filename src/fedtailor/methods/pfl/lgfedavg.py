"""LG-FedAvg: *Think Locally, Act Globally: Federated Learning with Local and Global Representations* (Liang,
Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, 2020, arXiv:2001.01523).

Each client keeps its own *local representation*: the model's body (every layer below the declared head,
:mod:`fedtailor.models.parts`) is client state, never sent nor averaged. Only the *global* part, the top
layers (the head), is shared: the server sends the global head, the client trains its whole model (its own
body and the received head) for ``local_epochs`` of SGD on cross-entropy, and the server averages the
returned heads weighted by the clients' numbers of training records, as FedAvg does. The reverse split of
FedPer (:mod:`fedtailor.methods.pfl.fedper`: shared body, personal head). Clients are evaluated with their own
body under the global head.
"""

from __future__ import annotations

from typing import Literal

from fedtailor.methods.pfl.local import LocalSGDConfig, LocalTraining
from fedtailor.methods.pfl.register import register_base
from fedtailor.models.parts import head_names


class LGFedAvgConfig(LocalSGDConfig):
    name: Literal["lgfedavg"] = "lgfedavg"


class LGFedAvg(LocalTraining):
    name = "lgfedavg"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.own_personal = frozenset(self.names) - head_names(self.model)  # the local representation


register_base(LGFedAvgConfig, LGFedAvg)
