"""Partition invariants, the Dirichlet law of the fill, interleaving, and the federated roles/splits."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special, stats

from fedtailor.data import partition
from fedtailor.data.partition import (
    ClientIndices,
    FederatedPartition,
    class_histogram,
    dirichlet_equal_partition,
    dirichlet_per_class_partition,
    federated_partition,
    format_partition_table,
    iid_partition,
    plot_partition,
    sample_log_dirichlet,
)

BALANCED = np.repeat(np.arange(10), 700)  # 7,000 records, 10 classes: MNIST's shape at 1/10 scale


def _shares(labels: np.ndarray, parts: list[np.ndarray], num_classes: int = 10) -> np.ndarray:
    hist = np.array([np.bincount(labels[p], minlength=num_classes) for p in parts], dtype=float)
    return hist / hist.sum(axis=1, keepdims=True)


def _mean_tv_to_pool(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    pool = np.bincount(labels) / labels.size
    return float((0.5 * np.abs(_shares(labels, parts) - pool).sum(axis=1)).mean())


# ------------------------------------------------------------------------------------- Dirichlet rows


def _beta_cdf_from_log(log_x: np.ndarray, log_1mx: np.ndarray, a: float, b: float) -> np.ndarray:
    """Beta(a, b) CDF at x = exp(log_x), also where x or 1 - x = exp(log_1mx) underflow or round away:
    I_x(a, b) = x^a / (a B(a, b)) (1 + O(x)) and 1 - I_x(a, b) = (1 - x)^b / (b B(a, b)) (1 + O(1 - x))."""
    out = stats.beta(a, b).cdf(np.exp(log_x))
    low, high = log_x < -30, log_1mx < -30
    out[low] = np.exp(a * log_x[low] - np.log(a) - special.betaln(a, b))
    out[high] = -np.expm1(b * log_1mx[high] - np.log(b) - special.betaln(a, b))
    return out


@pytest.mark.parametrize("alpha", [1e-3, 0.05, 0.5, 5.0])
def test_log_dirichlet_marginal_is_beta(alpha: float) -> None:
    """q_0 of Dir(alpha 1_10) is Beta(alpha, 9 alpha), checked in log space so that values within 1e-300
    of 0 or 1 (most of them at alpha = 1e-3) count too; KS at n = 4000 also rejects a 10% error in alpha."""
    log_q = sample_log_dirichlet(alpha, 4000, 10, np.random.default_rng(7))
    assert np.isfinite(log_q).all()
    np.testing.assert_allclose(np.exp(log_q).sum(axis=1), 1.0, rtol=1e-12)
    log_rest = special.logsumexp(log_q[:, 1:], axis=1)  # log(1 - q_0), exact where 1 - q_0 rounds to 0
    u = _beta_cdf_from_log(log_q[:, 0], log_rest, alpha, 9 * alpha)
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    wrong = _beta_cdf_from_log(log_q[:, 0], log_rest, 1.1 * alpha, 9 * alpha)
    assert stats.kstest(wrong, "uniform").pvalue < 1e-3  # power check


def test_log_dirichlet_tiny_alpha_top_share_and_argmax() -> None:
    """alpha = 1e-3: P(max share > 0.99) = 10 P(q_0 > 0.99) exactly (the events are disjoint), and the
    favoured class is uniform."""
    q = np.exp(sample_log_dirichlet(1e-3, 5000, 10, np.random.default_rng(8)))
    expected = 10 * stats.beta(1e-3, 9e-3).sf(0.99)
    assert stats.binomtest(int((q.max(axis=1) > 0.99).sum()), 5000, expected).pvalue > 1e-3
    assert stats.chisquare(np.bincount(q.argmax(axis=1), minlength=10)).pvalue > 1e-3


# ---------------------------------------------------------------------------- dirichlet-equal partition


def _check_equal_partition(parts: list[np.ndarray], n_records: int, num_clients: int, size: int) -> None:
    assert len(parts) == num_clients
    assert all(p.dtype == np.int64 and p.size == size for p in parts)
    everything = np.concatenate(parts)
    assert np.unique(everything).size == everything.size  # disjoint, no record twice
    assert everything.min() >= 0 and everything.max() < n_records


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 60), min_size=1, max_size=8).filter(lambda c: sum(c) >= 1),
    num_clients=st.integers(1, 30),
    alpha=st.sampled_from([1e-3, 0.05, 0.5, 5.0, 1e3]),
    seed=st.integers(0, 2**32),
)
def test_equal_partition_invariants(counts: list[int], num_clients: int, alpha: float, seed: int) -> None:
    labels = np.repeat(np.arange(len(counts)), counts)
    np.random.default_rng(seed).shuffle(labels)
    if num_clients > labels.size:
        with pytest.raises(ValueError, match="exceeds"):
            dirichlet_equal_partition(labels, num_clients=num_clients, alpha=alpha, rng=np.random.default_rng(seed))
        return
    parts = dirichlet_equal_partition(labels, num_clients=num_clients, alpha=alpha, rng=np.random.default_rng(seed))
    size = labels.size // num_clients
    _check_equal_partition(parts, labels.size, num_clients, size)
    assert labels.size - num_clients * size <= num_clients - 1


def test_equal_partition_uses_every_record_when_divisible_and_size_option() -> None:
    parts = dirichlet_equal_partition(BALANCED, num_clients=50, alpha=0.5, rng=np.random.default_rng(0))
    _check_equal_partition(parts, 7000, 50, 140)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(7000))
    parts = dirichlet_equal_partition(BALANCED[:7003], num_clients=50, alpha=0.5, rng=np.random.default_rng(0))
    assert 7003 - np.concatenate(parts).size == 3
    parts = dirichlet_equal_partition(BALANCED, num_clients=20, alpha=0.5, rng=np.random.default_rng(0), size=30)
    _check_equal_partition(parts, 7000, 20, 30)
    with pytest.raises(ValueError, match="only 7000 exist"):
        dirichlet_equal_partition(BALANCED, num_clients=20, alpha=0.5, rng=np.random.default_rng(0), size=351)


def test_equal_partition_bad_arguments() -> None:
    rng = np.random.default_rng(0)
    for alpha in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alpha"):
            dirichlet_equal_partition(BALANCED, num_clients=5, alpha=alpha, rng=rng)
    with pytest.raises(ValueError, match="integer"):
        dirichlet_equal_partition(BALANCED.astype(float), num_clients=5, alpha=0.5, rng=rng)
    with pytest.raises(ValueError, match="non-negative"):
        dirichlet_equal_partition(BALANCED - 1, num_clients=5, alpha=0.5, rng=rng)
    with pytest.raises(ValueError, match="num_clients"):
        dirichlet_equal_partition(BALANCED, num_clients=0, alpha=0.5, rng=rng)


def test_counts_follow_multinomial_of_q_when_no_class_runs_out() -> None:
    """Without exhaustion each client's class counts are Multinomial(size, q_i) exactly.

    q_i are the function's first draws from ``rng`` (documented order), so an identically seeded generator
    reproduces them. Pearson chi-square over 20 clients x 10 classes (180 dof); the second assertion shows
    the test rejects counts drawn from the wrong q (another client's).
    """
    labels = np.repeat(np.arange(10), 10_000)  # 20 x 500 = 10,000 draws: no class can run out
    q = np.exp(sample_log_dirichlet(5.0, 20, 10, np.random.default_rng(11)))
    parts = dirichlet_equal_partition(labels, num_clients=20, alpha=5.0, rng=np.random.default_rng(11), size=500)
    observed = np.array([np.bincount(labels[p], minlength=10) for p in parts])
    expected = 500 * q
    dof = 20 * 9
    assert stats.chi2.sf(((observed - expected) ** 2 / expected).sum(), dof) > 1e-3
    wrong = 500 * np.roll(q, 1, axis=0)
    assert stats.chi2.sf(((observed - wrong) ** 2 / wrong).sum(), dof) < 1e-6


def _per_record_fill_counts(labels: np.ndarray, q: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Reference: the interleaved fill done literally, one client and one record at a time."""
    num_clients, num_classes = q.shape
    remaining = np.bincount(labels, minlength=num_classes)
    counts = np.zeros((num_clients, num_classes))
    for _ in range(size):
        for i in rng.permutation(num_clients):
            cdf = np.cumsum(q[i] * (remaining > 0))
            c = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
            remaining[c] -= 1
            counts[i, c] += 1
    return counts


def test_block_fill_matches_record_by_record_law(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scarce classes (20 of 240 records in class 0) force exhaustion and contested passes. With q fixed,
    the mean class counts of every client over 600 fills agree with the literal per-record fill within
    4.5 standard errors (Bonferroni over 48 cells at about 3e-4 overall)."""
    labels = np.repeat(np.arange(4), [20, 50, 70, 100])
    log_q = np.log(np.random.default_rng(0).dirichlet(np.full(4, 0.7), 12))
    monkeypatch.setattr(partition, "sample_log_dirichlet", lambda *args: log_q)
    reps = 600
    ours = np.array(
        [
            np.array(
                [
                    np.bincount(labels[p], minlength=4)
                    for p in dirichlet_equal_partition(
                        labels, num_clients=12, alpha=1.0, rng=np.random.default_rng(seed)
                    )
                ]
            )
            for seed in range(reps)
        ]
    )
    reference = np.array(
        [
            _per_record_fill_counts(labels, np.exp(log_q), 20, np.random.default_rng(10**6 + seed))
            for seed in range(reps)
        ]
    )
    se = np.sqrt((ours.var(axis=0) + reference.var(axis=0)) / reps)
    z = (ours.mean(axis=0) - reference.mean(axis=0)) / np.where(se > 0, se, 1.0)
    assert np.abs(z).max() < 4.5, np.round(z, 1)
    assert ours[:, :, 0].sum(axis=1).min() == 20  # class 0 always fully used: exhaustion did happen


def test_skew_grows_as_alpha_shrinks() -> None:
    tv = [
        _mean_tv_to_pool(
            BALANCED,
            dirichlet_equal_partition(BALANCED, num_clients=50, alpha=a, rng=np.random.default_rng(3)),
        )
        for a in (100.0, 5.0, 0.5, 0.05)
    ]
    # alpha = 100 is near IID: what remains is multinomial noise of 140 draws (about 0.1).
    assert tv[0] < 0.15 and tv[-1] > 0.6, tv
    assert all(b - a > 0.05 for a, b in itertools.pairwise(tv)), tv


def _sequential_fill(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Negative control: the same draws but clients filled one after another (what interleaving avoids)."""
    num_classes = int(labels.max()) + 1
    size = labels.size // num_clients
    log_q = sample_log_dirichlet(alpha, num_clients, num_classes, rng)
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
    remaining = np.array([len(p) for p in pools])
    parts = []
    for i in range(num_clients):
        records = []
        for _ in range(size):
            logits = np.where(remaining > 0, log_q[i], -np.inf)
            p = np.exp(logits - logits.max())
            c = int(rng.choice(num_classes, p=p / p.sum()))
            records.append(pools[c].pop())
            remaining[c] -= 1
        parts.append(np.array(records))
    return parts


def test_interleaved_fill_keeps_last_clients_on_their_dirichlet_draw() -> None:
    """Mean TV between a client's realised class shares and its own q_i: last 10 vs first 10 clients.

    Interleaved, running out of classes hits every client alike (measured gap below 0.05 over these seeds);
    the sequential negative control leaves the last clients with the leftovers (gap about 0.4).
    """
    gaps, control_gaps = [], []
    for seed in range(4):
        q = np.exp(sample_log_dirichlet(0.5, 50, 10, np.random.default_rng(seed)))
        parts = dirichlet_equal_partition(BALANCED, num_clients=50, alpha=0.5, rng=np.random.default_rng(seed))
        tv = 0.5 * np.abs(_shares(BALANCED, parts) - q).sum(axis=1)
        gaps.append(tv[-10:].mean() - tv[:10].mean())
        control = _sequential_fill(BALANCED, 50, 0.5, np.random.default_rng(seed))
        tv = 0.5 * np.abs(_shares(BALANCED, control) - q).sum(axis=1)
        control_gaps.append(tv[-10:].mean() - tv[:10].mean())
    assert abs(np.mean(gaps)) < 0.05, gaps
    assert np.mean(control_gaps) > 0.2, control_gaps


def test_thousand_clients_tiny_alpha_valid() -> None:
    """(Its speed is measured in benchmarks/bench_partition.py.)"""
    labels = np.repeat(np.arange(10), 7000)
    parts = dirichlet_equal_partition(labels, num_clients=1000, alpha=0.05, rng=np.random.default_rng(5))
    _check_equal_partition(parts, 70_000, 1000, 70)
    parts = dirichlet_equal_partition(labels, num_clients=50, alpha=1e-3, rng=np.random.default_rng(5))
    _check_equal_partition(parts, 70_000, 50, 1400)
    assert _mean_tv_to_pool(labels, parts) > 0.7


# ------------------------------------------------------------------------------- other schemes


def test_per_class_partition() -> None:
    for alpha in (0.05, 0.5):
        parts = dirichlet_per_class_partition(
            BALANCED, num_clients=50, alpha=alpha, rng=np.random.default_rng(1), min_size=20
        )
        everything = np.concatenate(parts)
        np.testing.assert_array_equal(np.sort(everything), np.arange(7000))  # every record exactly once
        sizes = [p.size for p in parts]
        assert min(sizes) >= 20 and max(sizes) > 2 * min(sizes)  # unequal sizes, floor respected
    skew = [
        _mean_tv_to_pool(
            BALANCED,
            dirichlet_per_class_partition(BALANCED, num_clients=50, alpha=a, rng=np.random.default_rng(2)),
        )
        for a in (100.0, 0.5)
    ]
    assert skew[0] < 0.1 < 0.4 < skew[1]
    # Most clients start empty here (Dir(0.01) over 300 clients); the top-up is bounded and exact.
    parts = dirichlet_per_class_partition(
        BALANCED, num_clients=300, alpha=0.01, rng=np.random.default_rng(3), min_size=15
    )
    assert min(p.size for p in parts) == 15 and sum(p.size for p in parts) == 7000
    with pytest.raises(ValueError, match="min_size"):
        dirichlet_per_class_partition(BALANCED, num_clients=50, alpha=0.5, rng=np.random.default_rng(0), min_size=141)


def test_iid_partition() -> None:
    parts = iid_partition(BALANCED, num_clients=50, rng=np.random.default_rng(0))
    _check_equal_partition(parts, 7000, 50, 140)
    assert _mean_tv_to_pool(BALANCED, parts) < 0.15


# ----------------------------------------------------------------------------- federated partition


def _check_roles(p: FederatedPartition, num_clients: int, num_unseen: int, context: int) -> None:
    assert p.num_clients == num_clients and len(p.unseen) == num_unseen
    assert p.seen == tuple(sorted(set(range(num_clients)) - set(p.unseen)))
    owned = np.concatenate([c.records for c in p.clients])
    assert np.unique(owned).size == owned.size  # clients disjoint
    for c in p.clients:
        assert isinstance(c, ClientIndices) and p.client(c.client_id) is c
        assert c.context.size == context and c.eval.size > 0
        assert np.intersect1d(c.context, c.eval).size == 0  # context never used for accuracy
        if c.seen:
            assert np.intersect1d(c.train, c.eval).size == 0
            assert np.isin(c.context, c.train).all()
        else:
            assert c.train.size == 0


def test_federated_partition_spec_defaults_on_mnist_shape() -> None:
    labels = np.repeat(np.arange(10), 7000)
    p = federated_partition(labels, seed=41)
    _check_roles(p, 50, 10, 333)
    for c in p.clients:
        if c.seen:
            assert (c.train.size, c.eval.size) == (1120, 280)  # 4:1 of 1,400
        else:
            assert c.eval.size == 1400 - 333
    assert class_histogram(labels, p).sum() == 70_000
    with pytest.raises(IndexError):
        p.client(50)


def test_federated_partition_determined_by_seed() -> None:
    a = federated_partition(BALANCED, num_clients=20, num_unseen=5, context_size=50, seed=41)
    b = federated_partition(BALANCED, num_clients=20, num_unseen=5, context_size=50, seed=41)
    c = federated_partition(BALANCED, num_clients=20, num_unseen=5, context_size=50, seed=42)
    assert a.unseen == b.unseen
    for x, y in zip(a.clients, b.clients, strict=True):
        for field in ("train", "eval", "context"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field))
    assert a.unseen != c.unseen or any(
        not np.array_equal(x.eval, y.eval) for x, y in zip(a.clients, c.clients, strict=True)
    )
    assert not np.array_equal(class_histogram(BALANCED, a), class_histogram(BALANCED, c))


def test_unseen_choice_is_uniform_over_clients() -> None:
    """Over 400 seeds each of 10 clients is unseen about 400 * 3 / 10 times (chi-square, 9 dof)."""
    counts = np.zeros(10)
    for seed in range(400):
        p = federated_partition(
            np.repeat(np.arange(2), 50), num_clients=10, num_unseen=3, context_size=2, alpha=1.0, seed=seed
        )
        counts[list(p.unseen)] += 1
    assert stats.chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("scheme", ["dirichlet-per-class", "iid"])
def test_federated_partition_other_schemes(scheme: str) -> None:
    p = federated_partition(BALANCED, num_clients=20, num_unseen=4, context_size=60, scheme=scheme, seed=1)  # type: ignore[arg-type]
    _check_roles(p, 20, 4, 60)
    if scheme == "iid":
        assert {c.records.size for c in p.clients} == {350}


def test_federated_partition_errors() -> None:
    with pytest.raises(ValueError, match="client .* has 20 records but a client needs at least 416"):
        federated_partition(np.repeat(np.arange(10), 100), seed=0)
    with pytest.raises(ValueError, match="scheme"):
        federated_partition(BALANCED, scheme="sequential", seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_unseen"):
        federated_partition(BALANCED, num_clients=5, num_unseen=6, context_size=5, seed=0)
    with pytest.raises(ValueError, match="eval_fraction"):
        federated_partition(BALANCED, eval_fraction=1.0, seed=0)


def test_table_and_plot(tmp_path: Path) -> None:
    p = federated_partition(BALANCED, num_clients=20, num_unseen=4, context_size=50, seed=41)
    hist = class_histogram(BALANCED, p)
    assert hist.shape == (20, 10) and (hist.sum(axis=1) == 350).all()
    table = format_partition_table(BALANCED, p, max_rows=5)
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["client", "role", "n_train", "n_eval", "n_ctx"]
    assert len(lines) == 1 + 5 + 2 and "15 more clients" in lines[6] and "4 unseen" in lines[7]
    first = lines[1].split()
    assert [int(v) for v in first[5:15]] == hist[0].tolist()
    role = "seen" if p.clients[0].seen else "unseen"
    assert first[1] == role
    out = plot_partition(BALANCED, p, tmp_path / "sub" / "part.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_validation_split_replaces_or_sits_beside_the_test_split() -> None:
    base = federated_partition(BALANCED, num_clients=10, num_unseen=2, context_size=20, seed=41)
    replaced = partition.holdout_validation(base, fraction=0.2, seed=41)
    beside = partition.holdout_validation(base, fraction=0.2, seed=41, alongside=True)
    for b, r, a in zip(base.clients, replaced.clients, beside.clients):
        if not b.seen:  # unseen: not evaluated when the split replaces the test one, their query set otherwise
            assert r.eval.size == 0 and np.array_equal(a.eval, b.eval) and a.val.size == 0
            continue
        assert np.array_equal(a.val, r.eval) and a.val.size == round(0.2 * b.train.size)  # the same records
        assert np.array_equal(a.train, r.train) and np.array_equal(a.eval, b.eval) and r.val.size == 0
        assert np.array_equal(np.union1d(a.train, a.val), b.train) and np.intersect1d(a.val, b.context).size == 0
        assert np.array_equal(a.records, b.records)
