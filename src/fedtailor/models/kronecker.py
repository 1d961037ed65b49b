"""A Kronecker-structured orthonormal coefficient subspace: ``P = D (A kron B)``, applied by dense matmuls.

The flat parameter vector of length ``dim`` is viewed as a ``d1 x d2`` grid (row-major, ``d1 d2 <= dim``; the
``dim - d1 d2 < d1`` trailing coordinates, none for the paper's LeNet where 85,822 = 166 x 517, stay at
theta_ref). With ``A`` (``d1 x k1``) and ``B`` (``d2 x k2``) Haar-random matrices with orthonormal columns
(QR of a Gaussian matrix, signs fixed) and ``D`` a random +-1 diagonal of the grid coordinates::

    P a   = D vec(A M B^T),      M = a viewed as k1 x k2,          rank k = k1 k2
    P^T g = vec(A^T G B),        G = (D g) viewed as d1 x d2

``P^T P = (A^T A) kron (B^T B) = I_k`` exactly in exact arithmetic (``D^2 = I``, zero rows add nothing). Both
maps are two batched GEMMs, O(dim min(k1, k2) + ...) per row; on the CPU they run at the BLAS rate, which is
why this is faster than the two-stage DCT of :mod:`fedtailor.models.subspace` whose FFTs and gathers are
memory bound (``benchmarks/bench_subspace.py``). The subspace is different from the DCT one (structured, not
Haar-like column by column: a column's energy is ``A_ri^2 B_tj^2`` on coordinate (r, t)), so its accuracy is
measured against it (``docs/compact.md``), not assumed.

The factor shapes are chosen once per ``(dim, rank)`` by :func:`kronecker_shape`: fewest uncovered coordinates
first, then fewest flops per row.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedtailor.rng import numpy_rng

#: Largest ``dim * rank`` for which :meth:`KroneckerSubspace.dense` builds the dense matrix.
MAX_DENSE_ENTRIES = 4096 * 4096
#: Largest factor ``A`` or ``B`` (entries; 16 MB in float32): a prime rank would otherwise make one factor dense P.
MAX_FACTOR_ENTRIES = 1 << 22


def check_operand(t: torch.Tensor, *, size: int, name: str, op: str, dtype: torch.dtype, device: torch.device) -> None:
    """The input checks every subspace applies: last dimension ``size``, the subspace's dtype and device."""
    if t.ndim < 1 or t.shape[-1] != size:
        raise ValueError(f"{op}: {name} must have shape (..., {size}), got {tuple(t.shape)}.")
    if t.dtype != dtype:
        raise ValueError(
            f"{op}: {name} has dtype {t.dtype} but the subspace computes in {dtype}; cast the input "
            f"or build the subspace with .to(device, dtype={t.dtype})."
        )
    if t.device != device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but the subspace is on {device}; use subspace.to({t.device!s})."
        )


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


def kronecker_shape(dim: int, rank: int) -> tuple[int, int, int, int]:
    """``(d1, d2, k1, k2)`` with ``d1 d2 <= dim``, ``k1 k2 = rank``, ``k1 <= d1``, ``k2 <= d2``, ``d1 <= d2``, and
    neither factor above ``MAX_FACTOR_ENTRIES``.

    Minimises first the uncovered coordinates ``dim - d1 d2`` (which stay at theta_ref), then the imbalance
    ``|log(k1/d1) - log(k2/d2)|`` (both factors keep the same share of their axis, so neither axis of the grid is
    almost fully spanned while the other is thin), then the flops of one projection over both contraction
    orders."""
    if dim < 1 or rank < 1 or rank > dim:
        raise ValueError(f"need 1 <= rank <= dim, got dim={dim}, rank={rank}.")
    best: tuple[tuple[int, float, int], tuple[int, int, int, int]] | None = None
    for d1 in range(1, math.isqrt(dim) + 1):
        d2 = dim // d1
        for k1 in _divisors(rank):
            k2 = rank // k1
            if k1 > d1 or k2 > d2 or max(d1 * k1, d2 * k2) > MAX_FACTOR_ENTRIES:
                continue
            cover = d1 * d2
            flops = min(cover * k2 + d1 * k2 * k1, cover * k1 + k1 * d2 * k2)
            score = (dim - cover, round(abs(math.log(k1 / d1) - math.log(k2 / d2)), 9), flops)
            if best is None or score < best[0]:
                best = (score, (d1, d2, k1, k2))
    if best is None:
        raise ValueError(
            f"rank {rank} has no factorisation k1 * k2 with k1 <= d1, k2 <= d2 and factors of at most "
            f"{MAX_FACTOR_ENTRIES:,} entries for any grid d1 x d2 of dim {dim}; choose a rank with small factors "
            "(a power of two, say) or transform='blocked-dct'."
        )
    return best[1]


def _haar_columns(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """A Haar-random ``rows x cols`` matrix with orthonormal columns (QR with the signs of R's diagonal fixed)."""
    q, r = np.linalg.qr(rng.standard_normal((rows, cols)))
    return q * np.sign(np.diag(r))


class KroneckerSubspace:
    """Implicit ``P in R^{dim x rank}``, ``P = D (A kron B)`` on a ``d1 x d2`` grid of the coordinates.

    Same interface as :class:`fedtailor.models.subspace.OrthonormalSubspace` (``expand``, ``project``, ``to``,
    ``dense``). Randomness is drawn on the CPU in float64 from the key ``(seed, "subspace", "kronecker", dim,
    rank)`` and then cast and moved, so the same seed gives the same P on every device.
    """

    transform = "kronecker"

    def __init__(
        self,
        *,
        dim: int,
        rank: int,
        seed: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}.")
        self.dim, self.rank, self.seed, self.dtype = dim, rank, seed, dtype
        self.d1, self.d2, self.k1, self.k2 = kronecker_shape(dim, rank)
        self.cover = self.d1 * self.d2
        rng = numpy_rng(seed, "subspace", "kronecker", dim, rank)
        a = _haar_columns(rng, self.d1, self.k1)
        b = _haar_columns(rng, self.d2, self.k2)
        signs = rng.integers(0, 2, size=self.cover) * 2 - 1
        self.device = torch.empty(0, device=device).device
        self.A = torch.from_numpy(a).to(device=self.device, dtype=dtype)
        self.B = torch.from_numpy(b).to(device=self.device, dtype=dtype)
        self.sign = torch.from_numpy(signs.astype(np.float64)).to(device=self.device, dtype=dtype)
        # contract the grid's long axis with the factor that shrinks the batch most first
        self._b_first = (
            self.cover * self.k2 + self.d1 * self.k2 * self.k1 <= self.cover * self.k1 + self.k1 * self.d2 * self.k2
        )

    def __repr__(self) -> str:
        return (
            f"KroneckerSubspace(dim={self.dim}, rank={self.rank}, seed={self.seed}, grid={self.d1}x{self.d2}, "
            f"factors={self.k1}x{self.k2}, device={self.device}, dtype={self.dtype})"
        )

    def _check(self, t: torch.Tensor, size: int, name: str, op: str) -> None:
        check_operand(t, size=size, name=name, op=op, dtype=self.dtype, device=self.device)

    def expand(self, a: torch.Tensor) -> torch.Tensor:
        """``P a``: coefficients ``(..., rank)`` to a parameter displacement ``(..., dim)`` (theta_i - theta_ref)."""
        self._check(a, self.rank, "a", "expand")
        lead = a.shape[:-1]
        m = a.reshape(-1, self.k1, self.k2)
        grid = self.A @ (m @ self.B.T) if self._b_first else (self.A @ m) @ self.B.T  # (n, d1, d2)
        flat = grid.reshape(-1, self.cover) * self.sign
        if self.cover < self.dim:
            flat = torch.cat([flat, flat.new_zeros(flat.shape[0], self.dim - self.cover)], dim=1)
        return flat.reshape(*lead, self.dim)

    def project(self, g: torch.Tensor) -> torch.Tensor:
        """``P^T g``: parameter-space gradients ``(..., dim)`` to coefficient gradients ``(..., rank)``."""
        self._check(g, self.dim, "g", "project")
        lead = g.shape[:-1]
        grid = (g.reshape(-1, self.dim)[:, : self.cover] * self.sign).reshape(-1, self.d1, self.d2)
        if self._b_first:  # noqa: SIM108 (a comment per order)
            out = self.A.T @ (grid @ self.B)  # (n, d1, k2) then (n, k1, k2)
        else:
            out = (self.A.T @ grid) @ self.B  # (n, k1, d2) then (n, k1, k2)
        return out.reshape(*lead, self.rank)

    def to(self, device: str | torch.device, *, dtype: torch.dtype | None = None) -> KroneckerSubspace:
        """The same P on ``device`` (and in ``dtype`` if given); the randomness is redrawn from the same key."""
        return KroneckerSubspace(
            dim=self.dim, rank=self.rank, seed=self.seed, device=device, dtype=self.dtype if dtype is None else dtype
        )

    def dense(self) -> torch.Tensor:
        """The dense ``(dim, rank)`` matrix P, for tests on small sizes only."""
        if self.dim * self.rank > MAX_DENSE_ENTRIES:
            raise ValueError(
                f"dense() would build a {self.dim} x {self.rank} matrix ({self.dim * self.rank:,} entries, more "
                f"than the {MAX_DENSE_ENTRIES:,} allowed); use expand/project, which never materialise P."
            )
        return self.expand(torch.eye(self.rank, device=self.device, dtype=self.dtype)).T.contiguous()
