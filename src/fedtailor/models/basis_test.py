"""The shared contract of every subspace kind in ``SUBSPACES``: orthonormal columns, ``project`` the adjoint of
``expand``, batching over leading axes, ``to``, and the same checks and messages."""

from __future__ import annotations

import re
from typing import get_args

import pytest
import torch

from fedtailor.models.basis import Subspace
from fedtailor.models.flat import FlatLayout
from fedtailor.models.lenet import MLP
from fedtailor.models.subspace import SUBSPACES, SubspaceKind, make_subspace

F64 = torch.float64
RANK = 96


def _model() -> MLP:
    return MLP(in_features=64, hidden=16)  # three Linear layers, d = 1482: every kind can serve it


def _make(kind: str, *, rank: int = RANK, dtype: torch.dtype = F64) -> Subspace:
    model = _model()
    dim = FlatLayout.of(model).size
    return make_subspace(dim=dim, rank=rank, seed=3, transform=kind, model=model, dtype=dtype)  # type: ignore[arg-type]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_config_choices_are_the_registered_kinds() -> None:
    assert get_args(SubspaceKind) == tuple(SUBSPACES)
    with pytest.raises(ValueError, match=r"unknown subspace transform 'fft'; choose one of 'layer-kronecker'"):
        make_subspace(dim=10, rank=2, seed=0, transform="fft")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", list(SUBSPACES))
def test_orthonormal_columns_and_project_is_the_adjoint_of_expand(kind: str) -> None:
    sub = _make(kind)
    assert isinstance(sub, Subspace) and sub.transform == kind
    p = sub.dense()
    assert p.shape == (sub.dim, RANK) and p.dtype == F64
    torch.testing.assert_close(p.T @ p, torch.eye(RANK, dtype=F64), rtol=0, atol=1e-12)
    a = torch.randn(4, RANK, dtype=F64, generator=_gen(1))
    g = torch.randn(4, sub.dim, dtype=F64, generator=_gen(2))
    # <P a, g> = <a, P^T g>, and both maps agree with the dense P
    torch.testing.assert_close((sub.expand(a) * g).sum(-1), (a * sub.project(g)).sum(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sub.expand(a), a @ p.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(sub.project(g), g @ p, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", list(SUBSPACES))
def test_batching_over_leading_axes_equals_one_row_at_a_time(kind: str) -> None:
    sub = _make(kind)
    a = torch.randn(3, 2, RANK, dtype=F64, generator=_gen(3))
    g = torch.randn(3, 2, sub.dim, dtype=F64, generator=_gen(4))
    pa, pg = sub.expand(a), sub.project(g)
    assert pa.shape == (3, 2, sub.dim) and pg.shape == (3, 2, RANK)
    for i in range(3):
        for j in range(2):
            torch.testing.assert_close(pa[i, j], sub.expand(a[i, j]), rtol=0, atol=1e-12)
            torch.testing.assert_close(pg[i, j], sub.project(g[i, j]), rtol=0, atol=1e-12)
    assert sub.expand(torch.zeros(2, 0, RANK, dtype=F64)).shape == (2, 0, sub.dim)
    assert sub.project(torch.zeros(0, sub.dim, dtype=F64)).shape == (0, RANK)


@pytest.mark.parametrize("kind", list(SUBSPACES))
def test_to_gives_the_same_p(kind: str) -> None:
    sub = _make(kind, dtype=torch.float32)
    sub64 = sub.to("cpu", dtype=F64)
    assert type(sub64) is type(sub) and sub64.dtype == F64 and sub64.device == torch.device("cpu")
    assert sub64.transform == kind and (sub64.dim, sub64.rank, sub64.seed) == (sub.dim, sub.rank, sub.seed)
    torch.testing.assert_close(sub64.dense().float(), sub.dense(), rtol=0, atol=1e-6)
    assert torch.equal(sub64.dense(), _make(kind).dense())  # the randomness is redrawn from the same keys
    assert repr(sub).startswith(f"{type(sub).__name__}(dim={sub.dim}, rank={RANK}, seed=3, ")
    assert repr(sub).endswith(", device=cpu, dtype=torch.float32)")


@pytest.mark.parametrize("kind", list(SUBSPACES))
def test_every_kind_refuses_bad_operands_and_arguments_with_the_same_message(kind: str) -> None:
    sub = _make(kind)
    with pytest.raises(ValueError, match=re.escape(f"expand: a must have shape (..., {RANK}), got (3, {RANK + 1}).")):
        sub.expand(torch.zeros(3, RANK + 1, dtype=F64))
    with pytest.raises(ValueError, match=re.escape(f"project: g must have shape (..., {sub.dim}), got ().")):
        sub.project(torch.tensor(0.0, dtype=F64))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "expand: a has dtype torch.float32 but the subspace computes in torch.float64; cast the input "
            "or build the subspace with .to(device, dtype=torch.float32)."
        ),
    ):
        sub.expand(torch.zeros(RANK))
    with pytest.raises(ValueError, match=re.escape(f"need 1 <= rank <= dim, got dim={sub.dim}, rank={sub.dim + 1}.")):
        _make(kind, rank=sub.dim + 1)
    with pytest.raises(ValueError, match=re.escape("dtype must be torch.float32 or torch.float64, got torch.float16.")):
        _make(kind, dtype=torch.float16)
