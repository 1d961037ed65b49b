"""Lattices for the rejection-sampled universal quantiser (steps 2-3 in ``docs/codecs.md``).

A lattice ``L`` supplies: its nearest-point quantiser ``Q``; a dither ``V`` uniform on its Voronoi cell
``V0``, built exactly from raw 64-bit words; and the cell scale ``beta / rho`` that makes the scaled cell
``beta V0`` contain the ball ``B(0, rho)`` (the packing radius of ``beta L`` is at least ``rho``). With that,
``E = beta (Q(u/beta - V) + V) - u`` is uniform on ``beta V0`` and independent of ``u`` (subtractive dithering),
and accepting ``||E|| <= rho`` leaves ``E`` uniform on the ball, with acceptance probability
``p = vol(B(0, rho)) / vol(beta V0)``.

Every quantity the entropy coder conditions on (the dither, its distance to the cell boundary) is formed
with exact float operations on integers from the generator, so encoder and decoder agree bit for bit on any
IEEE-754 machine; transcendental functions enter only through the radius, which the coder never sees.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

_TWO_M53 = 2.0**-53
_ONES4 = np.ones(4)


def unit_ball_volume(b: int) -> float:
    """vol of the unit ball in R^b, from pi and factorials by multiplications only (reproducible everywhere)."""
    if b % 2 == 0:
        return math.pi ** (b // 2) / math.factorial(b // 2)
    h = (b - 1) // 2
    return 2.0**b * math.pi**h * math.factorial(h) / math.factorial(b)


def words_to_unit(words: np.ndarray) -> np.ndarray:
    """Top 53 bits of each word as an exact dyadic number in [0, 1)."""
    out = (words >> np.uint64(11)).astype(np.float64)
    out *= _TWO_M53
    return out


class Lattice(ABC):
    """A lattice in R^b with everything the quantiser needs."""

    name: str
    lattice_id: int
    b: int
    # beta / rho: the smallest scale at which the scaled Voronoi cell contains the ball of radius rho.
    cell_scale: float
    # max |V_i| over the Voronoi cell, the reference for the boundary distance used as coding context.
    coord_radius: float

    @abstractmethod
    def quantize(self, x: np.ndarray) -> np.ndarray:
        """Nearest lattice point of each row of ``x`` (float array of integers)."""

    @abstractmethod
    def dither(self, words: np.ndarray) -> np.ndarray:
        """Rows uniform on the Voronoi cell from raw uint64 words of shape (n, b)."""

    @abstractmethod
    def cell_volume(self) -> float:
        """Volume of the Voronoi cell of the unscaled lattice (its determinant)."""

    def contains(self, m: np.ndarray) -> np.ndarray:
        """Whether each integer row of ``m`` is a lattice point (every row of Z^b is)."""
        return np.ones(m.shape[0], dtype=bool)

    @property
    def accept_prob(self) -> float:
        """p = vol(unit ball) / vol(cell_scale * V0): the Geometric law of the iteration count K."""
        return unit_ball_volume(self.b) / (self.cell_volume() * self.cell_scale**self.b)

    def boundary_context(self, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per coordinate: distance of the dither to the cell boundary in [0, 1/2], and the side (+1/-1).

        ``M_i`` can be non-zero only when ``u_i + E_i`` leaves the cell, which the dither being near the boundary
        on the opposite side makes likely; the side is ``-sign(V_i)`` (``+1`` at ``V_i = 0``). Exact arithmetic.
        """
        delta = np.abs(v)
        np.subtract(self.coord_radius, delta, out=delta)
        delta *= 0.5 / self.coord_radius
        side = (v > 0).astype(np.int64)
        side *= -2
        side += 1
        return delta, side


class IntegerLattice(Lattice):
    """Z^b with the cube cell; ``beta = 2 rho`` (cell side = ball diameter), ``p = vol(B_b) / 2^b``."""

    lattice_id = 1
    cell_scale = 2.0
    coord_radius = 0.5

    def __init__(self, b: int) -> None:
        self.b = b
        self.name = "Z"

    def quantize(self, x: np.ndarray) -> np.ndarray:
        out = x + 0.5
        return np.floor(out, out=out)

    def dither(self, words: np.ndarray) -> np.ndarray:
        out = words_to_unit(words)
        out -= 0.5
        return out

    def cell_volume(self) -> float:
        return 1.0


class D4Lattice(Lattice):
    """D4 = {m in Z^4 : sum(m) even} with its 24-cell; ``beta = sqrt(2) rho``, ``p = pi^2 / 16 = 0.617``.

    Quantiser: Conway & Sloane (1982) -- round every coordinate; if the sum is odd, re-round the coordinate with
    the largest rounding error the other way. Dither: ``W`` uniform on the fundamental domain [0,2) x [0,1)^3 of
    D4 (exact from the words), then ``V = W - Q(W)`` is uniform on the Voronoi cell.
    """

    lattice_id = 2
    cell_scale = math.sqrt(2.0)
    coord_radius = 1.0

    def __init__(self) -> None:
        self.b = 4
        self.name = "D4"

    def quantize(self, x: np.ndarray) -> np.ndarray:
        f = x + 0.5
        np.floor(f, out=f)
        r = x - f
        odd = ((f @ _ONES4).astype(np.int64) & 1).nonzero()[0]  # rows with an odd sum (an exact integer in float64)
        r_odd = r.take(odd, axis=0)
        worst = np.abs(r_odd).argmax(axis=1)
        step = np.where(r_odd.ravel().take(np.arange(0, 4 * odd.size, 4) + worst) >= 0.0, 1.0, -1.0)
        f.ravel()[odd * 4 + worst] += step
        return f

    def dither(self, words: np.ndarray) -> np.ndarray:
        w = words_to_unit(words)
        w[:, 0] *= 2.0
        return w - self.quantize(w)

    def cell_volume(self) -> float:
        return 2.0

    def contains(self, m: np.ndarray) -> np.ndarray:
        return np.remainder(m.sum(axis=1), 2) == 0


def make_lattice(name: str, b: int) -> Lattice:
    """``"Z"`` for any block size 1..8, ``"D4"`` for b = 4."""
    if name == "Z":
        return IntegerLattice(b)
    if name == "D4":
        if b != 4:
            raise ValueError(f"lattice 'D4' needs block_size=4, got {b}")
        return D4Lattice()
    raise ValueError(f"unknown lattice {name!r}; use 'Z' or 'D4'")
