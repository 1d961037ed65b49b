"""The Kronecker subspace P = D (A kron B): exact orthonormality, adjoint identity, factor shapes, errors."""

from __future__ import annotations

import pytest
import torch

from fedtailor.models.kronecker import KroneckerSubspace, kronecker_shape
from fedtailor.models.subspace import make_subspace


@pytest.mark.parametrize(("dim", "rank"), [(85_822, 16_384), (121_182, 16_384), (85_822, 65_536), (1000, 64), (97, 4)])
def test_factor_shapes_cover_the_grid_and_factor_the_rank(dim, rank):
    d1, d2, k1, k2 = kronecker_shape(dim, rank)
    assert k1 * k2 == rank and k1 <= d1 <= d2 and k2 <= d2 and d1 * d2 <= dim
    assert dim - d1 * d2 < d1  # fewer uncovered coordinates than one grid row
    if dim == 85_822:
        assert (d1, d2) == (166, 517)  # 85,822 = 166 x 517 exactly: nothing is left at theta_ref


@pytest.mark.parametrize(("dim", "rank"), [(1000, 64), (997, 60), (4096, 1024)])
def test_p_has_orthonormal_columns_and_project_is_its_transpose(dim, rank):
    sub = KroneckerSubspace(dim=dim, rank=rank, seed=3, dtype=torch.float64)
    p = sub.dense()
    assert p.shape == (dim, rank)
    torch.testing.assert_close(p.T @ p, torch.eye(rank, dtype=torch.float64), atol=1e-12, rtol=0)
    g = torch.randn(5, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = torch.randn(5, rank, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sub.project(g), g @ p)
    torch.testing.assert_close(sub.expand(a), a @ p.T)
    # the adjoint identity <P a, g> = <a, P^T g>, batched
    torch.testing.assert_close((sub.expand(a) * g).sum(1), (a * sub.project(g)).sum(1))
    # every column reaches every covered grid row (a broken reshape would confine columns to blocks)
    assert (p[: sub.cover].abs().reshape(sub.d1, sub.d2, rank).amax(1) > 0).all()
    assert torch.count_nonzero(p[sub.cover :]) == 0  # uncovered coordinates stay at theta_ref


def test_float32_is_orthonormal_to_rounding_and_the_same_seed_gives_the_same_p():
    a = KroneckerSubspace(dim=85_822, rank=16_384, seed=41)
    b = KroneckerSubspace(dim=85_822, rank=16_384, seed=41)
    c = KroneckerSubspace(dim=85_822, rank=16_384, seed=42)
    x = torch.randn(3, 16_384, generator=torch.Generator().manual_seed(0))
    y = a.expand(x)
    assert torch.equal(y, b.expand(x)) and not torch.equal(y, c.expand(x))
    assert (a.project(y) - x).norm() / x.norm() < 1e-5  # P^T P a = a
    assert abs(y.norm() / x.norm() - 1) < 1e-5  # ||P a|| = ||a||


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="factorisation"):
        kronecker_shape(85_822, 16_381)  # a prime rank: only a dense 85,822 x 16,381 factor would do
    sub = make_subspace(dim=1000, rank=64, seed=0, transform="kronecker")
    with pytest.raises(ValueError, match="shape"):
        sub.project(torch.zeros(2, 999))
    with pytest.raises(ValueError, match="dtype"):
        sub.expand(torch.zeros(64, dtype=torch.float64))
    assert sub.to("cpu", dtype=torch.float64).dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_p_on_cuda():
    cpu = KroneckerSubspace(dim=85_822, rank=16_384, seed=41)
    gpu = cpu.to("cuda")
    x = torch.randn(2, 16_384, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gpu.expand(x.cuda()).cpu(), cpu.expand(x), atol=1e-5, rtol=1e-4)
    g = torch.randn(4, 85_822, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(gpu.project(g.cuda()).cpu(), cpu.project(g), atol=1e-4, rtol=1e-4)
