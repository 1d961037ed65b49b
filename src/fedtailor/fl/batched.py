"""Local SGD of the clients of a round at once, with a hand-written backward: every op of a step covers every
client still training, and no autograd or ``torch.func`` runs per step.

A model is *supported* when its ``forward`` is a chain (:func:`compile_chain`, read with ``torch.fx``) of
``Linear``, ``Conv2d`` (one group), ``ReLU``, ``max_pool2d`` (no padding), ``flatten`` and elementwise
arithmetic with constants (the input normalisation): the pFL models of :mod:`fedtailor.models.pflnets` and the
MLP are. Client parameters are stacked along a leading client axis ``A`` and activations are ``(A, B, ...)``;

* ``Linear``: forward ``baddbmm``, backward ``dW = g^T h``, ``db = sum_b g``, ``dh = g W`` (batched over clients);
* ``Conv2d``: one convolution with ``A`` groups over all clients (forward and ``convolution_backward``; oneDNN
  on the CPU, cuDNN on CUDA): feature maps live as one channels-last batch ``(B, A C, H, W)``, client ``a``'s
  channels in group ``a``, viewed as ``(A, B, C, H, W)`` between layers (no copies from one convolution to the
  next). On the CPU the channels-last grouped kernels run faster than one convolution per client, most of all
  for a single-channel first layer, whose per-client weight gradient oneDNN vectorises poorly (docs/pfl.md);
  pooling runs on the same layout;
* ``ReLU``, ``max_pool2d``, ``flatten``: one op over all clients (``threshold_backward``,
  ``max_pool2d_with_indices_backward``: autograd's own backward kernels); a ReLU followed by a max-pool runs as
  the pool then the ReLU (the same values and gradients exactly, on a quarter of the entries);
* the loss: softmax cross-entropy (mean over the batch) of the logits plus an optional per-client logit offset
  (FedRoD's balanced softmax) plus an optional proximal term ``(mu / 2) ||theta[n] - anchor[n]||^2``
  (FedProx, Ditto); its gradient ``(softmax - onehot) / B`` and ``mu (theta - anchor)``.

Parameter-free ops before the first parametric layer (the normalisation, a flatten) are applied to every record
once per call rather than per batch. Clients are packed: sorted by their number of full batches, so the ones
still training at a step are a prefix of the stack (views, no padding and no copies); each client's smaller last
batch is stepped afterwards, clients with the same remainder together. Each client sees exactly the batches of
its own :func:`fedtailor.fl.training.functional_sgd` run (the orders come from its own generator), so the results
equal the per-client path to float rounding (``batched_test.py``). Device-agnostic (CPU or CUDA).
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fedtailor.models.parts import channels_last

Params = dict[str, torch.Tensor]


class Unsupported(Exception):
    """The model is not a chain of the layers this engine differentiates by hand."""


class Sink(ABC):
    """Where a backward pass puts the gradients of the names in ``want``: :meth:`bmm` (a batched product) and
    :meth:`add` (a tensor), each a contribution to one name's gradient."""

    want: frozenset[str]

    def bmm(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        self.add(name, torch.bmm(a, b))

    @abstractmethod
    def add(self, name: str, g: torch.Tensor, alpha: float = 1.0) -> None:
        """Add ``alpha * g`` to the gradient of ``name``."""


class Collect(Sink):
    """Gradients into a dict (summed by name)."""

    def __init__(self, want: frozenset[str]) -> None:
        self.want, self.grads = want, {}

    def add(self, name, g, alpha=1.0):
        g = g if alpha == 1.0 else alpha * g
        self.grads[name] = self.grads[name] + g if name in self.grads else g


class SGDStep(Sink):
    """One SGD step of ``theta[n][rows]`` applied as the gradient contributions arrive: without momentum
    ``theta -= lr g`` in place (a weight gradient ``a @ b`` fused into ``baddbmm_``: the gradient is never
    stored), with momentum ``v = momentum v + g`` (as ``torch.optim.SGD``) and ``theta -= lr v`` at
    :meth:`finish`. ``rows``: a slice (the prefix of clients still training: views) or an index tensor."""

    def __init__(self, theta: Params, velocity: Params, want: frozenset[str], rows, lr: float, momentum: float):
        self.theta, self.velocity, self.want, self.rows = theta, velocity, want, rows
        self.lr, self.momentum, self.view = lr, momentum, isinstance(rows, slice)
        self.started: dict[str, torch.Tensor] = {}

    def _velocity(self, name: str) -> tuple[torch.Tensor, bool]:
        """(this step's velocity rows, whether this is the name's first contribution in the step)."""
        if name in self.started:
            return self.started[name], False
        v = self.velocity[name][self.rows]
        self.started[name] = v
        return v, True

    def bmm(self, name, a, b):
        if self.momentum:
            v, first = self._velocity(name)
            v.baddbmm_(a, b, beta=self.momentum if first else 1.0)
        elif self.view:
            self.theta[name][self.rows].baddbmm_(a, b, alpha=-self.lr)
        else:
            self.theta[name].index_add_(0, self.rows, torch.bmm(a, b), alpha=-self.lr)

    def add(self, name, g, alpha=1.0):
        if self.momentum:
            v, first = self._velocity(name)
            if first:
                v.mul_(self.momentum)
            v.add_(g, alpha=alpha)
        elif self.view:
            self.theta[name][self.rows].sub_(g, alpha=self.lr * alpha)
        else:
            self.theta[name].index_add_(0, self.rows, g, alpha=-self.lr * alpha)

    def finish(self) -> None:
        for name in self.want:
            if not self.momentum:
                return
            v, first = self._velocity(name)
            if first:  # no contribution this step: the velocity still decays and steps
                v.mul_(self.momentum)
            if self.view:
                self.theta[name][self.rows].sub_(v, alpha=self.lr)
            else:
                self.velocity[name][self.rows] = v
                self.theta[name].index_add_(0, self.rows, v, alpha=-self.lr)


# ----- layers: forward over (A, B, ...) with stacked parameters, backward by hand ---------------------------


@dataclass
class Layer(ABC):
    names: tuple[str, ...] = ()  # parameter names (weight, bias)

    @abstractmethod
    def forward(self, p: Params, h: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The layer's output for the stacked input ``h`` and what its backward needs."""

    @abstractmethod
    def backward(self, p: Params, g: torch.Tensor, ctx: Any, sink: Sink, need_input: bool) -> torch.Tensor | None:
        """Hands the gradients of its parameters to ``sink`` (after computing the input's gradient, which it
        returns if needed: a sink may update the parameters in place)."""


def _grouped(h: torch.Tensor) -> torch.Tensor:
    """The clients' feature maps ``(A, B, C, H, W)`` as one channels-last batch ``(B, A C, H, W)`` whose channels
    ``a C .. a C + C - 1`` are client ``a``'s, the input of one convolution with ``A`` groups: a view when ``h``
    came from :func:`_per_client` (memory ``(B, H, W, A, C)``), one copy otherwise."""
    a, b, c, height, width = h.shape
    return channels_last(h.transpose(0, 1).reshape(b, a * c, height, width))


def _per_client(t: torch.Tensor, clients: int) -> torch.Tensor:
    """``(B, A C, H, W)`` back to the clients' ``(A, B, C, H, W)`` (a view)."""
    return t.unflatten(1, (clients, -1)).transpose(0, 1)


@dataclass
class Linear(Layer):
    def forward(self, p, h):
        w = p[self.names[0]]
        out = (
            torch.bmm(h, w.transpose(1, 2))
            if len(self.names) == 1
            else torch.baddbmm(p[self.names[1]].unsqueeze(1), h, w.transpose(1, 2))
        )
        return out, h

    def backward(self, p, g, ctx, sink, need_input):
        w = self.names[0]
        out = torch.bmm(g, p[w]) if need_input else None
        if w in sink.want:
            sink.bmm(w, g.transpose(1, 2), ctx)
        if len(self.names) > 1 and self.names[1] in sink.want:
            sink.add(self.names[1], g.sum(1))
        return out


@dataclass
class Conv2d(Layer):
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)

    def forward(self, p, h):
        clients = len(h)
        x = _grouped(h)
        w = channels_last(p[self.names[0]].flatten(0, 1))  # (A C_out, C_in, k, k): client a's filters in group a
        b = p[self.names[1]].flatten() if len(self.names) > 1 else None
        out = F.conv2d(x, w, b, self.stride, self.padding, self.dilation, clients)
        return _per_client(out, clients), (x, w)

    def backward(self, p, g, ctx, sink, need_input):
        x, w = ctx
        has_bias = len(self.names) > 1
        mask = [need_input, self.names[0] in sink.want, has_bias and self.names[1] in sink.want]
        if not any(mask):
            return None
        clients = len(g)
        gi, gw, gb = torch.ops.aten.convolution_backward(
            _grouped(g),
            x,
            w,
            [w.shape[0]] if has_bias else None,
            list(self.stride),
            list(self.padding),
            list(self.dilation),
            False,
            [0, 0],
            clients,
            mask,
        )
        if mask[1]:
            sink.add(self.names[0], gw.unflatten(0, (clients, -1)))
        if mask[2]:
            sink.add(self.names[1], gb.unflatten(0, (clients, -1)))
        return _per_client(gi, clients) if need_input else None


@dataclass
class ReLU(Layer):
    def forward(self, p, h):
        out = torch.relu(h)
        return out, out

    def backward(self, p, g, ctx, sink, need_input):
        return torch.ops.aten.threshold_backward(g, ctx, 0) if need_input else None


@dataclass
class MaxPool2d(Layer):
    kernel: tuple[int, int] = (2, 2)
    stride: tuple[int, int] = (2, 2)

    def forward(self, p, h):
        x = _grouped(h)
        out, idx = torch.ops.aten.max_pool2d_with_indices(x, list(self.kernel), list(self.stride), [0, 0])
        return _per_client(out, len(h)), (x, idx)

    def backward(self, p, g, ctx, sink, need_input):
        if not need_input:
            return None
        x, idx = ctx
        gi = torch.ops.aten.max_pool2d_with_indices_backward(
            _grouped(g), x, list(self.kernel), list(self.stride), [0, 0], [1, 1], False, idx
        )
        return _per_client(gi, len(g))


@dataclass
class Flatten(Layer):
    def forward(self, p, h):
        return h.reshape(*h.shape[:2], -1), h.shape

    def backward(self, p, g, ctx, sink, need_input):
        return g.reshape(ctx) if need_input else None


@dataclass
class Constant(Layer):
    """``h op c`` for a Python number ``c`` (``op``: add, sub, mul, truediv; ``reverse``: ``c op h``)."""

    op: Any = operator.add
    value: float = 0.0
    reverse: bool = False

    def forward(self, p, h):
        return (self.op(self.value, h) if self.reverse else self.op(h, self.value)), None

    def backward(self, p, g, ctx, sink, need_input):
        if not need_input:
            return None
        if self.op is operator.add:
            return g
        if self.op is operator.sub:
            return -g if self.reverse else g
        return g * self.value  # mul


@dataclass
class Chain:
    """A model as layers in order; ``start``: the index of the first layer with parameters."""

    layers: list[Layer]
    start: int = 0
    names: tuple[str, ...] = field(default_factory=tuple)


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else (int(v[0]), int(v[1]))


def compile_chain(model: nn.Module) -> Chain:
    """The layers of ``model``'s forward in order (``torch.fx``); :class:`Unsupported` when it is not a chain of
    the supported layers or does not use every parameter exactly once."""
    try:
        graph = fx.symbolic_trace(model).graph
    except Exception as e:  # control flow on values, unsupported Python
        raise Unsupported(f"torch.fx cannot trace {type(model).__name__}: {e}") from e
    modules = dict(model.named_modules())
    layers: list[Layer] = []
    prev: fx.Node | None = None

    def operand(node: fx.Node) -> tuple[Any, ...]:
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        if len(tensors) != 1 or tensors[0] is not prev or any(isinstance(v, fx.Node) for v in node.kwargs.values()):
            raise Unsupported(f"{node.format_node()} is not a step of a chain")
        return node.args

    for node in graph.nodes:
        if node.op == "placeholder":
            if prev is not None:
                raise Unsupported("more than one input")
            prev = node
            continue
        if node.op == "output":
            if node.args[0] is not prev:
                raise Unsupported("the output is not the last layer")
            break
        args = operand(node)
        if node.op == "call_module":
            mod, name = modules[node.target], node.target
            if type(mod) is nn.Linear:
                layers.append(Linear(names=(f"{name}.weight",) + ((f"{name}.bias",) if mod.bias is not None else ())))
            elif (
                type(mod) is nn.Conv2d
                and mod.groups == 1
                and mod.padding_mode == "zeros"
                and isinstance(mod.padding, tuple)
            ):
                layers.append(
                    Conv2d(
                        names=(f"{name}.weight",) + ((f"{name}.bias",) if mod.bias is not None else ()),
                        stride=_pair(mod.stride),
                        padding=_pair(mod.padding),
                        dilation=_pair(mod.dilation),
                    )
                )
            elif type(mod) is nn.ReLU:
                layers.append(ReLU())
            elif type(mod) is nn.Flatten and mod.start_dim == 1 and mod.end_dim == -1:
                layers.append(Flatten())
            elif type(mod) is nn.MaxPool2d and not mod.ceil_mode and mod.padding == 0 and mod.dilation == 1:
                layers.append(MaxPool2d(kernel=_pair(mod.kernel_size), stride=_pair(mod.stride or mod.kernel_size)))
            else:
                raise Unsupported(f"module {name} ({type(mod).__name__})")
        elif node.op in ("call_function", "call_method"):
            layers.append(_function_layer(node, args))
        else:
            raise Unsupported(f"{node.op} {node.target}")
        prev = node
    for i in range(len(layers) - 1):
        # relu(maxpool(h)) = maxpool(relu(h)) (relu is monotone), with the same gradient (both route it to the
        # window's maximum, and to nothing when that is <= 0): pooling first runs the ReLU on a quarter of the values
        if isinstance(layers[i], ReLU) and isinstance(layers[i + 1], MaxPool2d):
            layers[i], layers[i + 1] = layers[i + 1], layers[i]
    names = tuple(n for layer in layers for n in layer.names)
    params = tuple(n for n, _ in model.named_parameters())
    if sorted(names) != sorted(params):
        raise Unsupported("the chain does not use every parameter exactly once")
    start = next((i for i, layer in enumerate(layers) if layer.names), len(layers))
    return Chain(layers=layers, start=start, names=names)


_RELU = {torch.relu, F.relu, "relu"}
_POOL = {torch.max_pool2d, F.max_pool2d}
_ARITH = {operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul}


def _function_layer(node: fx.Node, args: tuple[Any, ...]) -> Layer:
    target, kw = node.target, dict(node.kwargs)
    if target in _RELU and len(args) == 1 and not kw.get("inplace", False):
        return ReLU()
    if target in (torch.flatten, "flatten"):
        start = args[1] if len(args) > 1 else kw.get("start_dim", 0)
        end = args[2] if len(args) > 2 else kw.get("end_dim", -1)
        if start == 1 and end == -1:
            return Flatten()
    if target in _POOL:
        kernel = args[1] if len(args) > 1 else kw.get("kernel_size")
        stride = args[2] if len(args) > 2 else kw.get("stride")
        padding = args[3] if len(args) > 3 else kw.get("padding", 0)
        dilation = args[4] if len(args) > 4 else kw.get("dilation", 1)
        ceil = args[5] if len(args) > 5 else kw.get("ceil_mode", False)
        if _pair(padding) == (0, 0) and _pair(dilation) == (1, 1) and not ceil and not kw.get("return_indices"):
            return MaxPool2d(kernel=_pair(kernel), stride=_pair(stride if stride not in (None, []) else kernel))
    if len(args) == 2 and isinstance(args[1 if isinstance(args[0], fx.Node) else 0], int | float) and not kw:
        reverse = not isinstance(args[0], fx.Node)
        value = float(args[0] if reverse else args[1])
        if target in _ARITH:
            return Constant(op=_ARITH[target], value=value, reverse=reverse)
        if target is operator.truediv and not reverse:
            return _Div(value=value)
    raise Unsupported(f"{node.format_node()}")


@dataclass
class _Div(Layer):
    """``h / c`` (kept as a division: the same values as the model's forward)."""

    value: float = 1.0

    def forward(self, p, h):
        return h / self.value, None

    def backward(self, p, g, ctx, sink, need_input):
        return g / self.value if need_input else None


def try_compile(model: nn.Module) -> Chain | None:
    try:
        return compile_chain(model)
    except Unsupported:
        return None


# ----- one gradient step of A clients ------------------------------------------------------------------------


@dataclass
class Objective:
    """The local objective per client, beyond plain cross-entropy ``CE(f_theta(x), y)`` (the default):

    * ``mu``, ``anchor``: plus ``(mu / 2) sum_n ||theta[n] - anchor[n]||^2`` over the names of ``anchor``
      (FedProx, Ditto);
    * ``offset``: the cross-entropy of ``f_theta(x) + offset`` (FedRoD's balanced softmax: log class counts);
    * ``personal_head`` (key -> name of a parameter of the model's last ``Linear``): plus
      ``CE(stopgrad(f_theta(x)) + phi(stopgrad(r)), y)``, ``phi`` that layer with the parameters under the keys and
      ``r`` its input (FedRoD's personal head);
    * ``mixture`` (key -> parameter name) and ``alpha`` (a key): plus ``CE(f_mix(x), y)`` with ``mix = alpha v +
      (1 - alpha) stopgrad(theta)``, ``v`` the parameters under the mixture keys, ``alpha`` projected onto
      [0, 1] after every step (APFL).

    The tensors are per client (stacked along the client axis for the engine)."""

    mu: float = 0.0
    anchor: Params = field(default_factory=dict)
    offset: torch.Tensor | None = None
    personal_head: dict[str, str] = field(default_factory=dict)
    mixture: dict[str, str] = field(default_factory=dict)
    alpha: str | None = None

    @property
    def plain(self) -> bool:
        """Plain cross-entropy (nothing added)."""
        return not (self.mu or self.anchor or self.offset is not None or self.personal_head or self.mixture)

    def tensors(self) -> Params:
        """The per-client tensors by key (``anchor/<name>``, ``offset``)."""
        out = {f"anchor/{n}": a for n, a in self.anchor.items()}
        return out if self.offset is None else {**out, "offset": self.offset}

    def with_tensors(self, tensors: Params) -> Objective:
        """This objective with :meth:`tensors` replaced by ``tensors`` (e.g. one client's rows)."""
        anchor = {n: tensors[f"anchor/{n}"] for n in self.anchor}
        return Objective(self.mu, anchor, tensors.get("offset"), self.personal_head, self.mixture, self.alpha)


def _cross_entropy(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean softmax cross-entropy per client, its gradient with respect to the logits ``z``, ``(A, B, K)``)."""
    logp = torch.log_softmax(z, -1)
    target = y.unsqueeze(-1)
    loss = logp.gather(-1, target).mean((1, 2)).neg_()
    g = logp.exp_()
    g.scatter_add_(-1, target, torch.full_like(target, -1, dtype=g.dtype))
    return loss, g.div_(y.shape[1])


def forward_pass(chain: Chain, p: Params, want: frozenset[str], h: torch.Tensor) -> tuple[torch.Tensor, list[Any], int]:
    """(logits, the layers' saved inputs, the index of the lowest layer the backward must reach)."""
    layers = chain.layers[chain.start :]
    lowest = next((i for i, layer in enumerate(layers) if set(layer.names) & want), len(layers))
    ctxs = []
    for i, layer in enumerate(layers):
        h, ctx = layer.forward(p, h)
        ctxs.append(ctx if i >= lowest or i == len(layers) - 1 else None)
    return h, ctxs, lowest


def backward_pass(chain: Chain, p: Params, g: torch.Tensor, ctxs: list[Any], lowest: int, sink: Sink) -> None:
    layers = chain.layers[chain.start :]
    for i in range(len(layers) - 1, lowest - 1, -1):
        g = layers[i].backward(p, g, ctxs[i], sink, need_input=i > lowest)


def gradient_step(
    chain: Chain,
    theta: Params,
    sink: Sink,
    h: torch.Tensor,
    y: torch.Tensor,
    objective: Objective,
    rows: slice | torch.Tensor,
) -> torch.Tensor:
    """The gradient of ``objective`` for the names in ``sink.want`` of clients ``theta[n][rows]`` on the
    batches ``h`` (``(A, B, ...)``, after the chain's parameter-free prefix) with labels ``y`` (``(A, B)``),
    handed to ``sink`` (which may update ``theta`` in place: every term is computed from the values at the start
    of the step before the main backward runs). Returns the loss per client."""
    p = {n: t[rows] for n, t in theta.items()}
    obj, want = objective, sink.want
    offset = None if obj.offset is None else obj.offset[rows]
    logits, ctxs, lowest = forward_pass(chain, p, want, h)
    loss, g = _cross_entropy(logits if offset is None else logits + offset.unsqueeze(1), y)
    later: list[tuple[str, torch.Tensor]] = []  # contributions of the other terms, handed over after the backward
    for n, a in obj.anchor.items():
        d = p[n] - a[rows]
        if n in want:
            later.append((n, obj.mu * d))
        loss = loss + 0.5 * obj.mu * d.pow(2).flatten(1).sum(1)
    if obj.personal_head:
        head = chain.layers[-1]
        phi = {name: p[key] for key, name in obj.personal_head.items()}
        z, _ = head.forward(phi, ctxs[-1])
        extra, g_phi = _cross_entropy(logits + z, y)
        got = Collect(frozenset(head.names))
        head.backward(phi, g_phi, ctxs[-1], got, need_input=False)
        later += [(key, got.grads[name]) for key, name in obj.personal_head.items() if key in want]
        loss = loss + extra
    if obj.mixture:
        v = {name: p[key] for key, name in obj.mixture.items()}
        alpha = {n: p[obj.alpha].reshape(-1, *[1] * (t.ndim - 1)) for n, t in v.items()}  # broadcast per client
        mix = {**p, **{n: alpha[n] * v[n] + (1 - alpha[n]) * p[n] for n in v}}
        got = Collect(frozenset(v))
        mixed_logits, mix_ctxs, mix_lowest = forward_pass(chain, mix, got.want, h)
        extra, g_mix = _cross_entropy(mixed_logits, y)
        backward_pass(chain, mix, g_mix, mix_ctxs, mix_lowest, got)
        later += [(key, alpha[name] * got.grads[name]) for key, name in obj.mixture.items() if key in want]
        if obj.alpha in want:
            later.append((obj.alpha, sum(((v[n] - p[n]) * got.grads[n]).flatten(1).sum(1) for n in v)))
        loss = loss + extra
    backward_pass(chain, p, g, ctxs, lowest, sink)
    for n, t in later:
        sink.add(n, t)
    return loss


def supports(chain: Chain | None, objective: Objective, trainable: Collection[str], names: Collection[str]) -> bool:
    """Whether :func:`explicit_sgd` runs this objective on this chain (else: the autograd fallback)."""
    if chain is None:
        return False
    keys = set(chain.names) | set(objective.personal_head) | set(objective.mixture) | {objective.alpha} - {None}
    if not set(trainable) <= keys or not set(chain.names) <= set(names):
        return False
    if objective.personal_head and not (
        isinstance(chain.layers[-1], Linear) and set(objective.personal_head.values()) == set(chain.layers[-1].names)
    ):
        return False
    return not objective.mixture or (
        objective.alpha is not None and set(objective.mixture.values()) <= set(chain.names)
    )


def explicit_sgd(
    chain: Chain,
    params: Params,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    *,
    trainable: Collection[str],
    epochs: int,
    batch_size: int,
    lr: float,
    generators: list[torch.Generator],
    objective: Objective | None = None,
    momentum: float = 0.0,
) -> tuple[Params, list[float]]:
    """:func:`fedtailor.fl.training.batched_sgd` with the hand-written backward of ``chain``: ``epochs`` of
    minibatch SGD of ``C`` clients on :class:`Objective` (default: cross-entropy), ``params`` (and the
    objective's ``anchor`` and ``offset``) stacked along a leading client axis, client ``c``'s batch order from
    ``generators[c]``. Returns the new parameters (the inputs are not modified) and each client's mean loss."""
    count_c = len(xs)
    if not (len(ys) == len(generators) == count_c) or any(len(x) == 0 for x in xs):
        raise ValueError("explicit_sgd needs one non-empty (x, y, generator) per client.")
    unknown = set(trainable) - set(params)
    if unknown:
        raise ValueError(f"trainable names not among the parameters: {sorted(unknown)[:5]}.")
    objective = objective or Objective()
    names = [n for n in params if n in set(trainable)]
    want = frozenset(names)
    sizes = [len(x) for x in xs]
    full = [n // batch_size for n in sizes]
    perm = sorted(range(count_c), key=lambda c: -full[c])  # stack order: most full batches first
    device = xs[0].device
    inv = torch.tensor(perm).argsort().to(device)
    perm_t = torch.tensor(perm, device=device)
    theta = {n: t.detach()[perm_t].clone() for n, t in params.items()}
    obj = objective.with_tensors({k: t.detach()[perm_t] for k, t in objective.tensors().items()})
    velocity = {n: torch.zeros_like(theta[n]) for n in names} if momentum else {}
    with torch.no_grad():
        x_all = torch.cat([xs[c] for c in perm]).unsqueeze(0)
        for layer in chain.layers[: chain.start]:  # the parameter-free prefix, once for every record
            x_all, _ = layer.forward({}, x_all)
        x_all = x_all.squeeze(0)
    y_all = torch.cat([ys[c] for c in perm])
    offsets = [0, *torch.tensor([sizes[c] for c in perm]).cumsum(0).tolist()[:-1]]
    full_s = [full[c] for c in perm]
    totals = torch.zeros(count_c, dtype=torch.float64, device=device)

    def project() -> None:  # APFL's alpha onto [0, 1] (elementwise: the clients that did not step keep theirs)
        if objective.mixture and objective.alpha in want:
            theta[objective.alpha].clamp_(0.0, 1.0)

    with torch.no_grad():
        for _ in range(epochs):
            orders = [
                torch.randperm(sizes[c], generator=generators[c], device=generators[c].device).to(device) + offsets[j]
                for j, c in enumerate(perm)
            ]
            steps = max(full_s)
            index = torch.zeros(count_c, max(steps * batch_size, 1), dtype=torch.long, device=device)
            for j, o in enumerate(orders):
                index[j, : full_s[j] * batch_size] = o[: full_s[j] * batch_size]
            active = [sum(1 for f in full_s if f > s) for s in range(steps)]  # clients still running: a prefix
            for s in range(steps):
                a = active[s]
                idx = index[:a, s * batch_size : (s + 1) * batch_size]
                step = SGDStep(theta, velocity, want, slice(0, a), lr, momentum)
                loss = gradient_step(chain, theta, step, x_all[idx], y_all[idx], obj, slice(0, a))
                step.finish()
                project()
                totals[:a] += loss.double() * batch_size
            rest = [sizes[c] - full_s[j] * batch_size for j, c in enumerate(perm)]
            for r in sorted(set(rest) - {0}):
                picked = [j for j in range(count_c) if rest[j] == r]
                rows = torch.tensor(picked, device=device)
                idx = torch.stack([orders[j][full_s[j] * batch_size :] for j in picked])
                step = SGDStep(theta, velocity, want, rows, lr, momentum)
                loss = gradient_step(chain, theta, step, x_all[idx], y_all[idx], obj, rows)
                step.finish()
                project()
                totals[rows] += loss.double() * r
    means = totals / (epochs * torch.tensor([sizes[c] for c in perm], dtype=torch.float64, device=device))
    return {n: t[inv] for n, t in theta.items()}, means[inv].tolist()
