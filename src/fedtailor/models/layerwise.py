"""A layer-structured orthonormal coefficient subspace: one Kronecker block per layer, ``P = diag_l(A_l kron B_l)``.

Each layer ``l`` of the network (an ``nn.Linear`` or an ``nn.Conv2d``) has an augmented weight matrix
``W~_l = [W_l  b_l]`` of shape ``out_l x (fan_in_l + 1)`` (a convolution's kernel flattened as ``F.unfold``
lays out its patches; the bias is the last column, absent if the layer has none). Its block of ``P`` maps
``k_l = k1_l k2_l`` coefficients ``M_l`` (viewed ``k1_l x k2_l``) to the displacement ``A_l M_l B_l^T`` of
``W~_l``, where ``A_l`` (``out_l x k1_l``) and ``B_l`` (``(fan_in_l + 1) x k2_l``) are Haar-random with
orthonormal columns. Blocks sit on disjoint coordinates, so ``P^T P = I_k`` exactly in exact arithmetic.

Why this structure: a record's gradient of a linear layer is the outer product ``delta x~^T`` of the
back-propagated error ``delta = dl/dz`` and the augmented input ``x~ = [x, 1]`` (for a convolution, the sum
over output positions ``p`` of ``delta_p x~_p^T``, with ``x~_p`` the unfolded patch). Hence

    P_l^T vec(grad_l) = vec(A_l^T delta x~^T B_l) = vec((A_l^T delta)(B_l^T x~)^T)

(summed over positions for a convolution): :meth:`LayerKroneckerSubspace.per_record_coefficients` computes the
``(n, k)`` coefficient gradients of ``n`` records from one ordinary forward/backward pass of the batch (the
per-record errors are the gradient of the summed loss with respect to each layer's output, as records do not
interact) and never builds the ``n x d`` per-record parameter gradients. The result equals
``P^T`` of :func:`fedtailor.privacy.mechanisms.per_example_gradients` up to float rounding (tested).

The rank ``k`` is split over layers in proportion to their sizes (or, with ``allocation``, to the square roots of
their sizes, or equally), each block keeping the same share
``sqrt(k / d)`` of both axes of its matrix as nearly as integers allow, and the split is adjusted so that the
block ranks add up to ``k`` exactly (:func:`layer_ranks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from fedtailor.models.basis import Subspace, haar_columns
from fedtailor.models.flat import FlatLayout
from fedtailor.models.parts import channels_last
from fedtailor.rng import numpy_rng

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Layer:
    """One ``nn.Linear`` / ``nn.Conv2d`` and where its parameters sit in the flat vector."""

    module: str  # name in ``model.named_modules()``
    out: int  # rows of W~
    fan_in: int  # columns of W~ without the bias column
    bias: bool
    weight_offset: int  # offsets into the flat parameter vector (``FlatLayout`` order)
    bias_offset: int | None

    @property
    def cols(self) -> int:
        return self.fan_in + int(self.bias)

    @property
    def size(self) -> int:
        return self.out * self.cols


def model_layers(model: nn.Module) -> list[Layer]:
    """The layers of ``model`` in ``named_parameters()`` order; every parameter must be a Linear or Conv2d
    weight or bias (else a ValueError naming the parameter and the alternatives)."""
    layout = FlatLayout.of(model)
    offsets = dict(zip(layout.names, np.cumsum((0, *layout.numels[:-1])).tolist()))
    owner: dict[str, tuple[str, nn.Module]] = {}
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            owner[f"{mname}.{pname}" if mname else pname] = (mname, mod)
    layers: list[Layer] = []
    seen: set[str] = set()
    for name in layout.names:
        mname, mod = owner[name]
        if not isinstance(mod, (nn.Linear, nn.Conv2d)) or name.rsplit(".", 1)[-1] not in ("weight", "bias"):
            raise ValueError(
                f"subspace_transform 'layer-kronecker' needs every parameter to be the weight or bias of an "
                f"nn.Linear or nn.Conv2d; {name!r} belongs to a {type(mod).__name__}. Use 'kronecker' or "
                "'blocked-dct' for this model."
            )
        if isinstance(mod, nn.Conv2d) and mod.groups != 1:
            raise ValueError(
                f"layer {mname!r} is a grouped convolution (groups={mod.groups}); 'layer-kronecker' "
                "supports groups=1 only. Use 'kronecker' or 'blocked-dct'."
            )
        if isinstance(mod, nn.Conv2d) and (isinstance(mod.padding, str) or mod.padding_mode != "zeros"):
            raise ValueError(
                f"layer {mname!r} uses padding={mod.padding!r}, padding_mode={mod.padding_mode!r}; "
                "'layer-kronecker' supports integer zero padding only. Use 'kronecker' or 'blocked-dct'."
            )
        if mname in seen:
            continue
        seen.add(mname)
        w = mod.weight
        layers.append(
            Layer(
                module=mname,
                out=int(w.shape[0]),
                fan_in=int(w[0].numel()),
                bias=mod.bias is not None,
                weight_offset=offsets[f"{mname}.weight" if mname else "weight"],
                bias_offset=offsets[f"{mname}.bias" if mname else "bias"] if mod.bias is not None else None,
            )
        )
    if not layers:
        raise ValueError("the model has no Linear or Conv2d layers.")
    return layers


def _pairs(rows: int, cols: int, target: int) -> list[tuple[int, int]]:
    """Factor shapes ``(k1, k2)``, ``k1 <= rows``, ``k2 <= cols``, ranked by closeness of ``k1 k2`` to
    ``target`` and then by balance of the shares ``k1/rows`` and ``k2/cols``."""
    share = math.sqrt(max(target, 1) / (rows * cols))
    cands = set()
    for k1 in range(1, rows + 1):
        for k2 in {max(1, min(cols, target // k1)), max(1, min(cols, -(-target // k1)))}:
            cands.add((k1, k2))

    def score(p: tuple[int, int]) -> tuple[int, float]:
        return abs(p[0] * p[1] - target), abs(math.log(p[0] / rows / share)) + abs(math.log(p[1] / cols / share))

    return sorted(cands, key=score)


#: How :func:`layer_ranks` shares the rank over layers: in proportion to each layer's size (``"size"``), to its
#: square root (``"sqrt"``: small layers get more than their share), or equally (``"equal"``), each capped at the
#: layer's size with the excess passed on to the others.
Allocation = Literal["size", "sqrt", "equal"]


def allocation_targets(sizes: list[int], rank: int, allocation: Allocation) -> list[float]:
    """Real-valued targets ``t_l`` with ``sum_l t_l = rank`` and ``t_l <= size_l``: proportional to the
    allocation's weight ``w_l`` (``size_l``, ``sqrt(size_l)`` or 1) by water-filling (a layer whose share
    exceeds its size is capped at it, and the rest is shared again over the others)."""
    weight = {"size": lambda n: float(n), "sqrt": math.sqrt, "equal": lambda n: 1.0}[allocation]
    targets = [0.0] * len(sizes)
    free, left = set(range(len(sizes))), float(rank)
    while free:
        total = sum(weight(sizes[i]) for i in free)
        capped = {i for i in free if left * weight(sizes[i]) / total >= sizes[i]}
        if not capped:
            for i in free:
                targets[i] = left * weight(sizes[i]) / total
            break
        for i in capped:
            targets[i] = float(sizes[i])
            left -= sizes[i]
        free -= capped
    return targets


def layer_ranks(shapes: list[tuple[int, int]], rank: int, allocation: Allocation = "size") -> list[tuple[int, int]]:
    """``(k1_l, k2_l)`` per layer matrix ``rows_l x cols_l``, with ``sum_l k1_l k2_l = rank`` exactly.

    Each layer's target is its share of the rank under ``allocation`` (:func:`allocation_targets`; with
    ``"size"``, ``rank * size_l / d``), at least one coefficient; the largest layer takes what the
    others leave, and when that remainder has no factorisation that fits its matrix, the next-largest layer's
    shape moves to its next-best candidate (a small search; raises if none works)."""
    d = sum(r * c for r, c in shapes)
    if not 1 <= rank <= d:
        raise ValueError(f"need 1 <= rank <= d = {d}, got rank={rank}.")
    if rank < len(shapes):
        raise ValueError(
            f"rank {rank} is below the number of layers ({len(shapes)}): every layer needs at least "
            "one coefficient. Choose coef_dim >= the number of layers, or another subspace_transform."
        )
    order = sorted(range(len(shapes)), key=lambda i: shapes[i][0] * shapes[i][1])  # largest last
    big = order[-1]
    chosen: dict[int, tuple[int, int]] = {}
    targets = allocation_targets([r * c for r, c in shapes], rank, allocation) if allocation != "size" else None
    for i in order[:-1]:
        r, c = shapes[i]
        target = rank * r * c / d if targets is None else targets[i]
        chosen[i] = _pairs(r, c, max(1, round(target)))[0]

    def fit_largest(rest: int) -> tuple[int, int] | None:
        r, c = shapes[big]
        share = math.sqrt(max(rest, 1) / (r * c))
        fits = [(k1, rest // k1) for k1 in range(1, r + 1) if rest % k1 == 0 and rest // k1 <= c]
        if not fits:
            return None
        return min(fits, key=lambda p: abs(math.log(p[0] / r / share)) + abs(math.log(p[1] / c / share)))

    second = order[-2] if len(order) > 1 else None
    candidates = _pairs(*shapes[second], chosen[second][0] * chosen[second][1])[:200] if second is not None else [None]
    for cand in candidates:
        if cand is not None:
            chosen[second] = cand
        rest = rank - sum(k1 * k2 for i, (k1, k2) in chosen.items())
        if rest >= 1:
            got = fit_largest(rest)
            if got is not None:
                chosen[big] = got
                return [chosen[i] for i in range(len(shapes))]
    raise ValueError(
        f"could not split rank {rank} over layers of shapes {shapes} exactly; choose a rank with "
        "small factors (a power of two, say) or another subspace_transform."
    )


def per_record_conv_weight_grads(x: torch.Tensor, errs: torch.Tensor, mod: nn.Conv2d) -> torch.Tensor:
    """``sum_p e_{z,p} x_{z,p}^T`` per record ``z`` of a convolution ``mod`` (groups 1): ``(n, rows, fan_in)`` from
    its inputs ``x`` ``(n, C, H, W)`` and errors ``errs`` ``(n, rows, oh, ow)`` (the output's gradient, or any
    ``rows`` combinations of its channels), by one grouped ``convolution_backward`` with the records as groups:
    no unfolded patches are built (``F.unfold`` measured 3x slower on the CPU)."""
    n, rows = errs.shape[:2]
    return torch.ops.aten.convolution_backward(
        errs.reshape(1, n * rows, *errs.shape[2:]),
        x.reshape(1, -1, *x.shape[2:]),
        x.new_empty(n * rows, *mod.weight.shape[1:]),
        None,
        list(mod.stride),
        list(mod.padding),
        list(mod.dilation),
        False,
        [0, 0],
        n,
        [False, True, False],
    )[1].reshape(n, rows, -1)


def _conv_coefficients(
    x: torch.Tensor, delta: torch.Tensor, mod: nn.Conv2d, lay: Layer, A: torch.Tensor, B: torch.Tensor
) -> torch.Tensor:
    """``A^T (sum_p delta_p x~_p^T) B`` per record of a convolution, ``(n, k1, k2)``: each record's weight gradient
    comes from one grouped ``convolution_backward`` (records as groups: no unfolded patches are built), of the
    errors projected on ``A`` first (``(n, k1, oh, ow)``) or, when that costs fewer multiply-adds (``k1`` near the
    layer's channel count), of the errors themselves with ``A^T`` applied to the small per-record gradients."""
    channels, k1 = delta.shape[1], A.shape[1]
    positions = delta.shape[2] * delta.shape[3]
    first = channels * k1 * positions + k1 * lay.fan_in * positions  # per record, projecting the errors first
    after = channels * lay.fan_in * positions + k1 * channels * lay.fan_in
    # (delta_p A) over the positions of every record: one product in the errors' memory order
    errs = (delta.permute(0, 2, 3, 1) @ A).permute(0, 3, 1, 2).contiguous() if first <= after else delta.contiguous()
    grad = per_record_conv_weight_grads(x, errs, mod)
    summed = errs.sum((2, 3))  # (n, rows): the bias column's gradient
    if first > after:
        grad, summed = A.T @ grad, summed @ A
    out = grad @ B[: lay.fan_in]
    if lay.bias:
        out = out + summed[:, :, None] * B[lay.fan_in][None, None, :]
    return out


def _project_positions(
    errs: torch.Tensor, cols: torch.Tensor, A: torch.Tensor, B: torch.Tensor, *, bias: bool
) -> torch.Tensor:
    """``A^T (sum_p delta_p x~_p^T) B`` per record from errors ``(n, out, P)`` and inputs ``(n, fan_in, P)``, with
    ``x~_p = [x_p, 1]`` when there is a bias (its column is added as ``(A^T delta 1) B_last^T``, never building
    the augmented patches). The contraction order with fewer flops is used."""
    _n, fan_in, positions = cols.shape
    k1, k2 = A.shape[1], B.shape[1]
    left = A.T @ errs  # (n, k1, P)
    if positions * fan_in * k2 + k1 * positions * k2 <= k1 * positions * fan_in + k1 * fan_in * k2:
        out = left @ (cols.transpose(1, 2) @ B[:fan_in])  # (n, P, k2) first
    else:
        out = (left @ cols.transpose(1, 2)) @ B[:fan_in]  # (n, k1, fan_in) first
    if bias:
        out = out + left.sum(2)[:, :, None] * B[fan_in][None, None, :]
    return out


class LayerKroneckerSubspace(Subspace):
    """Implicit ``P in R^{d x k}``, block diagonal over layers with Kronecker blocks ``A_l kron B_l``.

    Built from the model whose parameters it spans (only the architecture is read, never the values); adds
    :meth:`per_record_coefficients` to the shared interface. Randomness is drawn on the CPU in float64 from the key
    ``(seed, "subspace", "layer-kronecker", d, k)``, then cast and moved: the same seed gives the same P on every
    device.
    """

    transform = "layer-kronecker"

    def __init__(
        self,
        *,
        model: nn.Module,
        rank: int,
        seed: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        allocation: Allocation = "size",
    ) -> None:
        self.layers = model_layers(model)
        self.allocation = allocation
        super().__init__(dim=FlatLayout.of(model).size, rank=rank, seed=seed, device=device, dtype=dtype)
        self.shapes = layer_ranks([(lay.out, lay.cols) for lay in self.layers], rank, allocation)
        rng = numpy_rng(seed, "subspace", "layer-kronecker", self.dim, rank)
        self.A, self.B = [], []
        for lay, (k1, k2) in zip(self.layers, self.shapes):
            self.A.append(torch.from_numpy(haar_columns(rng, lay.out, k1)).to(device=self.device, dtype=dtype))
            self.B.append(torch.from_numpy(haar_columns(rng, lay.cols, k2)).to(device=self.device, dtype=dtype))
        self.splits = [k1 * k2 for k1, k2 in self.shapes]
        self._model = model

    def _key(self) -> dict[str, Any]:
        return {"model": self._model, "rank": self.rank, "seed": self.seed, "allocation": self.allocation}

    def _details(self) -> str:
        blocks = ", ".join(
            f"{lay.module}:{lay.out}x{lay.cols}->{k1}x{k2}" for lay, (k1, k2) in zip(self.layers, self.shapes)
        )
        return f", blocks=[{blocks}]"

    def _matrix(self, g: torch.Tensor, lay: Layer) -> torch.Tensor:
        """``W~_l`` of each row of flat ``g`` (n, d) -> (n, out, cols)."""
        w = g[:, lay.weight_offset : lay.weight_offset + lay.out * lay.fan_in].reshape(-1, lay.out, lay.fan_in)
        if not lay.bias:
            return w
        b = g[:, lay.bias_offset : lay.bias_offset + lay.out].reshape(-1, lay.out, 1)
        return torch.cat([w, b], dim=2)

    def _expand_rows(self, a: torch.Tensor) -> torch.Tensor:
        out = a.new_zeros(a.shape[0], self.dim)
        for lay, (k1, k2), A, B, m in zip(self.layers, self.shapes, self.A, self.B, torch.split(a, self.splits, 1)):
            w = A @ m.reshape(-1, k1, k2) @ B.T  # (n, out, cols)
            out[:, lay.weight_offset : lay.weight_offset + lay.out * lay.fan_in] = w[:, :, : lay.fan_in].reshape(
                -1, lay.out * lay.fan_in
            )
            if lay.bias:
                out[:, lay.bias_offset : lay.bias_offset + lay.out] = w[:, :, lay.fan_in]
        return out

    def _project_rows(self, g: torch.Tensor) -> torch.Tensor:
        parts = [
            (A.T @ self._matrix(g, lay) @ B).reshape(g.shape[0], -1) for lay, A, B in zip(self.layers, self.A, self.B)
        ]
        return torch.cat(parts, dim=1)

    def per_record_coefficients(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``P^T grad_theta loss(model(x_z), y_z)`` for every record ``z``: an ``(n, k)`` matrix, from one batched
        forward and backward pass. ``loss_fn(logits, targets, reduction="sum")`` must be the sum of the
        per-record losses (``F.cross_entropy`` is). ``model`` must have the architecture this P was built from;
        ``params`` optionally replaces its parameters (e.g. a generated theta_i)."""
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"inputs hold {inputs.shape[0]} records but targets hold {targets.shape[0]}.")
        mods = dict(model.named_modules())
        captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def hook(name: str):
            def fn(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
                if name in captured:
                    raise ValueError(
                        f"layer {name!r} ran twice in one forward pass (shared weights); "
                        "'layer-kronecker' needs each layer used once. Use 'kronecker' or 'blocked-dct'."
                    )
                captured[name] = (args[0].detach(), out)
                return channels_last(out)  # later layers (ReLU, pooling, the next convolution) run channels-last

            return fn

        handles = [mods[lay.module].register_forward_hook(hook(lay.module)) for lay in self.layers]
        try:
            # leaves that require grad, so that every layer output is on the graph (their own grads are never computed)
            # convolutions in channels-last layout: the CPU's pooling and convolution kernels are several times faster
            p = {
                k: channels_last(v.detach()).requires_grad_(True)
                for k, v in (params or dict(model.named_parameters())).items()
            }
            with torch.enable_grad():
                logits = functional_call(model, p, (channels_last(inputs),))
                outs = [captured[lay.module][1] for lay in self.layers]
                deltas = torch.autograd.grad(loss_fn(logits, targets, reduction="sum"), outs)
        finally:
            for h in handles:
                h.remove()
        n = inputs.shape[0]
        out = inputs.new_empty(n, self.rank, dtype=self.A[0].dtype)  # each layer's block written in its columns
        for lay, (k1, k2), A, B, delta, cols in zip(
            self.layers, self.shapes, self.A, self.B, deltas, torch.split(out, self.splits, dim=1)
        ):
            x = captured[lay.module][0]
            mod = mods[lay.module]
            block = cols.view(n, k1, k2)
            if isinstance(mod, nn.Conv2d):
                block.copy_(_conv_coefficients(x, delta, mod, lay, A, B))
            elif x.ndim == 2:  # one position: the outer product of the two projected vectors, written in place
                left, right = delta @ A, x @ B[: lay.fan_in]
                if lay.bias:
                    right = right + B[lay.fan_in]
                torch.mul(left[:, :, None], right[:, None, :], out=block)
            else:  # a Linear applied at every position of (n, ..., fan_in)
                patches = x.reshape(n, -1, lay.fan_in).transpose(1, 2)
                errs = delta.reshape(n, -1, lay.out).transpose(1, 2)
                block.copy_(_project_positions(errs, patches, A, B, bias=lay.bias))
        return out
