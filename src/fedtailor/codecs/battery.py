"""Statistical batteries for exactness of the LRSUQ and PPR codecs (``docs/codecs.md``, "Exactness").

:func:`exactness_battery` (LRSUQ) is described here; :func:`ppr_exactness_battery` in its docstring.

Each input class is released once (``n_blocks`` blocks, fresh key per release) through the codec's bytes
(``encode`` then ``decode``); ``E = y - u``. Per class:

* ``coord{i}/ks``, ``coord{i}/ad``: each block coordinate against ``N(0, sigma^2)`` (Kolmogorov-Smirnov, and
  Anderson-Darling with the asymptotic law of Marsaglia & Marsaglia 2004);
* ``norm2``: ``||E||^2 / sigma^2`` against chi^2_b (KS);
* ``K``: iteration counts against Geometric(p) (chi-square; b = 1 requires K = 1);
* ``radial``: conditional on the layer, ``(||E|| / rho)^b`` against Uniform(0, 1) (KS) -- E uniform in the ball;
* ``tail``: conditional on the layer, the count of ``|E_i| / rho > 0.95`` against its exact binomial law
  (``(E_i / rho)^2 ~ Beta(1/2, (b + 1)/2)``); a cell of side 1.9 rho puts nothing there and passes the rest;
* ``vs-zero/E1``, ``vs-zero/norm2``: two-sample KS against the class ``u = 0`` (independence of E from u).

Across classes: ``K/homogeneity`` (chi-square contingency of K over classes: K independent of u). Across
releases: ``releases/corr``, the Pearson correlation of E between two releases of the same u with consecutive
round keys (catches reused seeds). The battery's p-value is Holm's adjusted minimum, ``min(1, m * min p)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from fedtailor.codecs.base import CodecError, release_key
from fedtailor.codecs.lrsuq import LRSUQCodec
from fedtailor.codecs.ppr import PPRCodec

KeyFn = Callable[[int, int, int], int]
TAIL_THRESHOLD = 0.95


def _adinf(z: float) -> float:
    """Asymptotic CDF of the Anderson-Darling statistic, |error| < 2e-6 (Marsaglia & Marsaglia 2004)."""
    if z <= 0.0:
        return 0.0
    if z < 2.0:
        return (
            math.exp(-1.2337141 / z)
            / math.sqrt(z)
            * (2.00012 + (0.247105 - (0.0649821 - (0.0347962 - (0.011672 - 0.00168691 * z) * z) * z) * z) * z)
        )
    return math.exp(-math.exp(1.0776 - (2.30695 - (0.43424 - (0.082433 - (0.008056 - 0.0003146 * z) * z) * z) * z) * z))


def _errfix(n: int, x: float) -> float:
    """Finite-n correction to :func:`_adinf` (same reference)."""
    if x > 0.8:
        return (-130.2137 + (745.2337 - (1705.091 - (1950.646 - (1116.360 - 255.7844 * x) * x) * x) * x) * x) / n
    c = 0.01265 + 0.1757 / n
    if x < c:
        t = x / c
        t = math.sqrt(t) * (1.0 - t) * (49.0 * t - 102.0)
        return t * (0.0037 / (n * n) + 0.00078 / n + 0.00006) / n
    t = (x - c) / (0.8 - c)
    t = -0.00022633 + (6.54034 - (14.6538 - (14.458 - (8.259 - 1.91864 * t) * t) * t) * t) * t
    return t * (0.04213 / n + 0.01365 / (n * n)) / n


def anderson_darling(x: np.ndarray, dist: stats.rv_continuous) -> tuple[float, float]:
    """(A^2, p-value) of the one-sample AD test against the fully specified ``dist`` (no estimated parameters)."""
    x = np.sort(np.asarray(x, dtype=np.float64))
    n = x.size
    i = np.arange(1, n + 1)
    a2 = -n - float(np.sum((2 * i - 1) * (dist.logcdf(x) + dist.logsf(x[::-1])))) / n
    if not math.isfinite(a2):
        return a2, 0.0
    cdf = _adinf(a2)
    cdf = cdf + _errfix(n, cdf)
    return a2, float(min(1.0, max(0.0, 1.0 - cdf)))


@dataclass
class BatteryResult:
    """p-values of every test in the battery and the Holm-corrected verdict."""

    pvalues: dict[str, float]
    alpha: float
    notes: dict[str, float | str] = field(default_factory=dict)

    @property
    def holm_p(self) -> float:
        """Holm's smallest adjusted p-value, ``min(1, m * min_i p_i)``: the battery's p-value."""
        m = len(self.pvalues)
        return min(1.0, m * min(self.pvalues.values()))

    def adjusted(self) -> dict[str, float]:
        """Holm step-down adjusted p-values of every test."""
        names = sorted(self.pvalues, key=self.pvalues.__getitem__)
        m, running, out = len(names), 0.0, {}
        for rank, name in enumerate(names):
            running = max(running, min(1.0, (m - rank) * self.pvalues[name]))
            out[name] = running
        return out

    def rejected(self) -> list[str]:
        """Tests whose Holm-adjusted p-value is below alpha."""
        return [name for name, p in self.adjusted().items() if p < self.alpha]

    @property
    def passed(self) -> bool:
        return self.holm_p >= self.alpha

    def worst(self, count: int = 5) -> list[tuple[str, float]]:
        return sorted(self.pvalues.items(), key=lambda kv: kv[1])[:count]


def input_classes(n_blocks: int, b: int, sigma: float, *, seed: int) -> dict[str, np.ndarray]:
    """The extreme inputs of the independence tests, each of dimension ``n_blocks * b``.

    ``zero``; ``tiny`` (1e-12 sigma with signs, a few subnormals); ``huge`` (+-1e3 sigma); ``boundary``
    (half-integer multiples of the cell side at the median radius, i.e. faces of the undithered cells:
    ``(n + 1/2) * 2 sigma * median(chi_{b+2})``; with dithering no input is special, which is the claim);
    ``gaussian`` (the eps = 16 regime: ``N(0, 1/16384)`` per coordinate, i.e. ``||u|| = 1`` at k = 16,384).
    """
    d = n_blocks * b
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=d)
    tiny = 1e-12 * sigma * signs
    tiny[:8] = 5e-324 * signs[:8]
    side = 2.0 * sigma * math.sqrt(stats.chi2(b + 2).median())
    return {
        "zero": np.zeros(d),
        "tiny": tiny,
        "huge": 1e3 * sigma * signs,
        "boundary": (rng.integers(-8, 8, size=d) + 0.5) * side,
        "gaussian": rng.standard_normal(d) / math.sqrt(16384.0),
    }


def _geometric_bins(p: float, n: int) -> tuple[int, np.ndarray]:
    """Number of cells J (K = 1..J-1 and K >= J) with expected counts >= 5, and their probabilities."""
    j = 1
    while n * p * (1 - p) ** j >= 5.0 and j < 60:
        j += 1
    probs = np.array([p * (1 - p) ** (i - 1) for i in range(1, j)] + [(1 - p) ** (j - 1)])
    return j, probs


def _bin_k(k: np.ndarray, j: int) -> np.ndarray:
    return np.bincount(np.minimum(k, j) - 1, minlength=j)


def exactness_battery(
    codec: LRSUQCodec,
    *,
    sigma: float = 0.01468,
    n_blocks: int = 16384,
    secret: int = 2024,
    alpha: float = 0.01,
    key_fn: KeyFn = release_key,
) -> BatteryResult:
    """Run the battery on ``codec`` (through its bytes) and return every p-value (module docstring).

    Keys come from ``key_fn(secret, client, round)``: class c is client c in round 0; the two releases of the
    correlation test are rounds 1 and 2 of client 0.
    """
    b = codec.block_size
    normal = stats.norm(0.0, sigma)
    p0_tail = float(stats.beta(0.5, (b + 1) / 2).sf(TAIL_THRESHOLD**2))
    classes = input_classes(n_blocks, b, sigma, seed=secret)
    pv: dict[str, float] = {}
    notes: dict[str, float | str] = {}
    errors: dict[str, np.ndarray] = {}
    ks: dict[str, np.ndarray] = {}

    def release(u: np.ndarray, key: int) -> tuple[np.ndarray, np.ndarray]:
        msg = codec.encode(u, key=key, sigma=sigma)
        y = codec.decode(msg, key=key, sigma=sigma, dim=u.size)
        k, _, _ = codec.decode_indices(msg, key=key, sigma=sigma, dim=u.size)
        return (y - u).reshape(-1, b), k

    for ci, (cname, u) in enumerate(classes.items()):
        key = key_fn(secret, ci, 0)
        try:
            e, k = release(u, key)
        except CodecError as err:  # a codec that cannot release a valid input fails outright
            pv[f"{cname}/release"] = 0.0
            notes[f"{cname}/release_error"] = str(err)
            continue
        rho = codec.radius(key, sigma, n_blocks)
        errors[cname], ks[cname] = e, k
        for i in range(b):
            pv[f"{cname}/coord{i}/ks"] = float(stats.kstest(e[:, i], normal.cdf).pvalue)
            pv[f"{cname}/coord{i}/ad"] = anderson_darling(e[:, i], normal)[1]
        norm2 = np.einsum("ij,ij->i", e, e)
        pv[f"{cname}/norm2"] = float(stats.kstest(norm2 / sigma**2, stats.chi2(b).cdf).pvalue)
        if codec.law.coded:
            j, probs = _geometric_bins(codec.law.p, n_blocks)
            pv[f"{cname}/K"] = float(stats.chisquare(_bin_k(k, j), probs * n_blocks).pvalue)
        else:
            pv[f"{cname}/K"] = 1.0 if np.all(k == 1) else 0.0
        radial = np.sqrt(norm2) / rho
        # Mass beyond the ball (radial > 1, cdf = 1 there) counts against the fit like any other deviation.
        pv[f"{cname}/radial"] = float(stats.kstest(radial**b, "uniform").pvalue)
        notes[f"{cname}/max_radial"] = float(radial.max())
        tail = int(np.count_nonzero(np.abs(e) / rho[:, None] > TAIL_THRESHOLD))
        pv[f"{cname}/tail"] = float(stats.binomtest(tail, e.size, p0_tail).pvalue)
        notes[f"{cname}/tail_count"] = tail
        notes[f"{cname}/tail_expected"] = p0_tail * e.size
        if cname != "zero" and "zero" in errors:
            pv[f"{cname}/vs-zero/E1"] = float(stats.ks_2samp(e[:, 0], errors["zero"][:, 0]).pvalue)
            pv[f"{cname}/vs-zero/norm2"] = float(
                stats.ks_2samp(norm2, np.einsum("ij,ij->i", errors["zero"], errors["zero"])).pvalue
            )
    if codec.law.coded and len(ks) >= 2:
        j, _ = _geometric_bins(codec.law.p, n_blocks)
        table = np.stack([_bin_k(k, j) for k in ks.values()])
        table = table[:, table.sum(axis=0) > 0]
        pv["K/homogeneity"] = float(stats.chi2_contingency(table).pvalue)
    u = classes["gaussian"]
    try:
        e1, _ = release(u, key_fn(secret, 0, 1))
        e2, _ = release(u, key_fn(secret, 0, 2))
        pv["releases/corr"] = float(stats.pearsonr(e1.ravel(), e2.ravel()).pvalue)
    except CodecError as err:
        pv["releases/release"] = 0.0
        notes["releases/release_error"] = str(err)
    return BatteryResult(pv, alpha, notes)


def ppr_input_classes(dim: int, clip: float, *, seed: int) -> dict[str, np.ndarray]:
    """The inputs of :func:`ppr_exactness_battery`, each of dimension ``dim``: ``zero``; ``tiny`` (1e-12 clip with
    signs, a few subnormals); ``gaussian`` (``||u|| = clip`` along a random direction: the eps = 16 regime at
    k = 16,384, clip 1); ``spike`` (the whole clip on one coordinate); ``flat`` (``clip / sqrt(k)`` everywhere);
    ``above`` (``||u|| = 1.25 clip``: beyond the bound the public proposal was built for, released at a higher search
    cost). Inputs far beyond the clip are refused by the codec, not released approximately (tested apart)."""
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=dim)
    tiny = 1e-12 * clip * signs
    tiny[:8] = 5e-324 * signs[:8]
    direction = rng.standard_normal(dim)
    direction /= np.linalg.norm(direction)
    return {
        "zero": np.zeros(dim),
        "tiny": tiny,
        "gaussian": clip * direction,
        "spike": clip * np.eye(1, dim, dim // 3).ravel(),
        "flat": np.full(dim, clip / math.sqrt(dim)),
        "above": 1.25 * clip * direction[::-1].copy(),
    }


def ppr_exactness_battery(
    codec: PPRCodec,
    *,
    sigma: float = 0.01468,
    dim: int = 16384,
    secret: int = 2025,
    alpha: float = 0.01,
    key_fn: KeyFn = release_key,
) -> BatteryResult:
    """The exactness battery of a PPR codec (through its bytes), on the error ``E = y - u`` per input class.

    In the rotated domain (``E_R = R y - R u``, the blocks the codec samples; a per-block defect would be hidden by
    the inverse rotation's averaging in the output domain): each block coordinate against ``N(0, sigma^2)`` (KS and
    AD), ``||E_block||^2 / sigma^2`` against chi^2_b (KS), the count of ``|E_R| > 3.5 sigma`` against its binomial
    law, the correlation of ``E_R`` with the rotated input (independence from u), the component of ``E_R`` along its
    block's input direction on the 10% of blocks with the largest input (the longest searches: a truncated search
    shows there first) against N(0, 1) (KS), and two-sample KS against the
    class ``u = 0``. In the output domain: all coordinates against ``N(0, sigma^2)`` (KS). Across releases: the
    correlation of E between two releases of one input under consecutive round keys. Holm's correction over all.
    """
    b = codec.block_size
    if dim % b:
        raise ValueError(f"dim must be a multiple of the block size {b}")
    normal = stats.norm(0.0, sigma)
    p_tail = 2.0 * float(stats.norm.sf(3.5))
    pv: dict[str, float] = {}
    notes: dict[str, float | str] = {}
    zero: dict[str, np.ndarray] = {}

    def release(u: np.ndarray, key: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        y = codec.decode(codec.encode(u, key=key, sigma=sigma), key=key, sigma=sigma, dim=u.size)
        rot = codec.rotation(key, u.size)
        return y - u, (rot.forward(y) - rot.forward(u)).reshape(-1, b), rot.forward(u).reshape(-1, b)

    for ci, (cname, u) in enumerate(ppr_input_classes(dim, codec.clip, seed=secret).items()):
        try:
            e, er, xr = release(u, key_fn(secret, ci, 0))
        except CodecError as err:
            pv[f"{cname}/release"] = 0.0
            notes[f"{cname}/release_error"] = str(err)
            continue
        pv[f"{cname}/out/ks"] = float(stats.kstest(e, normal.cdf).pvalue)
        for i in range(b):
            pv[f"{cname}/coord{i}/ks"] = float(stats.kstest(er[:, i], normal.cdf).pvalue)
            pv[f"{cname}/coord{i}/ad"] = anderson_darling(er[:, i], normal)[1]
        norm2 = np.einsum("ij,ij->i", er, er)
        pv[f"{cname}/norm2"] = float(stats.kstest(norm2 / sigma**2, stats.chi2(b).cdf).pvalue)
        tail = int(np.count_nonzero(np.abs(er) > 3.5 * sigma))
        pv[f"{cname}/tail"] = float(stats.binomtest(tail, er.size, p_tail).pvalue)
        notes[f"{cname}/tail_count"] = tail
        if np.any(xr):
            pv[f"{cname}/corr-u"] = float(stats.pearsonr(er.ravel(), xr.ravel()).pvalue)
            # E along its block's input direction, on the 10% of blocks with the largest |x| (the longest searches)
            size = np.sqrt(np.einsum("ij,ij->i", xr, xr))
            top = np.argsort(size)[-max(1, size.size // 10) :]
            top = top[size[top] > 0]
            proj = np.einsum("ij,ij->i", er[top], xr[top]) / (size[top] * sigma)
            pv[f"{cname}/proj-top"] = float(stats.kstest(proj, "norm").pvalue)
        if cname == "zero":
            zero = {"e1": er[:, 0], "norm2": norm2}
        elif zero:
            pv[f"{cname}/vs-zero/E1"] = float(stats.ks_2samp(er[:, 0], zero["e1"]).pvalue)
            pv[f"{cname}/vs-zero/norm2"] = float(stats.ks_2samp(norm2, zero["norm2"]).pvalue)
    u = ppr_input_classes(dim, codec.clip, seed=secret)["gaussian"]
    try:
        e1, _, _ = release(u, key_fn(secret, 0, 1))
        e2, _, _ = release(u, key_fn(secret, 0, 2))
        pv["releases/corr"] = float(stats.pearsonr(e1, e2).pvalue)
    except CodecError as err:
        pv["releases/release"] = 0.0
        notes["releases/release_error"] = str(err)
    return BatteryResult(pv, alpha, notes)
