"""Tests for the orthonormal coefficient subspace (docs/subspace.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch

import fedtailor.models.subspace as subspace_mod
from fedtailor.models.basis import MAX_DENSE_ENTRIES
from fedtailor.models.subspace import OrthonormalSubspace, block_sizes_for, dct_ortho, idct_ortho
from fedtailor.rng import numpy_rng

F64 = torch.float64
MNIST_DIM, CIFAR_DIM, RANK = 85_822, 121_182, 16_384


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the DCT against an independent implementation -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 97, 100, 1000, MNIST_DIM, CIFAR_DIM])
def test_dct_matches_scipy(n: int) -> None:
    x = torch.randn(2, n, dtype=F64, generator=_gen(n))
    ref = scipy.fft.dct(x.numpy(), norm="ortho", axis=-1)
    ref_inv = scipy.fft.idct(x.numpy(), norm="ortho", axis=-1)
    np.testing.assert_allclose(dct_ortho(x).numpy(), ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(idct_ortho(x).numpy(), ref_inv, rtol=0, atol=1e-12)
    x32 = x.float()
    np.testing.assert_allclose(dct_ortho(x32).numpy(), ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(idct_ortho(dct_ortho(x32)).double().numpy(), x.numpy(), rtol=0, atol=2e-5)


def test_dct_rejects_bad_dtype() -> None:
    with pytest.raises(ValueError, match="float32 or float64"):
        dct_ortho(torch.ones(4, dtype=torch.int64))


# --- P^T P = I and the construction, on small sizes against a dense build ----------------------------------------


@pytest.mark.parametrize(
    ("dim", "rank", "stages", "transform"),
    [
        (1, 1, 1, "dct"),
        (2, 1, 2, "dct"),
        (7, 7, 1, "dct"),
        (64, 16, 1, "dct"),
        (64, 64, 2, "dct"),
        (97, 30, 2, "dct"),
        (97, 30, 3, "dct"),
        (130, 77, 2, "blocked-dct"),
        (211, 200, 2, "blocked-dct"),
    ],
)
def test_orthonormal_columns_dense(dim: int, rank: int, stages: int, transform: str) -> None:
    sub = OrthonormalSubspace(dim=dim, rank=rank, seed=5, stages=stages, transform=transform, dtype=F64)
    p = sub.dense()
    assert p.shape == (dim, rank)
    torch.testing.assert_close(p.T @ p, torch.eye(rank, dtype=F64), rtol=0, atol=1e-12)
    # project is the transpose of expand, entry by entry.
    torch.testing.assert_close(sub.project(torch.eye(dim, dtype=F64)), p, rtol=0, atol=1e-12)
    p32 = OrthonormalSubspace(dim=dim, rank=rank, seed=5, stages=stages, transform=transform).dense()
    torch.testing.assert_close(p32.T @ p32, torch.eye(rank), rtol=0, atol=2e-6)
    torch.testing.assert_close(p32.double(), p, rtol=0, atol=1e-6)


def test_single_stage_is_signed_dct_columns() -> None:
    """stages=1 is exactly D_1 C D_0 restricted to the keyed column set S (checked against scipy's DCT matrix)."""
    dim, rank, seed = 60, 25, 11
    p = OrthonormalSubspace(dim=dim, rank=rank, seed=seed, stages=1, dtype=F64).dense().numpy()
    c = scipy.fft.dct(np.eye(dim), norm="ortho", axis=0)  # column j = C e_j
    cols = numpy_rng(seed, "subspace", "columns", dim).permutation(dim)[:rank]
    np.testing.assert_allclose(np.abs(p), np.abs(c[:, cols]), atol=1e-12)
    row_sign = np.sign(p[:, 0] * c[:, cols[0]])  # D_1, read off the first column where C is non-zero
    col_sign = np.sign(p[0] * c[0, cols])  # D_0 (times D_1[0]); C's first row is constant 1/sqrt(dim)
    np.testing.assert_allclose(p, row_sign[:, None] * c[:, cols] * col_sign[None, :] * row_sign[0], atol=1e-12)


def test_nested_ranks_share_columns() -> None:
    big = OrthonormalSubspace(dim=300, rank=120, seed=2, dtype=F64).dense()
    small = OrthonormalSubspace(dim=300, rank=40, seed=2, dtype=F64).dense()
    torch.testing.assert_close(small, big[:, :40], rtol=0, atol=1e-12)


def test_seed_determines_p() -> None:
    a = OrthonormalSubspace(dim=200, rank=50, seed=7).dense()
    b = OrthonormalSubspace(dim=200, rank=50, seed=7).dense()
    c = OrthonormalSubspace(dim=200, rank=50, seed=8).dense()
    assert torch.equal(a, b)
    # Different seeds: the subspaces differ (projection of one onto the other is far from the identity).
    overlap = torch.linalg.svdvals(a.T @ c)
    assert overlap.max() < 0.9 and overlap.mean() < 0.6


# --- exactness at the paper's sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dim", "transform"),
    [(MNIST_DIM, "dct"), (MNIST_DIM, "blocked-dct"), (CIFAR_DIM, "dct"), (CIFAR_DIM, "blocked-dct")],
)
def test_isometry_and_adjoint_at_real_sizes(dim: int, transform: str) -> None:
    sub = OrthonormalSubspace(dim=dim, rank=RANK, seed=41, transform=transform)
    gen = _gen(dim)
    a = torch.randn(2, RANK, generator=gen)
    g = torch.randn(2, dim, generator=gen)
    pa = sub.expand(a)
    # ||P a|| = ||a|| and P^T P a = a to float32 rounding.
    rel = (pa.double().norm(dim=-1) / a.double().norm(dim=-1) - 1).abs().max().item()
    assert rel < 1e-5
    back = sub.project(pa)
    assert ((back - a).norm(dim=-1) / a.norm(dim=-1)).max().item() < 1e-5
    # Adjoint identity <P a, g> = <a, P^T g>; both sides are O(sqrt(dim)) sums, compared relative to their scale.
    lhs = (pa.double() * g.double()).sum(-1)
    rhs = (a.double() * sub.project(g).double()).sum(-1)
    scale = a.norm(dim=-1).double() * g.norm(dim=-1).double()
    assert ((lhs - rhs).abs() / scale).max().item() < 1e-6
    # ||P^T g|| <= ||g|| with the expected fraction k/d of the energy for a generic g (chi-square concentration).
    frac = (sub.project(g).norm(dim=-1) ** 2 / g.norm(dim=-1) ** 2).numpy()
    np.testing.assert_allclose(frac, RANK / dim, rtol=0.05)


def test_float64_is_exact_to_double_rounding() -> None:
    sub = OrthonormalSubspace(dim=MNIST_DIM, rank=RANK, seed=3, dtype=F64)
    a = torch.randn(RANK, dtype=F64, generator=_gen(0))
    assert (sub.project(sub.expand(a)) - a).norm().item() / a.norm().item() < 1e-13


# --- batching, chunking, autograd, devices -------------------------------------------------------------------


def test_batched_equals_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    sub = OrthonormalSubspace(dim=500, rank=100, seed=1)
    a = torch.randn(3, 5, 100, generator=_gen(1))
    g = torch.randn(3, 5, 500, generator=_gen(2))
    rows_a = torch.stack([torch.stack([sub.expand(a[i, j]) for j in range(5)]) for i in range(3)])
    rows_g = torch.stack([torch.stack([sub.project(g[i, j]) for j in range(5)]) for i in range(3)])
    torch.testing.assert_close(sub.expand(a), rows_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(sub.project(g), rows_g, rtol=0, atol=1e-6)
    assert sub.expand(torch.zeros(0, 100)).shape == (0, 500) and sub.project(torch.zeros(2, 0, 500)).shape == (
        2,
        0,
        100,
    )
    torch.testing.assert_close(torch.func.vmap(sub.project)(g[0]), rows_g[0], rtol=0, atol=1e-6)
    # The CPU chunking path (several chunks, the last one short) gives the same result.
    monkeypatch.setattr(subspace_mod, "CPU_CHUNK_ELEMENTS", 2 * 500)
    torch.testing.assert_close(sub.expand(a), rows_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(sub.project(g), rows_g, rtol=0, atol=1e-6)


def test_autograd_through_expand_and_project(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subspace_mod, "CPU_CHUNK_ELEMENTS", 300)  # chunked path
    sub = OrthonormalSubspace(dim=300, rank=64, seed=4, dtype=F64)
    a = torch.randn(4, 64, dtype=F64, generator=_gen(3), requires_grad=True)
    g = torch.randn(4, 300, dtype=F64, generator=_gen(4), requires_grad=True)
    (sub.expand(a) * g.detach()).sum().backward()
    torch.testing.assert_close(a.grad, sub.project(g.detach()), rtol=0, atol=1e-12)
    (sub.project(g) * a.detach()).sum().backward()
    torch.testing.assert_close(g.grad, sub.expand(a.detach()), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(sub.expand, (a[:1].detach().requires_grad_(),))


def test_dtype_and_shape_errors() -> None:
    sub = OrthonormalSubspace(dim=50, rank=10, seed=0)
    with pytest.raises(ValueError, match=r"dtype torch.float64.*\.to\("):
        sub.expand(torch.zeros(10, dtype=F64))
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 10\)"):
        sub.expand(torch.zeros(11))
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 50\)"):
        sub.project(torch.zeros(3, 10))
    with pytest.raises(ValueError, match="torch.float32 or torch.float64"):
        OrthonormalSubspace(dim=50, rank=10, seed=0, dtype=torch.float16)
    with pytest.raises(ValueError, match="rank <= dim"):
        OrthonormalSubspace(dim=50, rank=51, seed=0)
    with pytest.raises(ValueError, match="stages >= 2"):
        OrthonormalSubspace(dim=50, rank=10, seed=0, stages=1, transform="blocked-dct")
    with pytest.raises(ValueError, match="unknown transform"):
        OrthonormalSubspace(dim=50, rank=10, seed=0, transform="fft")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expand/project"):
        OrthonormalSubspace(dim=MNIST_DIM, rank=RANK, seed=0).dense()
    assert MAX_DENSE_ENTRIES == 4096 * 4096


def test_to_dtype_gives_same_p() -> None:
    sub = OrthonormalSubspace(dim=120, rank=30, seed=9)
    sub64 = sub.to("cpu", dtype=F64)
    assert sub64.dtype == F64 and sub64.device == torch.device("cpu")
    torch.testing.assert_close(sub64.dense().float(), sub.dense(), rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    cpu = OrthonormalSubspace(dim=MNIST_DIM, rank=RANK, seed=41)
    gpu = cpu.to("cuda")
    a = torch.randn(3, RANK, generator=_gen(0))
    g = torch.randn(3, MNIST_DIM, generator=_gen(1))
    torch.testing.assert_close(gpu.expand(a.cuda()).cpu(), cpu.expand(a), rtol=0, atol=1e-5)
    torch.testing.assert_close(gpu.project(g.cuda()).cpu(), cpu.project(g), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="subspace.to"):
        gpu.expand(a)


# --- delocalisation ---------------------------------------------------------------------------------------------


def _block_energy(p: torch.Tensor, block: int) -> torch.Tensor:
    """Energy of each column in each contiguous block of ``block`` rows, relative to the uniform share."""
    dim, rank = p.shape
    nb = dim // block
    return (p[: nb * block] ** 2).reshape(nb, block, rank).sum(1) * (dim / block)


def test_block_sizes() -> None:
    assert block_sizes_for(MNIST_DIM, "dct") == (MNIST_DIM,)
    n1, n2 = block_sizes_for(MNIST_DIM, "blocked-dct")
    assert n1 + n2 == MNIST_DIM and n2 >= math.sqrt(MNIST_DIM)
    assert all(p in (2, 3, 5, 7) for p in _factor(n1))


def _factor(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


@pytest.mark.parametrize(("stages", "transform"), [(2, "dct"), (3, "dct"), (2, "blocked-dct")])
def test_columns_are_delocalised(stages: int, transform: str) -> None:
    """Entries are O(sqrt(log(dk)/d)) and every column spreads its energy over every block of 64 coordinates.

    For a Haar-random P (d = 4093, k = 1024) the max entry is ~1.0 x sqrt(2 log(dk)/d) and the smallest relative
    block energy is ~0.42 (chi-square with 64 degrees of freedom over 64k draws); a single DCT stage has a
    smaller max entry (its entries are at most sqrt(2/d)) but fails the block criterion: its low-frequency
    columns leave whole blocks nearly empty (relative energy ~0.003), which is why two stages are the default.
    """
    dim, rank = 4093, 1024
    p = OrthonormalSubspace(dim=dim, rank=rank, seed=0, stages=stages, transform=transform, dtype=F64).dense()
    assert p.abs().max().item() < 1.3 * math.sqrt(2 * math.log(dim * rank) / dim)
    energy = _block_energy(p, 64)
    assert energy.min().item() > 0.25
    one_stage = OrthonormalSubspace(dim=dim, rank=rank, seed=0, stages=1, dtype=F64).dense()
    assert _block_energy(one_stage, 64).min().item() < 0.05
