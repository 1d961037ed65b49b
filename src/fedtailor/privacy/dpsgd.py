"""DP-SGD on one client's records: *Deep Learning with Differential Privacy* (Abadi, Chu, Goodfellow, McMahan,
Mironov, Talwar, Zhang 2016, arXiv:1607.00133), Algorithm 1 with Poisson sampling as in Opacus.

A step ``s`` of :func:`dp_sgd`, on trainable parameters ``theta`` of a client with ``N`` records:

    B_s = {z : U_z < q},  U_z ~ Uniform(0, 1) independently,  q = min(1, b / N)     (Poisson sampling)
    g~_s = ( sum_{z in B_s} clip_C(grad l(theta; z)) + N(0, (zeta C)^2 I) ) / (q N)
    theta <- theta - eta g~_s    (heavy-ball momentum on g~_s, post-processing, when asked)

with ``clip_C(v) = v min{1, C / ||v||_2}`` taken jointly over every trainable tensor, ``b`` the expected batch
size, ``zeta`` the noise multiplier and the fixed denominator ``q N`` (the expected batch size, public). Adding or
removing one record moves the pre-noise sum by at most ``C``, so each step is the Poisson-subsampled Gaussian
mechanism with noise multiplier ``zeta`` (add/remove-one-record adjacency): what
:class:`~fedtailor.privacy.ledger.PrivacyLedger` composes with dp-accounting. A pass is ``ceil(N / b)`` steps.

Randomness: the sampling's uniforms and the noise come from one key (:class:`PrivateSGD`): derived from the seed
in simulation, 256 bits of the client's own OS entropy in secure mode, where both are unknown to the server (a
sampling known to the server would void the amplification by sampling), each step's draws from its own label.

Per-record gradients come from ``torch.func`` (``vmap`` of ``grad`` of the loss on one record), so any model
without cross-record layers works (batch normalisation is refused by the caller's model check).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedtailor.fl import batched
from fedtailor.models.layerwise import Layer, model_layers, per_record_conv_weight_grads
from fedtailor.privacy.mechanisms import unflatten_like
from fedtailor.privacy.noise import open_unit, secure_gaussian_noise, secure_stream_words
from fedtailor.rng import derive_key, fresh_key

Params = dict[str, torch.Tensor]
LossFn = Callable[[Params, Params, torch.Tensor, torch.Tensor], torch.Tensor]
DrawFn = Callable[[int, int], torch.Tensor]  # (step, size) -> float64 draws of that size
#: (step, names, flat clipped sum in float64) -> the sum plus N(0, (zeta C)^2 I), float64, in the same layout
ReleaseFn = Callable[[int, list[str], torch.Tensor], torch.Tensor]


def steps_per_epoch(records: int, batch_size: int) -> int:
    """DP-SGD steps of one pass over ``records`` at expected batch size ``batch_size``: ``ceil(N / b)``."""
    return max(1, math.ceil(records / batch_size))


def sampling_rate(records: int, batch_size: int) -> float:
    """Poisson sampling rate ``q = min(1, b / N)``."""
    return min(1.0, batch_size / records)


def clipped_sum(grads: Params, *, clip: float) -> tuple[Params, torch.Tensor]:
    """``sum_z clip_C(g_z)`` of per-record gradients (leading axis: records), the clip joint over every tensor;
    returns the sums and the per-record norms before clipping."""
    flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)
    norms = torch.linalg.vector_norm(flat, dim=1)
    scale = (clip / norms.clamp_min(1e-300)).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", scale.to(g.dtype), g) for n, g in grads.items()}, norms


_LAYERS: weakref.WeakKeyDictionary[nn.Module, list[Layer]] = weakref.WeakKeyDictionary()
_CHAINS: weakref.WeakKeyDictionary[nn.Module, batched.Chain | None] = weakref.WeakKeyDictionary()


def _layers(model: nn.Module) -> list[Layer]:
    """:func:`~fedtailor.models.layerwise.model_layers` of ``model``, read once per model (every step asks)."""
    if model not in _LAYERS:
        _LAYERS[model] = model_layers(model)
    return _LAYERS[model]


def _linear_chain(model: nn.Module, names: Collection[str]) -> batched.Chain | None:
    """``model`` as a chain of :mod:`fedtailor.fl.batched` layers (traced once per model) when every parametric
    layer is a Linear and ``names`` are all its parameters; None otherwise."""
    if model not in _CHAINS:
        _CHAINS[model] = batched.try_compile(model)
    chain = _CHAINS[model]
    if chain is None or set(names) != set(chain.names):
        return None
    return chain if all(isinstance(lay, batched.Linear) for lay in chain.layers if lay.names) else None


class _Ghost(batched.Sink):
    """What ghost clipping needs of a backward pass: each Linear layer's per-record errors ``g`` ``(n, out)`` and
    inputs ``h`` ``(n, in)``, by weight name, instead of their summed products."""

    def __init__(self, want: frozenset[str]) -> None:
        self.want, self.pairs = want, {}

    def bmm(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        self.pairs[name] = (a[0].T, b[0])  # a = g^T (1, out, n), b = h (1, n, in)

    def add(self, name: str, g: torch.Tensor, alpha: float = 1.0) -> None:
        pass  # a bias's per-record gradient is its layer's error g, kept with the weight


def _chain_clipped_sum(
    chain: batched.Chain, params: Params, x: torch.Tensor, y: torch.Tensor, *, clip: float
) -> tuple[Params, torch.Tensor]:
    """:func:`layer_clipped_sum` of a chain of Linear layers over all its parameters, through the hand-written
    forward and backward of :mod:`fedtailor.fl.batched` (one client): no autograd, hooks or ``functional_call``,
    which are most of a small model's step."""
    h = x[None]
    for layer in chain.layers[: chain.start]:  # the parameter-free prefix (normalisation, flatten)
        h, _ = layer.forward({}, h)
    p = {n: t[None] for n, t in params.items()}
    sink = _Ghost(frozenset(params))
    logits, ctxs, lowest = batched.forward_pass(chain, p, sink.want, h)
    logp = torch.log_softmax(logits[0], -1)
    losses = -logp.gather(1, y[:, None])[:, 0]
    g = logp.exp()  # d loss_z / d logits_z = softmax - onehot, record by record (the sum of the losses)
    g[torch.arange(len(y), device=y.device), y] -= 1.0
    batched.backward_pass(chain, p, g[None], ctxs, lowest, sink)
    bias = {
        lay.names[0]: lay.names[1] for lay in chain.layers if isinstance(lay, batched.Linear) and len(lay.names) > 1
    }
    sq = torch.zeros(len(x), dtype=torch.float64, device=x.device)
    for w, (g_w, h_w) in sink.pairs.items():
        g_sq = g_w.pow(2).sum(1).double()
        sq += g_sq * h_w.pow(2).sum(1).double() + (g_sq if w in bias else 0.0)
    scale = (clip / sq.sqrt().clamp_min(1e-300)).clamp(max=1.0).to(x.dtype)
    sums: Params = {}
    for w, (g_w, h_w) in sink.pairs.items():
        sums[w] = (g_w * scale[:, None]).T @ h_w
        if w in bias:
            sums[bias[w]] = scale @ g_w
    return sums, losses.detach()


def layer_clipped_sum(
    model: nn.Module, params: Params, names: Collection[str], x: torch.Tensor, y: torch.Tensor, *, clip: float
) -> tuple[Params, torch.Tensor]:
    """``sum_z clip_C(grad l(theta; z))`` over the parameters ``names`` of a model whose trainable parameters are
    the weights and biases of ``nn.Linear`` / ``nn.Conv2d`` layers, for the cross-entropy ``l``, from one batched
    forward and backward pass (no per-record autograd): a Linear layer's per-record gradient is the outer
    product ``g_z h_z^T`` of its output error and input, so its squared norm is ``||g_z||^2 (||h_z||^2 + 1)``
    (bias included) and the clipped sum is ``(s * G)^T H`` with ``s_z = min(1, C / ||grad_z||)`` (ghost clipping,
    *Large Language Models Can Be Strong Differentially Private Learners*, Li, Tramer, Liang, Hashimoto 2021,
    arXiv:2110.05679); a convolution's per-record weight gradients ``sum_p g_{z,p} x_{z,p}^T`` come from one
    grouped convolution backward (:func:`~fedtailor.models.layerwise.per_record_conv_weight_grads`). Returns the
    sums and the per-record losses; raises ValueError when the model is outside this form (the caller then uses
    :func:`dp_sgd`'s per-record autograd). A model that is a chain of Linear layers (and parameter-free steps)
    trained in full runs on :mod:`fedtailor.fl.batched`'s hand-written forward and backward instead of autograd
    (:func:`_chain_clipped_sum`, the same sums)."""
    chain = _linear_chain(model, names)
    if chain is not None:
        return _chain_clipped_sum(chain, params, x, y, clip=clip)
    layers = [lay for lay in _layers(model) if {f"{lay.module}.weight", f"{lay.module}.bias"} & set(names)]
    mods = dict(model.named_modules())
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str):
        def fn(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if name in captured:
                raise ValueError(f"layer {name!r} ran twice in one forward pass.")
            captured[name] = (args[0].detach(), out)

        return fn

    handles = [mods[lay.module].register_forward_hook(hook(lay.module)) for lay in layers]
    try:
        p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        with torch.enable_grad():
            losses = F.cross_entropy(functional_call(model, p, (x,)), y, reduction="none")
            outs = [captured[lay.module][1] for lay in layers]
            deltas = torch.autograd.grad(losses.sum(), outs)
    finally:
        for h in handles:
            h.remove()
    n = len(x)
    per_record: dict[str, torch.Tensor] = {}  # a conv's (n, out, fan_in) weight gradients
    sq = torch.zeros(n, dtype=torch.float64, device=x.device)
    for lay, g in zip(layers, deltas):
        h, mod = captured[lay.module][0], mods[lay.module]
        if isinstance(mod, nn.Conv2d):
            gw = per_record_conv_weight_grads(h, g, mod)  # (n, out, fan_in)
            per_record[lay.module] = gw
            sq += gw.pow(2).sum((1, 2)).double()
            if lay.bias:
                sq += g.sum((2, 3)).pow(2).sum(1).double()
        elif h.ndim == 2:
            g_sq = g.pow(2).sum(1).double()
            sq += g_sq * h.pow(2).sum(1).double() + (g_sq if lay.bias else 0.0)
        else:
            raise ValueError(f"layer {lay.module!r} is a Linear applied at several positions.")
    scale = (clip / sq.sqrt().clamp_min(1e-300)).clamp(max=1.0).to(x.dtype)
    sums: Params = {}
    for lay, g in zip(layers, deltas):
        h, mod = captured[lay.module][0], mods[lay.module]
        w = f"{lay.module}.weight"
        if isinstance(mod, nn.Conv2d):
            sums[w] = torch.einsum("n,nof->of", scale, per_record[lay.module]).reshape(mod.weight.shape)
            bias_rows = g.sum((2, 3))
        else:
            sums[w] = (g * scale[:, None]).T @ h
            bias_rows = g
        if lay.bias:
            sums[f"{lay.module}.bias"] = scale @ bias_rows
    wanted = set(names)
    return {k: v for k, v in sums.items() if k in wanted}, losses.detach()


def dp_sgd(
    loss_fn: LossFn,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    trainable: Collection[str],
    epochs: int,
    batch_size: int,
    lr: float,
    clip: float,
    noise_multiplier: float,
    uniforms: DrawFn,
    noise: DrawFn,
    aux: Params | None = None,
    momentum: float = 0.0,
    project: Callable[[Params], Params] | None = None,
    model: nn.Module | None = None,
    release: ReleaseFn | None = None,
    penalty: Callable[[Params], Params] | None = None,
) -> tuple[Params, float, int]:
    """``epochs`` passes of DP-SGD (module docstring) on ``loss_fn(params, aux, x_batch, y_batch)`` (a mean over
    the batch) over the names in ``trainable``; step ``s`` samples with ``uniforms(s, N)`` and adds
    ``noise(s, size)`` (standard normal) scaled by ``zeta C``. Returns the new parameters (inputs unchanged),
    the mean loss over the sampled records (not private: for the caller's divergence check only) and the
    number of noisy steps. With ``model`` (the loss then being the plain cross-entropy of ``model``), the clipped
    sums come from :func:`layer_clipped_sum` (one batched pass) instead of per-record autograd. ``penalty``: the
    gradient, at the current parameters, of a term of the objective that reads no record (FedProx's and Ditto's
    proximal term), added to each step's noisy gradient: a function of the parameters (earlier steps' releases)
    and of public values alone, so post-processing, with the clip spent on the records' gradients only."""
    if len(x) == 0:
        raise ValueError("DP-SGD got no records.")
    names = [n for n in params if n in set(trainable)]
    theta = {n: t.detach().clone() for n, t in params.items()}
    aux = aux or {}
    q = sampling_rate(len(x), batch_size)
    steps = epochs * steps_per_epoch(len(x), batch_size)
    shapes = {n: theta[n] for n in names}  # the layout of the flat noisy sum
    dtypes = {theta[n].dtype for n in names}
    if len(dtypes) > 1:
        raise ValueError(f"DP-SGD needs trainable parameters of one dtype, got {sorted(map(str, dtypes))}.")
    dtype = dtypes.pop() if dtypes else x.dtype

    def record_loss(live: Params, fixed: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return loss_fn({**fixed, **live}, aux, xi[None], yi[None])

    per_record = None if model is not None else vmap(grad_and_value(record_loss), in_dims=(None, None, 0, 0))
    velocity = {n: torch.zeros_like(theta[n]) for n in names} if momentum else {}
    total, count = 0.0, 0
    for step in range(steps):
        if q < 1:
            chosen = (uniforms(step, len(x)) < q).nonzero().reshape(-1).to(x.device)
            xb, yb = x[chosen], y[chosen]
        else:  # every U_z < 1: the whole set, in order (no draw needed)
            xb, yb = x, y
        live = {n: theta[n] for n in names}
        fixed = {n: t for n, t in theta.items() if n not in live}
        if len(xb) and model is not None:
            sums, losses = layer_clipped_sum(model, theta, names, xb, yb, clip=clip)
            total += float(losses.sum())
            count += len(xb)
        elif len(xb) and per_record is not None:
            grads, losses = per_record(live, fixed, xb, yb)
            sums, _ = clipped_sum(grads, clip=clip)
            total += float(losses.sum())
            count += len(xb)
        else:
            sums = {n: torch.zeros_like(theta[n]) for n in names}
        flat = torch.cat([sums[n].reshape(-1).double() for n in names] or [x.new_zeros(0, dtype=torch.float64)])
        if release is None:
            flat += noise_multiplier * clip * noise(step, flat.numel()).to(device=x.device)
        else:  # the caller realises the Gaussian mechanism (a codec): the whole clipped sum in, its release out
            flat = release(step, names, flat).to(x.device)
        noisy = unflatten_like(flat.to(dtype) / (q * len(x)), shapes)
        extra = penalty(theta) if penalty is not None else {}
        with torch.no_grad():
            for n in names:
                g = noisy[n] + extra[n] if n in extra else noisy[n]
                if momentum:
                    velocity[n] = velocity[n].mul(momentum).add_(g)
                    g = velocity[n]
                theta[n] = theta[n] - lr * g
            if project is not None:
                theta.update(project(theta))
    return theta, (total / count if count else 0.0), steps


@dataclass
class PrivateSGD:
    """The DP-SGD a record-level DP wrapper gives its base method: every local SGD run of a client's fit is
    :func:`dp_sgd` with these settings, its randomness (ChaCha20 uniforms for the sampling, the hardened Gaussian
    sampler for the noise) from the key ``(seed, "dp-sgd", round, client, call)`` (simulation) or a fresh
    OS-entropy key per run (secure); ``steps`` counts the noisy steps of the fit in
    progress, which the wrapper checks against its plan. ``fitting`` is ``(round, client)`` during a fit (None:
    plain SGD, e.g. an evaluation's fine-tuning, whose model never leaves the client)."""

    clip: float
    noise_multiplier: float
    simulation: bool
    seed: int
    fitting: tuple[int, int] | None = None
    calls: int = 0
    steps: int = 0
    #: a codec's realisation of each step's Gaussian mechanism (:func:`dp_sgd`'s ``release``), set per fit
    release: ReleaseFn | None = None

    def start(self, rnd: int, cid: int) -> None:
        self.fitting, self.calls, self.steps = (rnd, cid), 0, 0

    def stop(self) -> None:
        self.fitting = None

    def run(self, loss_fn: LossFn, params: Params, x: torch.Tensor, y: torch.Tensor, **sgd) -> tuple[Params, float]:
        """One local SGD run of the fit in progress as DP-SGD (``sgd``: :func:`dp_sgd`'s other arguments)."""
        if self.fitting is None:
            raise RuntimeError("PrivateSGD.run outside a client's fit.")
        rnd, cid = self.fitting
        key = derive_key(self.seed, "dp-sgd", rnd, cid, self.calls) if self.simulation else fresh_key()
        self.calls += 1

        def uniforms(step: int, n: int) -> torch.Tensor:
            return torch.from_numpy(open_unit(secure_stream_words(key, "sample", step, count=n)))

        def noise(step: int, size: int) -> torch.Tensor:
            return torch.from_numpy(np.asarray(secure_gaussian_noise(key, "noise", step, sigma=1.0, size=size)))

        theta, loss, steps = dp_sgd(
            loss_fn,
            params,
            x,
            y,
            clip=self.clip,
            noise_multiplier=self.noise_multiplier,
            uniforms=uniforms,
            noise=noise,
            release=self.release,
            **sgd,
        )
        self.steps += steps
        return theta, loss
