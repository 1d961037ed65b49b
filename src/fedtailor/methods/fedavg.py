"""FedAvg (McMahan et al. 2017): clients run local SGD from the global model; the server averages the
returned models weighted by the number of local training records,
    theta_{t+1} = sum_{i in S_t} n_i theta_i^{t+1} / sum_{i in S_t} n_i.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedtailor.fl.method import Method
from fedtailor.fl.records import ClientData, InvalidMessage, Message, Metrics
from fedtailor.fl.training import accuracy_and_loss, local_sgd
from fedtailor.models.flat import get_flat, set_flat
from fedtailor.rng import torch_generator


@dataclass
class FedAvgState:
    params: torch.Tensor  # flat global model theta_t


class FedAvg(Method[FedAvgState, None]):
    name = "fedavg"

    def __init__(
        self,
        *,
        model_fn: Callable[[], nn.Module],
        lr: float,
        local_epochs: int,
        batch_size: int,
        seed: int,
        device: torch.device,
        momentum: float = 0.0,
    ) -> None:
        self.model = model_fn().to(device)  # one working copy, loaded with whichever parameters are needed
        self.lr, self.local_epochs, self.batch_size = lr, local_epochs, batch_size
        self.momentum, self.seed, self.device = momentum, seed, device
        self.theta0 = get_flat(self.model)  # the initial global model, fixed by the public seed
        self.dim = self.theta0.numel()

    def init_server(self) -> FedAvgState:
        return FedAvgState(params=self.theta0.clone())

    def configure_fit(self, server: FedAvgState, rnd: int, cid: int) -> Message:
        return Message(arrays={"params": server.params}, config={"round": rnd})

    def client_fit(self, msg: Message, state: None, data: ClientData) -> tuple[Message, None]:
        rnd = int(msg.config["round"])
        set_flat(self.model, msg.arrays["params"].to(self.device))
        x, y = data.train
        gen = torch_generator(self.seed, "batches", rnd, data.cid, device=x.device)
        loss = local_sgd(self.model, x, y, epochs=self.local_epochs, batch_size=self.batch_size, lr=self.lr,
                         generator=gen, momentum=self.momentum)
        reply = Message(arrays={"params": get_flat(self.model)}, config={"num_examples": len(x), "loss": loss})
        return reply, None

    def validate_reply(self, server: FedAvgState, phase: str, rnd: int, cid: int, reply: Message) -> None:
        reply.array("params", shape=(self.dim,))
        n = reply.value("num_examples", int)
        if n <= 0:
            raise InvalidMessage(f"num_examples must be positive, got {n}.")
        reply.value("loss", float)

    def aggregate_fit(self, server: FedAvgState, rnd: int, replies: dict[int, Message]) -> tuple[FedAvgState, Metrics]:
        weights = torch.tensor([float(r.config["num_examples"]) for r in replies.values()], device=server.params.device)
        stacked = torch.stack([r.arrays["params"].to(server.params.device) for r in replies.values()])
        params = (weights[:, None] * stacked).sum(0) / weights.sum()
        loss = float(sum(float(r.config["loss"]) * w for r, w in zip(replies.values(), weights.tolist())) / weights.sum())
        return FedAvgState(params=params), {"loss": loss}

    def configure_evaluate(self, server: FedAvgState, cid: int) -> Message:
        return Message(arrays={"params": server.params})

    def client_evaluate(self, msg: Message, state: None, data: ClientData) -> Metrics:
        set_flat(self.model, msg.arrays["params"].to(self.device))
        x, y = data.eval
        acc, loss = accuracy_and_loss(self.model, x, y)
        return {"accuracy": acc, "loss": loss, "num_examples": float(len(x))}
