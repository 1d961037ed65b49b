"""Per-record gradients, clipping, fixed-denominator means and the Gaussian mechanism.

These are Eq. 4-5 of *Privacy-Aligned Personalized Federated Learning with Compact Adaptation and
Variable-Length Gaussian Communication*.

Per-record gradients use ``torch.func`` (``functional_call`` + ``grad`` + ``vmap``): the model is applied
to one record at a time inside ``vmap``, so any ``nn.Module`` works without hooks, and the result is a flat
``(n, d)`` matrix whose columns follow ``model.named_parameters()`` (see :func:`flatten_named` /
:func:`unflatten_like`). A client's release is then

    g~ = (1/m_g) sum_z clip_C(g_z) + N(0, sigma^2 I),    clip_C(v) = v min{1, C/||v||_2}

whose replace-one L2 sensitivity is ``2 C / m_g`` because the denominator is fixed, not the batch size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Probability with which an honest release is refused by a server's norm bound (:func:`release_norm_bound`):
#: what a hostile client cannot exceed.
RELEASE_TAIL = 1e-12


def flatten_named(tensors: Mapping[str, torch.Tensor], *, batch_dims: int = 0) -> torch.Tensor:
    """Concatenate tensors (in mapping order) into one vector, or one row per record with ``batch_dims=1``."""
    if not tensors:
        raise ValueError("nothing to flatten: the mapping of tensors is empty.")
    parts = [t.reshape(*t.shape[:batch_dims], -1) for t in tensors.values()]
    return torch.cat(parts, dim=batch_dims)


def unflatten_like(flat: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split a flat vector (or ``(n, d)`` rows) into tensors shaped like ``like``, same order and names."""
    sizes = [t.numel() for t in like.values()]
    total = sum(sizes)
    if flat.shape[-1] != total:
        raise ValueError(f"flat tensor has {flat.shape[-1]} entries per row, but the parameters hold {total}.")
    lead = flat.shape[:-1]
    chunks = torch.split(flat, sizes, dim=-1)
    return {name: c.reshape((*lead, *t.shape)) for (name, t), c in zip(like.items(), chunks, strict=True)}


def _check_per_record_safe(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if module.training and isinstance(module, _BatchNorm):
            raise ValueError(
                f"module {name or type(module).__name__!r} is BatchNorm in training mode: "
                "its batch statistics "
                "mix records, so per-record gradients and their sensitivity are undefined. Use GroupNorm/"
                "LayerNorm or call model.eval()."
            )
        if module.training and isinstance(module, _DropoutNd) and module.p > 0:
            raise ValueError(
                f"module {name or type(module).__name__!r} is dropout in training mode, which needs "
                "randomness inside vmap. Call model.eval() (or set p=0) before computing "
                "per-record gradients."
            )


def per_example_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Gradient of ``loss_fn(model(x_z), y_z)`` for every record ``z``, as an ``(n, d)`` matrix.

    Columns follow ``model.named_parameters()``. ``params`` optionally replaces the module's parameters
    (e.g. a generated ``theta_i``; same names and shapes, any order); buffers are taken from the module.
    Each record is passed with a leading batch dimension of 1, so ``loss_fn`` sees ordinary ``(1, ...)``
    outputs and targets. ``chunk_size`` bounds memory by vectorising over that many records at a time.
    """
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"inputs hold {inputs.shape[0]} records but targets hold {targets.shape[0]}.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}.")
    _check_per_record_safe(model)
    named = dict(model.named_parameters())
    if params is None:
        params = {name: p.detach() for name, p in named.items()}
    else:
        if set(params) != set(named):
            missing, extra = set(named) - set(params), set(params) - set(named)
            raise ValueError(
                f"params must name exactly the model's parameters; missing {sorted(missing)}, "
                f"unexpected {sorted(extra)}."
            )
        params = {name: params[name].detach() for name in named}
    if not params:
        raise ValueError("the model has no parameters to differentiate.")
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss_one(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0), chunk_size=chunk_size)(params, inputs, targets)
    return flatten_named(grads, batch_dims=1)


def row_norms(g: torch.Tensor) -> torch.Tensor:
    """L2 norm of every row of an ``(n, d)`` matrix."""
    return torch.linalg.vector_norm(g, dim=1)


def clip_rows(g: torch.Tensor, *, clip: float) -> torch.Tensor:
    """``clip_C(v) = v min{1, C/||v||_2}`` for every row; rows with norm <= C are returned bit for bit."""
    if g.ndim != 2:
        raise ValueError(f"clip_rows expects an (n, d) matrix of per-record rows, got shape {tuple(g.shape)}.")
    if not (clip > 0.0 and math.isfinite(clip)):
        raise ValueError(f"clip norm must be finite and > 0, got {clip!r}.")
    norms = row_norms(g)
    scale = torch.where(norms > clip, clip / norms, torch.ones_like(norms))
    return g * scale.unsqueeze(1)


def clipped_mean(g: torch.Tensor, *, clip: float, denominator: int) -> torch.Tensor:
    """``(1/denominator) sum_z clip_C(g_z)``; replace-one sensitivity ``2 C/denominator``."""
    if isinstance(denominator, bool) or not isinstance(denominator, int) or denominator < 1:
        raise ValueError(f"denominator must be an int >= 1 (the fixed batch size m_g), got {denominator!r}.")
    return clip_rows(g, clip=clip).sum(dim=0) / denominator


def gaussian_mechanism(value: torch.Tensor, *, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """``value + N(0, sigma^2 I)`` with the noise drawn from ``generator`` on ``value``'s device."""
    if not (sigma >= 0.0 and math.isfinite(sigma)):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma!r}.")
    if not value.is_floating_point():
        raise ValueError(f"the released value must be a floating-point tensor, got dtype {value.dtype}.")
    if torch.device(generator.device).type != value.device.type:
        raise ValueError(
            f"generator is on {generator.device} but the value is on {value.device}; create it with "
            "fedtailor.rng.torch_generator(..., device=value.device)."
        )
    noise = torch.randn(value.shape, generator=generator, device=value.device, dtype=value.dtype)
    return value + sigma * noise


def release_norm_bound(
    bound: float, sigma: float, dim: int, *, tail: float = RELEASE_TAIL, slack: float = 0.0
) -> float:
    """The norm a release ``x + N(0, sigma^2 I_dim)`` of an input with ``||x|| <= bound`` exceeds with
    probability at most ``tail``: ``bound + sigma (sqrt(dim) + sqrt(2 ln(1/tail)))`` (the Gaussian norm is
    1-Lipschitz, so it exceeds its mean, at most sqrt(dim) sigma, by t sigma with probability <= exp(-t^2/2)),
    plus ``slack`` (a codec's rounding) and float32 rounding. A reply beyond it is refused: one client moves a
    mean of n releases by at most 2 x this bound / n."""
    return (bound + sigma * (math.sqrt(dim) + math.sqrt(2 * math.log(1 / tail))) + slack) * (1 + 1e-6)
