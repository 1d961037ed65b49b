"""The fixed orthonormal coefficient subspace P (``docs/subspace.md``).

P is a ``dim x rank`` matrix with ``P^T P = I_rank`` (to float rounding), fixed by public randomness and never
stored densely (for d = 85,822 and k = 16,384 a dense float32 P takes 5.6 GB). It is ``rank`` columns of a fast
orthogonal transform Q of size ``dim``::

    stages = 1:  Q = D_1 C D_0
    stages = 2:  Q = D_2 C Pi_1 D_1 C D_0            (default)
    stages = s:  Q = D_s C Pi_{s-1} D_{s-1} ... C Pi_1 D_1 C D_0

with ``D_j`` random +-1 sign diagonals, ``Pi_j`` random permutations and ``C`` the orthonormal DCT-II
(``scipy.fft.dct(norm="ortho")``) of length ``dim`` (``transform="dct"``), or a block-diagonal of two
orthonormal DCT-IIs whose main block has a fast FFT length (``transform="blocked-dct"``, 2.4x to 3x faster on
the CPU when ``dim`` has large prime factors, e.g. 85,822 = 2 * 11 * 47 * 83). ``P = Q[:, S]`` for a random
index set S of size ``rank``, so ``P a = Q scatter(a, S)`` and ``P^T g = (Q^T g)[S]``, each O(dim log dim).
Q is a product of orthogonal matrices, hence orthogonal, hence ``P^T P = I`` exactly in exact arithmetic.

The DCT-II is computed with Makhoul's reordering and one real FFT of the transform length, the DCT-III (its
inverse and transpose) with one inverse real FFT; the reorderings, permutations and signs of consecutive steps
are fused into one gather per stage. Everything is plain torch, so it runs batched on CPU and CUDA and is
differentiable. See ``docs/subspace.md`` for the choice of two stages and the measured costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch import nn

from fedtailor.models.basis import Subspace
from fedtailor.models.kronecker import KroneckerSubspace
from fedtailor.models.layerwise import Allocation, LayerKroneckerSubspace
from fedtailor.rng import numpy_rng

Transform = Literal["dct", "blocked-dct"]
#: The ``transform`` names :func:`make_subspace` knows (the keys of :data:`SUBSPACES`, the config's choices).
SubspaceKind = Literal["layer-kronecker", "kronecker", "blocked-dct", "dct"]

#: Elements per chunk when a batch is processed on the CPU (16 MB in float32, below glibc's 32 MB mmap threshold).
CPU_CHUNK_ELEMENTS = 1 << 22

_FLOAT_TO_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _is_7_smooth(n: int) -> bool:
    for p in (2, 3, 5, 7):
        while n % p == 0:
            n //= p
    return n == 1


def block_sizes_for(dim: int, transform: Transform) -> tuple[int, ...]:
    """Lengths of the DCT blocks of C: ``(dim,)`` for ``"dct"``; for ``"blocked-dct"`` the largest 7-smooth
    length ``n1 <= dim - ceil(sqrt(dim))`` (fast FFT) plus the remainder, which is kept at least ``sqrt(dim)``
    long so that two mixing stages still spread every column over all coordinates (docs/subspace.md)."""
    if transform == "dct":
        return (dim,)
    if transform != "blocked-dct":
        raise ValueError(f"unknown transform {transform!r}; use 'dct' or 'blocked-dct'.")
    if dim < 4:
        raise ValueError(f"transform='blocked-dct' needs dim >= 4 (got {dim}); use transform='dct'.")
    n1 = dim - math.isqrt(dim - 1) - 1
    while not _is_7_smooth(n1):
        n1 -= 1
    return (n1, dim - n1)


class _DCTBlocks:
    """Orthonormal DCT-II / DCT-III, blockwise along the last dimension, in the packed form the subspace fuses.

    For a block of length n with Makhoul-reordered input ``v`` (``v[i] = x[2i]``, ``v[n-1-i] = x[2i+1]``),
    ``V = rfft(v)`` and ``z_k = s_k exp(-i pi k / 2n) V_k`` for ``k < m = n // 2 + 1`` (``s_0 = 1/sqrt n``,
    ``s_k = sqrt(2/n)``), the orthonormal DCT-II of x is ``X_k = Re z_k`` and ``X_{n-k} = -Im z_k``. So
    :meth:`forward` returns z *packed* as reals ``(..., 2M)`` (``M`` = sum of the blocks' m) and the caller
    reads ``X`` out of it with one gather (:meth:`packed_position`). :meth:`inverse` is the exact inverse
    (= transpose): it takes the packed ``X_k, -X_{n-k}`` pairs (``0`` in the unused imaginary slots) and
    returns the Makhoul-reordered ``v``.
    """

    def __init__(self, sizes: tuple[int, ...], *, device: torch.device, dtype: torch.dtype) -> None:
        self.sizes = sizes
        self.halves = tuple(n // 2 + 1 for n in sizes)
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + sizes[:-1]))
        self.half_offsets = tuple(int(o) for o in np.cumsum((0,) + self.halves[:-1]))
        fwd, inv, order = [], [], []
        for n, off in zip(sizes, self.offsets, strict=True):
            k = np.arange(n // 2 + 1)
            scale = np.full(k.shape, math.sqrt(2.0 / n))
            scale[0] = math.sqrt(1.0 / n)
            w = np.exp(-1j * np.pi * k / (2 * n))
            fwd.append(scale * w)
            iw = np.conj(w) / scale
            if n % 2 == 0:
                # Nyquist k = n/2: z = X (1 - i) e^{i pi/4} / s = sqrt(2) X / s, so its imaginary slot is zeroed.
                iw[-1] = math.sqrt(2.0) / scale[-1]
            inv.append(iw)
            order.append(off + np.concatenate([np.arange(0, n, 2), np.arange(n - 1 - n % 2, 0, -2)]))
        cdtype = _FLOAT_TO_COMPLEX[dtype]
        self.fwd_twiddle = torch.from_numpy(np.concatenate(fwd)).to(device=device, dtype=cdtype)
        self.inv_twiddle = torch.from_numpy(np.concatenate(inv)).to(device=device, dtype=cdtype)
        #: ``makhoul_order[i]`` = natural index that lands at position i of the reordered vector.
        self.makhoul_order = np.concatenate(order)

    def packed_position(self) -> tuple[np.ndarray, np.ndarray]:
        """For each natural output index q: the slot of the packed z holding ``X_q`` and its sign (+1 or -1)."""
        pos, sign = [], []
        for n, m, mo in zip(self.sizes, self.halves, self.half_offsets, strict=True):
            q = np.arange(n)
            lower = q < m
            pos.append(np.where(lower, 2 * (mo + q), 2 * (mo + n - q) + 1))
            sign.append(np.where(lower, 1.0, -1.0))
        return np.concatenate(pos), np.concatenate(sign)

    def inverse_gather(self) -> tuple[np.ndarray, np.ndarray]:
        """For each packed slot of :meth:`inverse`'s input: the natural index of X it reads and its sign
        (``+1`` real parts, ``-1`` imaginary parts, ``0`` for the imaginary slots of k = 0 and the Nyquist k)."""
        idx, sign = [], []
        for n, m, off in zip(self.sizes, self.halves, self.offsets, strict=True):
            k = np.arange(m)
            im_idx = np.where(k == 0, 0, n - k)
            im_sign = np.where((k == 0) | (2 * k == n), 0.0, -1.0)
            idx.append(off + np.stack([k, im_idx], axis=-1).reshape(-1))
            sign.append(np.stack([np.ones(m), im_sign], axis=-1).reshape(-1))
        return np.concatenate(idx), np.concatenate(sign)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """Makhoul-reordered ``(..., d)`` -> packed DCT-II ``(..., 2M)``."""
        if len(self.sizes) == 1:
            z = torch.fft.rfft(v, dim=-1)
        else:
            z = torch.cat(
                [torch.fft.rfft(v[..., o : o + n], dim=-1) for n, o in zip(self.sizes, self.offsets, strict=True)],
                dim=-1,
            )
        z.mul_(self.fwd_twiddle)
        return torch.view_as_real(z).flatten(-2)

    def inverse(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed ``(..., 2M)`` (from :meth:`inverse_gather`) -> Makhoul-reordered ``(..., d)`` (DCT-III).

        ``packed`` is a fresh temporary of the caller and is overwritten."""
        z = torch.view_as_complex(packed.unflatten(-1, (-1, 2))).mul_(self.inv_twiddle)
        if len(self.sizes) == 1:
            return torch.fft.irfft(z, n=self.sizes[0], dim=-1)
        return torch.cat(
            [
                torch.fft.irfft(z[..., mo : mo + m], n=n, dim=-1)
                for n, m, mo in zip(self.sizes, self.halves, self.half_offsets, strict=True)
            ],
            dim=-1,
        )


def _plan_for(x: torch.Tensor, name: str) -> _DCTBlocks:
    if x.dtype not in _FLOAT_TO_COMPLEX:
        raise ValueError(f"{name}: x must be float32 or float64, got {x.dtype}.")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name}: x must have a non-empty last dimension, got shape {tuple(x.shape)}.")
    return _DCTBlocks((x.shape[-1],), device=x.device, dtype=x.dtype)


def dct_ortho(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II along the last dimension (= ``scipy.fft.dct(x, norm="ortho")``), batched, any device."""
    plan = _plan_for(x, "dct_ortho")
    pos, sign = plan.packed_position()
    z = plan.forward(x.index_select(-1, torch.from_numpy(plan.makhoul_order).to(x.device)))
    return z.index_select(-1, torch.from_numpy(pos).to(x.device)) * torch.from_numpy(sign).to(x)


def idct_ortho(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-III along the last dimension: the inverse and transpose of :func:`dct_ortho`."""
    plan = _plan_for(x, "idct_ortho")
    idx, sign = plan.inverse_gather()
    v = plan.inverse(x.index_select(-1, torch.from_numpy(idx).to(x.device)) * torch.from_numpy(sign).to(x))
    return v.index_select(-1, torch.from_numpy(np.argsort(plan.makhoul_order)).to(x.device))


class OrthonormalSubspace(Subspace):
    """Implicit ``P in R^{dim x rank}`` with ``P^T P = I``, applied in O(dim log dim).

    Randomness (signs, permutations, the column set S) comes from :func:`fedtailor.rng.numpy_rng` under the
    key ``(seed, "subspace", ...)`` and is drawn on the CPU, so the same seed gives the same P on every device.
    S is the first ``rank`` entries of a random permutation of ``range(dim)`` keyed by ``(seed, dim)`` alone:
    for one seed, the P of a smaller rank is exactly the first columns of the P of a larger rank.
    """

    def __init__(
        self,
        *,
        dim: int,
        rank: int,
        seed: int,
        stages: int = 2,
        transform: Transform = "dct",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(dim=dim, rank=rank, seed=seed, device=device, dtype=dtype)
        if stages < 1:
            raise ValueError(f"stages must be >= 1, got {stages}.")
        if transform == "blocked-dct" and stages < 2:
            raise ValueError(
                "transform='blocked-dct' needs stages >= 2: with one stage each column stays inside one block. "
                "Use stages=2 or transform='dct'."
            )
        self.stages, self.transform = stages, transform
        self.block_sizes = block_sizes_for(dim, transform)

        rng = numpy_rng(seed, "subspace", "transform", dim, stages, transform)
        signs = [rng.integers(0, 2, size=dim) * 2 - 1 for _ in range(stages + 1)]
        perms = [rng.permutation(dim) for _ in range(stages - 1)]
        columns = numpy_rng(seed, "subspace", "columns", dim).permutation(dim)[:rank]

        dev = self.device
        self._dct = _DCTBlocks(self.block_sizes, device=dev, dtype=dtype)
        order = self._dct.makhoul_order
        packed_pos, packed_sign = self._dct.packed_position()
        inv_idx, inv_sign = self._dct.inverse_gather()

        def idx(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)

        def sgn(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(device=dev, dtype=dtype)

        # Every step between two FFTs is one gather and one sign multiply. Stage 0 input (Makhoul order):
        # v = (D_0 scatter(a, S))[order], so column c sits at position argsort(order)[S[c]] with sign D_0[S[c]].
        self._in_pos = idx(np.argsort(order)[columns])
        self._in_sign = sgn(signs[0][columns])
        # Stage j >= 1 input: v[i] = D_j[order[i]] * X[q_i] with q_i = Pi_j[order[i]], X the previous DCT output,
        # read from its packed form. The transpose reads v at argsort(q) for each packed slot of the DCT-III.
        self._fwd: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._bwd: list[tuple[torch.Tensor, torch.Tensor]] = []
        for j in range(1, stages):
            q = perms[j - 1][order]
            s = signs[j][order]
            self._fwd.append((idx(packed_pos[q]), sgn(s * packed_sign[q])))
            iq = np.argsort(q)[inv_idx]
            self._bwd.append((idx(iq), sgn(s[iq] * inv_sign)))
        self._fwd_out = (idx(packed_pos), sgn(signs[stages] * packed_sign))
        self._bwd_in = (idx(inv_idx), sgn(signs[stages][inv_idx] * inv_sign))

    def _key(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "rank": self.rank,
            "seed": self.seed,
            "stages": self.stages,
            "transform": self.transform,
        }

    def _details(self) -> str:
        return f", stages={self.stages}, transform={self.transform!r}"

    @staticmethod
    def _gather(x: torch.Tensor, step: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        index, sign = step
        return x.index_select(-1, index).mul_(sign)

    def _run(self, rows: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """On the CPU in chunks of about ``CPU_CHUNK_ELEMENTS`` so the temporaries stay in cache and in reused heap
        memory (faster on a (333, 85822) batch than one call, docs/subspace.md)."""
        chunk = max(1, CPU_CHUNK_ELEMENTS // self.dim)
        if rows.device.type != "cpu" or rows.shape[0] <= chunk:
            return op(rows)
        return torch.cat([op(part) for part in rows.split(chunk)])

    def _expand_rows(self, a: torch.Tensor) -> torch.Tensor:
        v = a.new_zeros(a.shape[0], self.dim).index_copy(-1, self._in_pos, a * self._in_sign)
        z = self._dct.forward(v)
        for step in self._fwd:
            z = self._dct.forward(self._gather(z, step))
        return self._gather(z, self._fwd_out)

    def _project_rows(self, g: torch.Tensor) -> torch.Tensor:
        v = self._dct.inverse(self._gather(g, self._bwd_in))
        for step in reversed(self._bwd):
            v = self._dct.inverse(self._gather(v, step))
        return self._gather(v, (self._in_pos, self._in_sign))


class SubspaceBuilder(Protocol):
    """Builds one kind of subspace from the keywords of :func:`make_subspace` (less ``transform``): the common
    ones, and in ``options`` the kind-specific ones (``stages``, ``model``, ``allocation``), of which a kind reads
    those it needs."""

    def __call__(
        self, *, dim: int, rank: int, seed: int, device: str | torch.device, dtype: torch.dtype, **options: Any
    ) -> Subspace: ...


def _layer_kronecker(
    *,
    dim: int,
    rank: int,
    seed: int,
    device: str | torch.device,
    dtype: torch.dtype,
    model: nn.Module | None,
    allocation: Allocation,
    **_: Any,
) -> LayerKroneckerSubspace:
    if model is None:
        raise ValueError("transform 'layer-kronecker' is built from the model's layers: pass model=.")
    subspace = LayerKroneckerSubspace(
        model=model, rank=rank, seed=seed, device=device, dtype=dtype, allocation=allocation
    )
    if subspace.dim != dim:
        raise ValueError(f"the model has {subspace.dim} parameters but dim={dim} was given.")
    return subspace


def _kronecker(
    *, dim: int, rank: int, seed: int, device: str | torch.device, dtype: torch.dtype, **_: Any
) -> KroneckerSubspace:
    return KroneckerSubspace(dim=dim, rank=rank, seed=seed, device=device, dtype=dtype)


def _dct(transform: Transform) -> SubspaceBuilder:
    def build(
        *, dim: int, rank: int, seed: int, device: str | torch.device, dtype: torch.dtype, stages: int, **_: Any
    ) -> OrthonormalSubspace:
        return OrthonormalSubspace(
            dim=dim, rank=rank, seed=seed, stages=stages, transform=transform, device=device, dtype=dtype
        )

    return build


#: The subspace kinds by ``transform`` name, in the order of :data:`SubspaceKind`: one Kronecker block per layer
#: of ``model`` (which it needs), Kronecker factors over the whole parameter grid, ``stages`` mixing stages of
#: signs, permutations and blocked or plain DCTs.
SUBSPACES: dict[str, SubspaceBuilder] = {
    "layer-kronecker": _layer_kronecker,
    "kronecker": _kronecker,
    "blocked-dct": _dct("blocked-dct"),
    "dct": _dct("dct"),
}


def make_subspace(
    *,
    dim: int,
    rank: int,
    seed: int,
    transform: SubspaceKind,
    stages: int = 2,
    model: nn.Module | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    allocation: Allocation = "size",
) -> Subspace:
    """The coefficient subspace named by ``transform`` (a key of :data:`SUBSPACES`): ``"layer-kronecker"``
    (:class:`LayerKroneckerSubspace`, built from ``model``, its rank shared over layers by ``allocation``),
    ``"kronecker"`` (:class:`KroneckerSubspace`) or
    ``"blocked-dct"`` / ``"dct"`` (:class:`OrthonormalSubspace` with ``stages`` mixing stages)."""
    build = SUBSPACES.get(transform)
    if build is None:
        raise ValueError(f"unknown subspace transform {transform!r}; choose one of {', '.join(map(repr, SUBSPACES))}.")
    return build(
        dim=dim, rank=rank, seed=seed, stages=stages, model=model, device=device, dtype=dtype, allocation=allocation
    )
