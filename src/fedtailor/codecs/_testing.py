"""Broken LRSUQ and PPR variants: the negative controls the exactness batteries must reject.

Each repeats one defect seen in public implementations of the idea, by overriding one hook of
:class:`~fedtailor.codecs.lrsuq.LRSUQCodec`; all still produce messages that decode without error, which is
what makes the defects dangerous. Test fixtures only; never use them for a release.
"""

from __future__ import annotations

import numpy as np

from fedtailor.codecs.base import release_key
from fedtailor.codecs.lrsuq import LRSUQCodec
from fedtailor.codecs.ppr import PPRCodec
from fedtailor.rng import derive_key, derive_seed


class ChiBRadius(LRSUQCodec):
    """Layer radius sigma * chi_b instead of chi_{b+2}: the ball mixture is no longer N(0, sigma^2 I)."""

    def radius_dof(self) -> int:
        return self.block_size


class SmallCell(LRSUQCodec):
    """Cell side 1.9 rho: the cube no longer contains the ball, E is uniform on ball-cap-cube (light tails)."""

    def cell_scale(self) -> float:
        return 1.9


class DitherOffByOne(LRSUQCodec):
    """The decoder adds the dither of iteration K - 1 instead of K: a rejected one (K = 1 keeps its own, there is
    no iteration 0)."""

    def decoder_iteration(self, k: np.ndarray) -> np.ndarray:
        return np.maximum(k - 1, 1)


class SplitRadius(LRSUQCodec):
    """Encoder and decoder draw the radius from different generators (e.g. each from its own global RNG)."""

    def decoder_radius(self, key: int, sigma: float, n_blocks: int) -> np.ndarray:
        return self.radius(derive_seed(key, "decoder's own generator"), sigma, n_blocks)


class FixedSeed(LRSUQCodec):
    """Shared randomness from a constant seed: every release reuses the same radius and dithers."""

    def stream_key(self, key: int, purpose: str) -> int:
        return derive_key(0, "lrsuq", purpose)


class AcceptOnLattice(LRSUQCodec):
    """Acceptance tested on beta M - u instead of beta (M + V) - u."""

    def candidate_error(self, m: np.ndarray, v: np.ndarray, x: np.ndarray) -> np.ndarray:
        return m - x


def reused_release_key(secret: int, client: int, round: int) -> int:
    """A key schedule that forgets the round: the same key for every release of a client."""
    return release_key(secret, client, 0)


BROKEN_VARIANTS: dict[str, type[LRSUQCodec]] = {
    "chi_b radius": ChiBRadius,
    "cell 1.9 rho": SmallCell,
    "dither index off by one": DitherOffByOne,
    "radius from different generators": SplitRadius,
    "fixed seed (reused across releases)": FixedSeed,
    "acceptance on beta M - u": AcceptOnLattice,
}


class WrongProposal(PPRCodec):
    """The encoder scores candidates with the ratio of a proposal 1.5 times wider than the one they are drawn
    from: the selected sample follows P Q / Q', not P."""

    def ratio_variance(self, sigma: float, dim: int) -> float:
        return 1.5 * self.proposal_variance(sigma, dim)


class ReusedRandomness(PPRCodec):
    """Shared randomness (rotation and candidates) from a constant key: every release reuses the same candidates."""

    def stream_key(self, key: int, purpose: str) -> int:
        return derive_key(0, "ppr", purpose)


class IndexOffByOne(PPRCodec):
    """The decoder outputs candidate K + 1 instead of K: a draw from Q, not P."""

    def decoder_label(self, k: np.ndarray) -> np.ndarray:
        return k + 1


class TruncatedSearch(PPRCodec):
    """A fixed search budget: the argmin over the first 8 candidates of each block, no stopping rule, no tail.

    (A budget of 32, which cuts about 0.3% of the blocks at eps = 16, is below the battery's resolution.)"""

    def first_labels(self, sigma: float, dim: int) -> int:
        return 8

    def stop_mass(self, best: np.ndarray, log_rmax: np.ndarray, t_last: np.ndarray) -> np.ndarray:
        return np.zeros_like(best)


BROKEN_PPR: dict[str, type[PPRCodec]] = {
    "wrong proposal in the ratio": WrongProposal,
    "reused shared randomness": ReusedRandomness,
    "index off by one": IndexOffByOne,
    "truncated search": TruncatedSearch,
}
