"""FedAvg: *Communication-Efficient Learning of Deep Networks from Decentralized Data* (McMahan, Moore,
Ramage, Hampson, Aguera y Arcas, 2017, arXiv:1602.05629).

Clients run ``local_epochs`` of minibatch SGD from the global model; the server averages the returned models
weighted by the clients' numbers of training records,
    theta_{t+1} = sum_{i in S_t} n_i theta_i^{t+1} / sum_{i in S_t} n_i.
Every parameter is shared (the protocol is :mod:`fedtailor.methods.pfl.local`'s with an empty personal part).
"""

from __future__ import annotations

from typing import Literal

from fedtailor.methods.pfl.local import LocalSGDConfig, LocalTraining
from fedtailor.methods.pfl.register import register_base


class FedAvgConfig(LocalSGDConfig):
    name: Literal["fedavg"] = "fedavg"


class FedAvg(LocalTraining):
    name = "fedavg"


register_base(FedAvgConfig, FedAvg)
