"""Personalized FL by parameter sharing: what FedAvg, FedProx, FedPer, FedRep, FedBABU, Ditto and FedRoD have in
common, written once, and the seam the FedLAG wrapper (:mod:`fedtailor.methods.pfl.fedlag`) plugs into.

Notation. ``theta`` is a model's parameters by name (``named_parameters()`` order). The server holds one global
value ``theta_g[n]`` for every name ``n``. A method has an *own personal part* ``O`` (e.g. the head of FedPer),
and the server state carries a set ``L`` of names a wrapper made personal (FedLAG's layers; empty otherwise).

Round ``t``, client ``i``:

1. the server sends the shared names ``S = all - O - L`` with their global values;
2. the client's starting model is its own model after its last round with ``S`` overwritten by what it
   received: whatever is not sent stays personal (a client that never trained starts from the common
   initialisation ``theta_0``, drawn from the public seed);
3. it runs the method's local program (:meth:`LocalTraining.local_program`) and replies with its new values of
   ``S``, its number of training records ``n_i`` and its mean training loss;
4. the server checks every reply (exactly the names of ``S`` with their shapes and dtypes, finite values, ``n_i``
   at most the client's partition size, which the server knows; optionally ``||theta_i[S] - theta_g[S]||`` at
   most ``update_bound``, else rejected or clipped) and sets ``theta_g[n] = sum_i n_i theta_i[n] / sum_i n_i``
   for ``n`` in ``S`` (FedAvg's weighted mean; a client's weight never exceeds its partition size).

Evaluation: every client's own personalized model (received ``S`` plus its personal rest, or the method's own
predictor, e.g. Ditto's personal model) on its own test split; the loop averages over clients. A client that
never trains (unseen, "Future": never scheduled, no state) receives every global value the server holds (``S``
and ``L``; ``O`` is theta_0) and reports ``accuracy``/``loss`` of that model through the method's predictor, its
personal state started at its global counterpart where it has one (:meth:`LocalTraining.unseen_extra`), and
``finetuned_accuracy``/``finetuned_loss`` after ``unseen_finetune_epochs`` of the method's own local objective
on its labelled context (:meth:`LocalTraining.finetune`, key ``(seed, "batches", t, i, "unseen")``), then
drops the fine-tuned model (docs/pfl.md, "Unseen clients"). All local
training is plain minibatch SGD (:func:`fedtailor.fl.training.functional_sgd`) in an order drawn from the key
``(seed, "batches", t, i)``; the clients of a round run it together (:mod:`fedtailor.fl.batched`: a hand-written
backward over all clients at once; ``torch.func.vmap`` for models and objectives it does not cover).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn
from torch.func import functional_call

from fedtailor.config import Section
from fedtailor.fl.batched import Objective, explicit_sgd, supports, try_compile
from fedtailor.fl.method import Method
from fedtailor.fl.records import ClientData, InvalidMessage, Message, Metrics, TrainingDiverged, check_weight
from fedtailor.fl.training import LossFn, accuracy_and_loss_of, batched_sgd, functional_sgd
from fedtailor.fl.workers import WorkerPool
from fedtailor.models.layerwise import model_layers
from fedtailor.models.parts import head_module
from fedtailor.privacy.dpsgd import PrivateSGD
from fedtailor.rng import torch_generator

Params = dict[str, torch.Tensor]

UNSEEN_TAG = "unseen"  # the batch-order key's tag of an unseen client's fine-tuning


class FedLAGConfig(Section):
    """FedLAG around the method it sits in (docs/fedlag.md): conflicting layers become personal."""

    top_k: int = Field(2, ge=0, description="layers made personal after the warm-up")
    xi: float = Field(0.0, ge=-1, le=1, description="a client pair conflicts on a layer when its cosine is < xi")
    warmup: int | None = Field(None, ge=0, description="scoring rounds before the choice (default min(rounds/2, 30))")
    unit: Literal["tensor", "module"] = Field("tensor", description="a layer is one tensor or one module's weight+bias")
    update: Literal["delta", "gradient"] = Field("delta", description="round delta or last-minibatch gradient")
    rechoose: bool = Field(False, description="keep scoring after the warm-up and re-choose every round")
    choice: Literal["conflict", "first", "middle", "last"] = Field(
        "conflict", description="top-k by conflict score, or a fixed First/Middle/Last-K for comparison"
    )
    cap: int | None = Field(
        None,
        ge=1,
        description="robust score: no client takes part in more than cap of a layer's counted "
        "conflicting pairs in a round, so one client moves a score by at most cap (docs/fedlag.md); none: "
        "the paper's plain pair count",
    )


class DPConfig(Section):
    """What both DP wrappers of the parameter-sharing methods take (docs/privacy.md): every client's target eps
    at ``delta``, the clip C and where the randomness comes from."""

    clip: float = Field(
        1.0, gt=0, description="C: each clipped quantity (an update or a record's gradient) has norm <= C"
    )
    epsilon: float = Field(
        8.0, gt=0, description="target eps of every client; the noise is calibrated to it (inf: the method without DP)"
    )
    delta: float = Field(1e-5, gt=0, lt=1)
    conversion: Literal["closed-form", "balle", "exact"] = Field(
        "closed-form", description="eps of plain Gaussian releases; subsampled steps use dp-accounting's RDP"
    )
    randomness: Literal["secure", "simulation"] = Field(
        "secure",
        description="'secure': each client's noise (and record sampling) from 256 bits of its OS entropy (not "
        "reproducible); 'simulation': derived from the seed (reproducible; eps holds only while the seed is secret)",
    )


class _CodecDPConfig(DPConfig):
    """A DP section whose release can go through LRSUQ or PPR, which realise its Gaussian noise exactly: a codec
    needs noise (epsilon finite)."""

    section: ClassVar[str]
    codec: Literal["fp32", "lrsuq", "ppr"] = "fp32"

    @model_validator(mode="after")
    def _codec_needs_noise(self) -> _CodecDPConfig:
        if self.codec != "fp32" and not math.isfinite(self.epsilon):
            raise ValueError(
                f"{self.section}.codec {self.codec!r} realises Gaussian noise; without noise (epsilon = inf) use fp32."
            )
        return self


class ClientDPConfig(_CodecDPConfig):
    """Client-level DP with each client's own noise around the method it sits in ([method.client_dp];
    docs/privacy.md, "Client-level DP for the parameter-sharing methods"): every shared update clipped to ``clip``
    and noised by its client (replace adjacency, sensitivity 2C), accounted per client in the run's ledger."""

    section = "client_dp"
    sigma: float | None = Field(
        None, gt=0, description="fixed noise std instead of calibrating it; a schedule above epsilon is refused"
    )
    codec: Literal["fp32", "lrsuq", "ppr"] = Field(
        "fp32",
        description="the uplink: the noisy update in float32, or the clipped update sent by LRSUQ or PPR, which "
        "realise its Gaussian noise exactly in a padded message of about a bit or less per coordinate "
        "(docs/privacy.md, docs/codecs.md)",
    )


class ServerDPConfig(DPConfig):
    """Client-level DP with a trusted server's noise on the sum of the clipped updates ([method.server_dp];
    docs/privacy.md): the guarantee covers what the server outputs, not the server; client sampling credited."""

    noise_multiplier: float | None = Field(
        None, gt=0, description="z = sigma / (2 C) of the noise on the sum instead of calibrating it to epsilon"
    )
    adaptive_clip: bool = Field(
        False,
        description="C tracks a quantile of the update norms (Andrew et al. 2021): C <- C exp(-clip_lr (b - "
        "target_quantile)), b the noisy fraction of updates within C; clip is the first round's C",
    )
    target_quantile: float = Field(0.5, gt=0, lt=1, description="gamma: the fraction of updates C leaves unclipped")
    clip_lr: float = Field(0.2, gt=0, description="eta_C, the step of the geometric clip update")
    count_noise: float | None = Field(
        None,
        gt=0,
        description="sigma_b, the noise std on the count of unclipped updates (default m/20, the paper's); it must "
        "exceed the round's noise multiplier z",
    )


class RecordDPConfig(_CodecDPConfig):
    """Record-level DP-SGD in local training around the method it sits in ([method.record_dp]; docs/privacy.md,
    "Record-level DP-SGD for the parameter-sharing methods"): every local SGD run of a client's fit samples its
    records (Poisson, expected batch ``method.batch_size``), clips each record's gradient to ``clip`` and adds
    the client's own Gaussian noise (add/remove one record); accounted per client with dp-accounting."""

    section = "record_dp"
    noise_multiplier: float | None = Field(
        None, gt=0, description="zeta, fixed noise std / C instead of calibrating it; a plan above epsilon is refused"
    )
    codec: Literal["fp32", "lrsuq", "ppr"] = Field(
        "fp32",
        description="DP-FedSGD's uplink when a round is one DP-SGD step (local_epochs = 1, batch_size >= every "
        "client's records): the step's clipped gradient sum sent by LRSUQ or PPR, which realise its Gaussian noise "
        "exactly in a padded message, instead of the new parameters in float32 (docs/privacy.md)",
    )


class LocalSGDConfig(Section):
    """Options every parameter-sharing method has (docs/pfl.md); a base's config model adds its ``name``
    and its own options."""

    model: Literal["lenet", "mlp", "dnn", "fedavgcnn"] = "lenet"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    vectorize: bool | Literal["auto"] = Field(
        "auto",
        description="run the clients of a round together (fl/batched.py: a hand-written backward over stacked "
        "client models; torch.func.vmap for other models); false: one client after another (same results to "
        "float rounding); auto: together, except a convolutional model without the hand-written backward on "
        "the CPU, where vmap is slower (docs/pfl.md)",
    )
    workers: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        0,
        description="worker processes for the per-client path (vectorize false, or auto on a model the clients "
        "cannot run together), each with this process's torch threads divided among them; 0: in this process; "
        "auto: one per torch thread on the CPU (0 with one thread); unused when the clients run together. "
        "Results equal the in-process path bit for bit at the same threads per process (docs/pfl.md)",
    )
    update_bound: float | None = Field(
        None,
        gt=0,
        description="bound on the norm of each client's shared update theta_i - theta_g (none: off); "
        "a longer update is rejected or clipped (update_bound_mode), which bounds one client's influence",
    )
    update_bound_mode: Literal["reject", "clip"] = "reject"
    unseen_finetune_epochs: int = Field(
        1,
        ge=0,
        description="epochs each unseen (Future) client fine-tunes on its own labelled records (its context, "
        "data.context_size) at every evaluation, from the global model, before its finetuned_accuracy; 0: only "
        "the as-is evaluation (finetuned_* then equal accuracy and loss). The fine-tuned model is discarded "
        "(docs/pfl.md, 'Unseen clients')",
    )
    fedlag: FedLAGConfig | None = Field(None, description="wrap the method in FedLAG ([method.fedlag] section)")
    client_dp: ClientDPConfig | None = Field(
        None, description="client-level DP, each client's own noise ([method.client_dp] section; under FedLAG)"
    )
    record_dp: RecordDPConfig | None = Field(
        None, description="record-level DP-SGD in local training ([method.record_dp] section; under FedLAG)"
    )
    server_dp: ServerDPConfig | None = Field(
        None, description="client-level DP, a trusted server's noise on the aggregate ([method.server_dp] section)"
    )


@dataclass
class SharedState:
    """Server state: the global value of every parameter, the wrapper-made personal names, the last round."""

    params: Params
    personal: frozenset[str] = frozenset()
    round: int = 0


@dataclass
class PersonalState:
    """A client's state: its model after its last round (every name) and method-specific tensors (Ditto's
    personal model, FedRoD's personal head), both kept on the client side of the API."""

    params: Params
    extra: Params = field(default_factory=dict)


@dataclass
class ClientBatch:
    """Clients that run the same local program in one round, executed together (:meth:`LocalTraining.sgd`)."""

    clients: list[ClientData]

    def stack(self, fn: Callable[[ClientData], torch.Tensor]) -> torch.Tensor:
        return torch.stack([fn(d) for d in self.clients])


def per_client(data: ClientData | ClientBatch, fn: Callable[[ClientData], torch.Tensor]) -> torch.Tensor:
    """``fn(data)`` for one client, stacked over the clients of a batch."""
    return data.stack(fn) if isinstance(data, ClientBatch) else fn(data)


#: What a wrapper (FedLAG) may use of the base it wraps, beyond the :class:`~fedtailor.fl.method.Method`
#: interface: ``name``; ``rounds``; ``batch_size``; ``model`` (its module structure, for grouping parameters into
#: layers; never its values); ``names`` (parameter names in order); ``shapes`` (name -> shape); ``own_personal``
#: (the base's own personal part ``O``); :meth:`~LocalTraining.start_model` (a client's starting model from a
#: message) and :meth:`~LocalTraining.logits`. Tested: FedLAG runs on a base that exposes nothing else.
WRAPPER_API = frozenset(
    {"name", "rounds", "batch_size", "model", "names", "shapes", "own_personal", "start_model", "logits"}
)


class LocalTraining(Method[SharedState, PersonalState]):
    """Base of the parameter-sharing methods. Subclasses set ``name``, may set ``own_personal`` in ``__init__``
    and override :meth:`local_program`, :meth:`init_extra` and :meth:`predict`. A wrapper uses only
    :data:`WRAPPER_API` of it."""

    name = "local-training"

    def __init__(
        self,
        *,
        model_fn: Callable[[], nn.Module],
        lr: float,
        local_epochs: int,
        batch_size: int,
        seed: int,
        device: torch.device,
        rounds: int,
        momentum: float = 0.0,
        vectorize: bool | Literal["auto"] = "auto",
        workers: int | Literal["auto"] = 0,
        train_sizes: Mapping[int, int] | None = None,
        update_bound: float | None = None,
        update_bound_mode: Literal["reject", "clip"] = "reject",
        unseen: Iterable[int] = (),
        unseen_finetune_epochs: int = 1,
    ) -> None:
        if unseen_finetune_epochs < 0:
            raise ValueError(f"unseen_finetune_epochs must be >= 0 (0: no fine-tuning), got {unseen_finetune_epochs}.")
        self.model = model_fn().to(device)  # one working module; parameters are passed functionally
        self.lr, self.local_epochs, self.batch_size, self.momentum = lr, local_epochs, batch_size, momentum
        self.seed, self.device, self.rounds = seed, device, rounds
        # what the server knows of each client: its partition size caps its aggregation weight (None: no cap)
        self.train_sizes = None if train_sizes is None else {int(c): int(n) for c, n in train_sizes.items()}
        self.update_bound, self.update_bound_mode = update_bound, update_bound_mode
        # the clients that never train (the server knows them from the partition), evaluated as in the module doc
        self.unseen, self.unseen_finetune_epochs = frozenset(int(c) for c in unseen), unseen_finetune_epochs
        self.theta0: Params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        # the model as a chain of layers with a hand-written backward (None: not one; vmap is the fallback)
        self.chain = try_compile(self.model)
        self.names = tuple(self.theta0)
        self.shapes = {n: t.shape for n, t in self.theta0.items()}
        self.own_personal: frozenset[str] = frozenset()
        # auto: together, except a convolutional model without the hand-written backward on the CPU, where vmap's
        # grouped convolutions are slower than one client after another (docs/pfl.md, bench_pfl_round.py)
        convolutional = any(isinstance(m, nn.modules.conv._ConvNd) for m in self.model.modules())
        slow = convolutional and self.device.type == "cpu" and self.chain is None
        self.vectorize = not slow if vectorize == "auto" else bool(vectorize)
        # the per-client path on worker processes (fl/workers.py), started at its first round; auto: one per thread
        if workers == "auto":
            workers = torch.get_num_threads() if device.type == "cpu" and torch.get_num_threads() > 1 else 0
        if workers and device.type != "cpu":
            raise ValueError(f"worker processes run clients on the CPU, not on {device}; set workers = 0.")
        self.pool = WorkerPool(self, workers=workers) if workers else None
        # record-level DP ([method.record_dp], methods/pfl/private.py): every local SGD run of a fit is DP-SGD
        self.private_sgd: PrivateSGD | None = None

    # ----- what subclasses change ---------------------------------------------------------------------
    def local_program(
        self, theta: Params, extra: Params, received: Params, data: ClientData | ClientBatch, rnd: int
    ) -> tuple[Params, Params, Any]:
        """The client's local work of round ``rnd`` from its starting model ``theta`` (``received`` holds the
        just-received global values of the shared names). Returns the new model, new extra state and the mean
        training loss. Default: ``local_epochs`` of SGD on cross-entropy over every parameter (FedAvg).

        Written once for one client; with a :class:`ClientBatch` every tensor carries a leading client axis and
        the loss is the mean per client (a list), which :meth:`sgd` and :func:`per_client` handle."""
        theta, loss = self.sgd(theta, data, rnd)
        return theta, extra, loss

    def _proximal_outside_clip(self, objective: Objective) -> bool:
        """Whether record-level DP-SGD adds ``objective``'s proximal term to the noisy gradient instead of clipping
        it with each record's: when the term is all the objective adds to the cross-entropy, without momentum and
        with ``eta mu <= 1``. Each step then contracts ``theta - anchor`` by ``1 - eta mu`` before its noisy move,
        so the release bound of the wrapper, a sum of the noisy moves, still holds."""
        plain_rest = objective.offset is None and not objective.personal_head and not objective.mixture
        return plain_rest and bool(objective.anchor) and not self.momentum and self.lr * objective.mu <= 1.0

    @functools.cached_property
    def _layerwise(self) -> bool:
        """Whether every parameter is a Linear or Conv2d weight or bias (record-level DP's batched clipped sums)."""
        try:
            model_layers(self.model)
        except ValueError:
            return False
        return True

    def fit_epochs(self) -> int:
        """Epochs of local SGD in one round's :meth:`local_program` (all its SGD runs together), which record-level
        DP plans its accounting with. Default: ``local_epochs`` (one run); a method with more runs says so."""
        return self.local_epochs

    def init_extra(self) -> Params:
        """Method-specific client tensors before a client's first round."""
        return {}

    def predict(self, theta: Params, extra: Params, *, data: ClientData, final: bool) -> tuple[Params, Params]:
        """What a client evaluates with (``final``: the run's last evaluation), passed to :meth:`eval_logits`.
        Default: its model as it stands."""
        return theta, extra

    def unseen_extra(self, theta: Params, extra: Params) -> Params:
        """The method-specific tensors an unseen client starts from, given its starting model ``theta`` (the
        server's global values, theta_0 for the method's own personal part) and :meth:`init_extra`. Default:
        :meth:`init_extra` as it is; a method whose personal state has a global counterpart starts it there
        (Ditto's and APFL's personal model: the global model; FedRoD's personal head: the generic head)."""
        return extra

    def finetune(
        self, theta: Params, extra: Params, received: Params, data: ClientData, rnd: int, epochs: int
    ) -> tuple[Params, Params]:
        """An unseen client's fine-tuning at the evaluation of round ``rnd``: ``epochs`` epochs of the method's
        own local objective on its training records, batches from the key ``(seed, "batches", rnd, client,
        "unseen")``. Default: SGD on cross-entropy over every parameter (FedAvg's, FedPer's and LG-FedAvg's local
        program, FedBABU's fine-tuning)."""
        theta, _ = self.sgd(theta, data, rnd, epochs=epochs, tag=(UNSEEN_TAG,))
        return theta, extra

    # ----- shared helpers -----------------------------------------------------------------------------
    def logits(self, theta: Params, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, theta, (x,))

    def ce_loss(self, theta: Params, aux: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(theta, x), y)

    def batches(self, rnd: int, cid: int, *tag: Any) -> torch.Generator:
        return torch_generator(self.seed, "batches", rnd, cid, *tag, device=self.device)

    def head_input_and_logits(self, theta: Params, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the representation entering the model's declared head, the logits)."""
        seen: list[torch.Tensor] = []
        mod = dict(self.model.named_modules())[head_module(self.model)]
        handle = mod.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        try:
            logits = functional_call(self.model, theta, (x,))
        finally:
            handle.remove()
        return seen[0], logits

    def apply_head(self, head: Params, rep: torch.Tensor) -> torch.Tensor:
        """The declared head with parameters ``head`` (by the head's parameter names) on ``rep``."""
        name = head_module(self.model)
        mod = dict(self.model.named_modules())[name]
        return functional_call(mod, {n[len(name) + 1 :]: t for n, t in head.items()}, (rep,))

    def objective_loss(self, objective: Objective) -> LossFn:
        """``objective`` (:class:`fedtailor.fl.batched.Objective`) for one client with autograd, its tensors read
        from ``aux`` (``objective.tensors()``): the definition the per-client path and the vmap fallback use."""
        o = objective

        def loss(p: Params, aux: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            theta = {n: p[n] for n in self.names}
            rep, z = self.head_input_and_logits(theta, x) if o.personal_head else (None, self.logits(theta, x))
            value = F.cross_entropy(z if o.offset is None else z + aux["offset"], y)
            if o.personal_head:
                phi = {name: p[key] for key, name in o.personal_head.items()}
                value = value + F.cross_entropy(z.detach() + self.apply_head(phi, rep.detach()), y)
            if o.mixture:
                alpha = p[o.alpha]
                mix = {n: t.detach() for n, t in theta.items()}
                mix.update({n: alpha * p[k] + (1 - alpha) * theta[n].detach() for k, n in o.mixture.items()})
                value = value + F.cross_entropy(self.logits(mix, x), y)
            if o.anchor:
                value = value + prox_term(theta, {n: aux[f"anchor/{n}"] for n in o.anchor}, o.mu)
            return value

        return loss

    def sgd(
        self,
        theta: Params,
        data: ClientData | ClientBatch,
        rnd: int,
        *,
        trainable: frozenset[str] | None = None,
        epochs: int | None = None,
        objective: Objective | None = None,
        loss: LossFn | None = None,
        aux: Params | None = None,
        tag: tuple[Any, ...] = (),
        project: Callable[[Params], Params] | None = None,
        lr: float | None = None,
    ) -> tuple[Params, Any]:
        """SGD of one client, or of a :class:`ClientBatch` at once (``theta`` and the objective's tensors then
        stacked along a leading client axis), on ``objective`` (default: cross-entropy; see
        :class:`~fedtailor.fl.batched.Objective` for the proximal term, logit offset, personal head and mixture)
        or on a custom ``loss(p, aux, x, y)`` written for one client (run by vmap for a batch). A batch runs on
        the hand-written backward (:func:`~fedtailor.fl.batched.explicit_sgd`) when the model and objective are
        covered, else on vmap (:func:`~fedtailor.fl.training.batched_sgd`). ``lr`` defaults to the method's."""
        trainable = frozenset(self.names if trainable is None else trainable)
        epochs = self.local_epochs if epochs is None else epochs
        custom, objective = loss is not None, objective or Objective()
        if custom and not objective.plain:
            raise ValueError("give either a custom loss or an objective.")
        if not custom:
            loss, aux = self.objective_loss(objective), objective.tensors()
            if objective.mixture and objective.alpha in trainable:
                alpha = objective.alpha
                project = lambda p: {alpha: p[alpha].clamp(0.0, 1.0)}
        lr = self.lr if lr is None else lr
        common = {"trainable": trainable, "batch_size": self.batch_size, "epochs": epochs, "lr": lr}
        common["momentum"] = self.momentum
        if self.private_sgd is not None and self.private_sgd.fitting is not None:
            if isinstance(data, ClientBatch):
                raise RuntimeError("record-level DP runs a round's clients one by one (vectorize is off).")
            x, y = data.train
            # the cross-entropy of a Linear/Conv2d model: clipped sums from one batched pass (a proximal term
            # added to the noisy gradient when that keeps the release bound, see _proximal_outside_clip)
            batched = not custom and self._layerwise
            prox = batched and self._proximal_outside_clip(objective)  # else the term stays in each record's loss
            model = self.model if batched and (objective.plain or prox) else None
            penalty = functools.partial(proximal_gradient, anchor=objective.anchor, mu=objective.mu) if prox else None
            return self.private_sgd.run(
                loss, theta, x, y, aux=aux, project=project, model=model, penalty=penalty, **common
            )
        if isinstance(data, ClientBatch):
            xs, ys = [d.train[0] for d in data.clients], [d.train[1] for d in data.clients]
            generators = [self.batches(rnd, d.cid, *tag) for d in data.clients]
            if not custom and supports(self.chain, objective, trainable, theta):
                return explicit_sgd(self.chain, theta, xs, ys, objective=objective, generators=generators, **common)
            return batched_sgd(loss, theta, xs, ys, generators=generators, aux=aux, project=project, **common)
        x, y = data.train
        return functional_sgd(
            loss, theta, x, y, generator=self.batches(rnd, data.cid, *tag), aux=aux, project=project, **common
        )

    def shared_names(self, server: SharedState) -> tuple[str, ...]:
        """``S = all - O - L`` in parameter order."""
        return tuple(n for n in self.names if n not in self.own_personal and n not in server.personal)

    # ----- server side --------------------------------------------------------------------------------
    def init_server(self) -> SharedState:
        return SharedState(params={n: t.clone() for n, t in self.theta0.items()})

    def configure_fit(self, server: SharedState, rnd: int, cid: int) -> Message:
        return Message(arrays={n: server.params[n] for n in self.shared_names(server)}, config={"round": rnd})

    def validate_reply(self, server: SharedState, phase: str, rnd: int, cid: int, reply: Message) -> None:
        expected = self.shared_names(server)
        if set(reply.arrays) != set(expected):
            missing, extra = sorted(set(expected) - set(reply.arrays)), sorted(set(reply.arrays) - set(expected))
            raise InvalidMessage(
                f"reply must carry exactly the shared parameters; missing {missing[:5]}, unexpected {extra[:5]}."
            )
        reply.only(arrays=set(expected), config={"num_examples", "loss"})
        for n in expected:
            reply.array(n, shape=tuple(self.theta0[n].shape), dtype=self.theta0[n].dtype)
        check_weight(reply, cid, self.train_sizes)
        reply.value("loss", float)
        if self.update_bound is not None and self.update_bound_mode == "reject":
            norm = self._update_norm(server, reply)
            if norm > self.update_bound:
                raise InvalidMessage(f"update norm {norm:.4g} exceeds update_bound {self.update_bound:g}.")

    def _update_norm(self, server: SharedState, reply: Message) -> float:
        """``||theta_i[S] - theta_g[S]||`` of a reply, in float64."""
        sq = sum(
            float((reply.arrays[n].double() - server.params[n].double().to(reply.arrays[n].device)).pow(2).sum())
            for n in self.shared_names(server)
        )
        return math.sqrt(sq)

    def aggregate_fit(self, server: SharedState, rnd: int, replies: dict[int, Message]) -> tuple[SharedState, Metrics]:
        weights = torch.tensor(
            [float(r.config["num_examples"]) for r in replies.values()], device=self.device, dtype=torch.float64
        )
        w = (weights / weights.sum()).to(torch.float32)
        params = dict(server.params)
        names = self.shared_names(server)
        if self.update_bound is not None and self.update_bound_mode == "clip":
            replies = {c: self._clipped(server, r, names) for c, r in replies.items()}
        for n in names:
            stacked = torch.stack([r.arrays[n].to(self.device) for r in replies.values()])
            params[n] = torch.tensordot(w, stacked, dims=1)
        loss = float(sum(float(r.config["loss"]) * wi for r, wi in zip(replies.values(), w.tolist())))
        return SharedState(params=params, personal=server.personal, round=rnd), {"loss": loss}

    def _clipped(self, server: SharedState, reply: Message, names: tuple[str, ...]) -> Message:
        """``reply`` with its update ``theta_i[S] - theta_g[S]`` scaled down to norm ``update_bound`` if longer."""
        scale = min(1.0, float(self.update_bound) / max(self._update_norm(server, reply), 1e-300))
        if scale == 1.0:
            return reply
        arrays = {
            n: server.params[n].to(reply.arrays[n].device)
            + scale * (reply.arrays[n] - server.params[n].to(reply.arrays[n].device))
            for n in names
        }
        return Message(arrays=arrays, config=reply.config)

    def configure_evaluate(self, server: SharedState, cid: int) -> Message:
        """A seen client gets the shared names ``S``. An unseen client gets every name the server holds a global
        value of (``S`` and a wrapper's personal layers ``L`` at their last average; not the method's own part
        ``O``, which the server never changes from theta_0), flagged ``unseen``, with the round that keys its
        fine-tuning."""
        final = server.round >= self.rounds
        if cid in self.unseen:
            arrays = {n: server.params[n] for n in self.names if n not in self.own_personal}
            return Message(arrays=arrays, config={"final": final, "unseen": True, "round": server.round})
        return Message(arrays={n: server.params[n] for n in self.shared_names(server)}, config={"final": final})

    # ----- client side --------------------------------------------------------------------------------
    def init_client(self, cid: int) -> PersonalState:
        return PersonalState(params={n: t.clone() for n, t in self.theta0.items()}, extra=self.init_extra())

    def start_model(self, msg: Message, state: PersonalState | None) -> tuple[Params, Params, Params]:
        """(starting model, extra state, received values) of a client receiving ``msg``."""
        state = state if state is not None else self.init_client(-1)
        received = {n: t.to(self.device) for n, t in msg.arrays.items() if n in self.theta0}
        return {**state.params, **received}, state.extra, received

    def client_fit(self, msg: Message, state: PersonalState | None, data: ClientData) -> tuple[Message, PersonalState]:
        theta, extra, received = self.start_model(msg, state)
        theta, extra, loss = self.local_program(theta, extra, received, data, int(msg.config["round"]))
        _check_loss(loss, data.cid, int(msg.config["round"]))
        reply = Message(
            arrays={n: theta[n].detach() for n in received},
            config={"num_examples": len(data.train[1]), "loss": float(loss)},
        )
        return reply, PersonalState(params={n: t.detach() for n, t in theta.items()}, extra=extra)

    def client_fit_many(
        self, msgs: dict[int, Message], states: dict[int, PersonalState | None], data: dict[int, ClientData]
    ) -> dict[int, tuple[Message, PersonalState]]:
        """The round's local programs of all ``msgs`` executed together (``vectorize``): the clients' starting
        models are stacked and :meth:`local_program` runs once on the stack. Same results as one
        :meth:`client_fit` per client, to float rounding (tested). Otherwise one :meth:`client_fit` per client,
        on the worker processes when there are (``workers``; bit for bit the in-process results)."""
        if not self.vectorize and self.pool is not None:
            return self.pool.client_fit_many(msgs, states, data)
        cids = sorted(msgs)
        names = {frozenset(msgs[c].arrays) for c in cids}
        if not self.vectorize or len(cids) < 2 or len(names) > 1 or len({msgs[c].config["round"] for c in cids}) > 1:
            return super().client_fit_many(msgs, states, data)
        starts = [self.start_model(msgs[c], states.get(c)) for c in cids]
        theta = {n: torch.stack([s[0][n] for s in starts]) for n in self.names}
        extra = {n: torch.stack([s[1][n] for s in starts]) for n in starts[0][1]}
        received = {n: torch.stack([s[2][n] for s in starts]) for n in starts[0][2]}
        batch = ClientBatch([data[c] for c in cids])
        theta, extra, losses = self.local_program(theta, extra, received, batch, int(msgs[cids[0]].config["round"]))
        out = {}
        for j, c in enumerate(cids):
            _check_loss(losses[j], c, int(msgs[c].config["round"]))
            reply = Message(
                arrays={n: theta[n][j].detach() for n in received},
                config={"num_examples": len(data[c].train[1]), "loss": float(losses[j])},
            )
            out[c] = (
                reply,
                PersonalState(
                    params={n: t[j].detach() for n, t in theta.items()},
                    extra={n: t[j].detach() for n, t in extra.items()},
                ),
            )
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def client_evaluate(self, msg: Message, state: PersonalState | None, data: ClientData) -> Metrics:
        if msg.config.get("unseen", False):
            return self.evaluate_unseen(msg, data)
        theta, extra, _ = self.start_model(msg, state)
        acc, loss = self._accuracy_and_loss(theta, extra, data, final=bool(msg.config.get("final", False)))
        return {"accuracy": acc, "loss": loss, "num_examples": float(len(data.eval[1]))}

    def evaluate_unseen(self, msg: Message, data: ClientData) -> Metrics:
        """An unseen client, which never trained: ``accuracy``/``loss`` of the model it starts from (the
        received global values, theta_0 for the method's own personal part, :meth:`unseen_extra`) through the
        method's predictor, and ``finetuned_accuracy``/``finetuned_loss`` after :meth:`finetune` for
        ``unseen_finetune_epochs`` from there (equal to the first two at 0 epochs). Nothing is kept: the
        fine-tuned model is dropped and the client state is neither read nor written."""
        theta, extra, received = self.start_model(msg, None)
        extra = self.unseen_extra(theta, extra)
        acc, loss = self._accuracy_and_loss(theta, extra, data, final=False)
        metrics = {"accuracy": acc, "loss": loss, "num_examples": float(len(data.eval[1]))}
        if self.unseen_finetune_epochs:
            if data.train is None or len(data.train[1]) == 0:
                raise ValueError(
                    f"unseen client {data.cid} has no labelled records to fine-tune on; set data.context_size > 0 "
                    "or method.unseen_finetune_epochs = 0."
                )
            rnd = int(msg.config["round"])
            theta, extra = self.finetune(theta, extra, received, data, rnd, self.unseen_finetune_epochs)
            acc, loss = self._accuracy_and_loss(theta, extra, data, final=False)
        return {**metrics, "finetuned_accuracy": acc, "finetuned_loss": loss}

    def _accuracy_and_loss(self, theta: Params, extra: Params, data: ClientData, *, final: bool) -> tuple[float, float]:
        params, extra = self.predict(theta, extra, data=data, final=final)
        return accuracy_and_loss_of(lambda xb: self.eval_logits(params, extra, xb), *data.eval)

    def eval_logits(self, params: Params, extra: Params, x: torch.Tensor) -> torch.Tensor:
        """Logits a client predicts with (FedRoD adds its personal head)."""
        return self.logits(params, x)


def _check_loss(loss: float, cid: int, rnd: int) -> None:
    """A client whose local training went non-finite stops the run (in simulation) instead of sending NaN."""
    if not math.isfinite(float(loss)):
        raise TrainingDiverged(f"round {rnd}: client {cid}'s local training loss is {float(loss)}")


def prox_term(theta: Params, anchor: Params, mu: float) -> torch.Tensor:
    """(mu / 2) sum_n ||theta[n] - anchor[n]||^2 over the names of ``anchor``."""
    return 0.5 * mu * sum((theta[n] - a).pow(2).sum() for n, a in anchor.items())


def proximal_gradient(theta: Params, *, anchor: Params, mu: float) -> Params:
    """The gradient of :func:`prox_term`: ``mu (theta[n] - anchor[n])`` for the names of ``anchor``."""
    return {n: mu * (theta[n] - a) for n, a in anchor.items()}
