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
from typing import Any

import numpy as np
import torch

from fedtailor.models.basis import Subspace, haar_columns
from fedtailor.rng import numpy_rng

#: Largest factor ``A`` or ``B`` (entries; 16 MB in float32): a prime rank would otherwise make one factor dense P.
MAX_FACTOR_ENTRIES = 1 << 22


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


class KroneckerSubspace(Subspace):
    """Implicit ``P in R^{dim x rank}``, ``P = D (A kron B)`` on a ``d1 x d2`` grid of the coordinates.

    Randomness is drawn on the CPU in float64 from the key ``(seed, "subspace", "kronecker", dim, rank)`` and then
    cast and moved, so the same seed gives the same P on every device.
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
        super().__init__(dim=dim, rank=rank, seed=seed, device=device, dtype=dtype)
        self.d1, self.d2, self.k1, self.k2 = kronecker_shape(dim, rank)
        self.cover = self.d1 * self.d2
        rng = numpy_rng(seed, "subspace", "kronecker", dim, rank)
        a = haar_columns(rng, self.d1, self.k1)
        b = haar_columns(rng, self.d2, self.k2)
        signs = rng.integers(0, 2, size=self.cover) * 2 - 1
        self.A = torch.from_numpy(a).to(device=self.device, dtype=dtype)
        self.B = torch.from_numpy(b).to(device=self.device, dtype=dtype)
        self.sign = torch.from_numpy(signs.astype(np.float64)).to(device=self.device, dtype=dtype)
        # contract the grid's long axis with the factor that shrinks the batch most first
        self._b_first = (
            self.cover * self.k2 + self.d1 * self.k2 * self.k1 <= self.cover * self.k1 + self.k1 * self.d2 * self.k2
        )

    def _key(self) -> dict[str, Any]:
        return {"dim": self.dim, "rank": self.rank, "seed": self.seed}

    def _details(self) -> str:
        return f", grid={self.d1}x{self.d2}, factors={self.k1}x{self.k2}"

    def _expand_rows(self, a: torch.Tensor) -> torch.Tensor:
        m = a.reshape(-1, self.k1, self.k2)
        grid = self.A @ (m @ self.B.T) if self._b_first else (self.A @ m) @ self.B.T  # (n, d1, d2)
        flat = grid.reshape(-1, self.cover) * self.sign
        if self.cover < self.dim:
            flat = torch.cat([flat, flat.new_zeros(flat.shape[0], self.dim - self.cover)], dim=1)
        return flat

    def _project_rows(self, g: torch.Tensor) -> torch.Tensor:
        grid = (g[:, : self.cover] * self.sign).reshape(-1, self.d1, self.d2)
        if self._b_first:  # noqa: SIM108 (a comment per order)
            out = self.A.T @ (grid @ self.B)  # (n, d1, k2) then (n, k1, k2)
        else:
            out = (self.A.T @ grid) @ self.B  # (n, k1, d2) then (n, k1, k2)
        return out.reshape(-1, self.rank)
