"""The interface every fixed orthonormal coefficient subspace P implements (``docs/subspace.md``).

Notation, shared by the subspace modules: ``P in R^{dim x rank}`` (d x k in the docs) has orthonormal columns,
``P^T P = I_rank`` (to float rounding), is fixed by public randomness drawn from ``seed`` and is never stored
densely. ``expand(a) = P a`` maps coefficients ``a`` of shape ``(..., rank)`` to a parameter displacement
``(..., dim)`` (theta_i - theta_ref); ``project(g) = P^T g`` maps parameter-space gradients ``(..., dim)`` to
coefficient gradients ``(..., rank)``. Both act on the last axis and batch over the leading ones.

:class:`Subspace` holds what every P shares: its attributes, the checks of its arguments and operands, the
batching over leading axes, :meth:`~Subspace.to`, :meth:`~Subspace.dense` and the ``repr``. A kind supplies only
its math on a batch of rows and the arguments that fix its P:

- :class:`fedtailor.models.subspace.OrthonormalSubspace`: signs, permutations and DCTs (``"dct"``,
  ``"blocked-dct"``);
- :class:`fedtailor.models.kronecker.KroneckerSubspace`: ``A kron B`` over the whole parameter grid
  (``"kronecker"``);
- :class:`fedtailor.models.layerwise.LayerKroneckerSubspace`: one Kronecker block per layer
  (``"layer-kronecker"``).

:func:`fedtailor.models.subspace.make_subspace` builds a kind by its name (``SUBSPACES``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Self

import numpy as np
import torch

#: Largest ``dim * rank`` for which :meth:`Subspace.dense` builds the dense matrix.
MAX_DENSE_ENTRIES = 4096 * 4096

#: The dtypes a subspace computes in.
FLOAT_DTYPES = (torch.float32, torch.float64)


def haar_columns(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """A Haar-random ``rows x cols`` matrix with orthonormal columns (QR with the signs of R's diagonal fixed)."""
    q, r = np.linalg.qr(rng.standard_normal((rows, cols)))
    return q * np.sign(np.diag(r))


class Subspace(ABC):
    """Implicit ``P in R^{dim x rank}`` with ``P^T P = I``, on ``device`` in ``dtype`` (float32 or float64).

    A subclass calls ``super().__init__`` first (it validates the shared arguments and sets ``dim``, ``rank``,
    ``seed``, ``device``, ``dtype``), sets ``transform`` (its name in ``SUBSPACES``) and implements
    :meth:`_expand_rows`, :meth:`_project_rows` and :meth:`_key`; its randomness is drawn on the CPU from keys
    of ``seed``, so that :meth:`to` gives the same P on every device.
    """

    transform: str

    def __init__(self, *, dim: int, rank: int, seed: int, device: str | torch.device, dtype: torch.dtype) -> None:
        if dim < 1 or rank < 1 or rank > dim:
            raise ValueError(f"need 1 <= rank <= dim, got dim={dim}, rank={rank}.")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}.")
        self.dim, self.rank, self.seed, self.dtype = dim, rank, seed, dtype
        self.device = torch.empty(0, device=device).device

    # --- what a kind implements ---------------------------------------------------------------------------

    @abstractmethod
    def _expand_rows(self, a: torch.Tensor) -> torch.Tensor:
        """``P a`` for a checked batch of rows: ``(n, rank)`` -> ``(n, dim)``, ``n >= 1``."""

    @abstractmethod
    def _project_rows(self, g: torch.Tensor) -> torch.Tensor:
        """``P^T g`` for a checked batch of rows: ``(n, dim)`` -> ``(n, rank)``, ``n >= 1``."""

    @abstractmethod
    def _key(self) -> dict[str, Any]:
        """The constructor arguments that fix P, all but ``device`` and ``dtype`` (what :meth:`to` rebuilds from)."""

    def _details(self) -> str:
        """What the ``repr`` shows of the kind between ``seed`` and ``device`` (``", name=value, ..."``)."""
        return ""

    def _run(self, rows: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Apply ``op`` (:meth:`_expand_rows` or :meth:`_project_rows`) to a non-empty ``(n, size)`` batch; all at
        once here, a kind may split the batch."""
        return op(rows)

    # --- the shared contract ------------------------------------------------------------------------------

    def expand(self, a: torch.Tensor) -> torch.Tensor:
        """``P a``: coefficients ``(..., rank)`` to a parameter displacement ``(..., dim)`` (theta_i - theta_ref)."""
        self._check(a, self.rank, "a", "expand")
        return self._batched(a, self._expand_rows, self.dim)

    def project(self, g: torch.Tensor) -> torch.Tensor:
        """``P^T g``: parameter-space gradients ``(..., dim)`` to coefficient gradients ``(..., rank)``."""
        self._check(g, self.dim, "g", "project")
        return self._batched(g, self._project_rows, self.rank)

    def to(self, device: str | torch.device, *, dtype: torch.dtype | None = None) -> Self:
        """The same P on ``device`` (and in ``dtype`` if given); the randomness is redrawn from the same keys."""
        return type(self)(**self._key(), device=device, dtype=self.dtype if dtype is None else dtype)

    def dense(self) -> torch.Tensor:
        """The dense ``(dim, rank)`` matrix P, for tests on small sizes only."""
        if self.dim * self.rank > MAX_DENSE_ENTRIES:
            raise ValueError(
                f"dense() would build a {self.dim} x {self.rank} matrix ({self.dim * self.rank:,} entries, more "
                f"than the {MAX_DENSE_ENTRIES:,} allowed); use expand/project, which never materialise P."
            )
        return self.expand(torch.eye(self.rank, device=self.device, dtype=self.dtype)).T.contiguous()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dim={self.dim}, rank={self.rank}, seed={self.seed}{self._details()}, "
            f"device={self.device}, dtype={self.dtype})"
        )

    def _check(self, t: torch.Tensor, size: int, name: str, op: str) -> None:
        """Operand ``name`` of ``op``: last dimension ``size``, the subspace's dtype and device."""
        if t.ndim < 1 or t.shape[-1] != size:
            raise ValueError(f"{op}: {name} must have shape (..., {size}), got {tuple(t.shape)}.")
        if t.dtype != self.dtype:
            raise ValueError(
                f"{op}: {name} has dtype {t.dtype} but the subspace computes in {self.dtype}; cast the input "
                f"or build the subspace with .to(device, dtype={t.dtype})."
            )
        if t.device != self.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but the subspace is on {self.device}; use subspace.to({t.device!s})."
            )

    def _batched(self, x: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor], out_size: int) -> torch.Tensor:
        """``op`` over the leading axes of ``x`` flattened into rows, reshaped back; an empty batch gives an empty
        result without running ``op``."""
        rows = x.reshape(-1, x.shape[-1])
        out = x.new_zeros(0, out_size) if rows.shape[0] == 0 else self._run(rows, op)
        return out.reshape(*x.shape[:-1], out_size)
