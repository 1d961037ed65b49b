"""Privacy accountants for a sequence of Gaussian releases (Opacus-style interface; ``docs/privacy.md``).

Every release of fedtailor's private protocols is a Gaussian mechanism ``(sensitivity, sigma)``: the one-shot
context release and the repeated clipped coefficient-gradient releases. Their composition is summarised
exactly by ``rho = sum_j Delta_j^2 / (2 sigma_j^2)`` (equivalently ``mu = sqrt(2 rho)``); the accountants
differ only in how ``rho`` is converted to ``(eps, delta)``:

* ``"closed-form"`` (default, Eq. 7 of *Privacy-Aligned Personalized Federated Learning with Compact
  Adaptation and Variable-Length Gaussian Communication*): ``eps = rho + 2 sqrt(rho log(1/delta))``;
* ``"balle"``: the Balle et al. 2020 RDP conversion used by Opacus and dp-accounting, minimised over
  continuous orders;
* ``"exact"``: the exact privacy profile of the composed Gaussian mechanism (tight).

For the same releases, exact <= balle <= closed-form.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from numbers import Integral
from typing import ClassVar

from fedtailor.privacy.gaussian import epsilon_for_delta
from fedtailor.privacy.rdp import balle_epsilon_gaussian, check_release, closed_form_epsilon

CONVERSIONS: tuple[str, ...] = ("closed-form", "balle", "exact")
DEFAULT_CONVERSION = "closed-form"


def check_conversion(conversion: str) -> str:
    """Return ``conversion`` if it names a known conversion, else raise a ValueError listing them."""
    if conversion not in CONVERSIONS:
        raise ValueError(f"unknown privacy conversion {conversion!r}; choose one of {', '.join(CONVERSIONS)}.")
    return conversion


def epsilon_from_rho(rho: float, *, delta: float, conversion: str = DEFAULT_CONVERSION) -> float:
    """``eps`` at ``delta`` of composed Gaussians with RDP slope ``rho`` under the named conversion."""
    check_conversion(conversion)
    if conversion == "closed-form":
        return closed_form_epsilon(rho, delta=delta)
    if conversion == "balle":
        return balle_epsilon_gaussian(rho, delta=delta)
    if not (rho >= 0.0 and math.isfinite(rho)):
        raise ValueError(f"rho must be finite and >= 0, got {rho!r}.")
    return epsilon_for_delta(delta, mu=math.sqrt(2.0 * rho))


class Accountant(ABC):
    """Accumulates Gaussian releases of one client and reports its ``(eps, delta)`` guarantee."""

    conversion: ClassVar[str]

    def __init__(self) -> None:
        self._terms: list[float] = []

    def step(self, *, sensitivity: float, sigma: float, count: int = 1) -> None:
        """Record ``count`` Gaussian releases with L2 ``sensitivity`` and noise std ``sigma``."""
        sensitivity, sigma = check_release(sensitivity, sigma)
        if isinstance(count, bool) or not isinstance(count, Integral) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}.")
        count = int(count)
        self._terms.append(count * sensitivity**2 / (2.0 * sigma**2))

    def compose(self, *, sensitivities: Sequence[float], sigmas: Sequence[float]) -> None:
        """Record several releases at once, ``(sensitivities[j], sigmas[j])``."""
        if len(sensitivities) != len(sigmas):
            raise ValueError(
                f"got {len(sensitivities)} sensitivities but {len(sigmas)} sigmas; give one sigma per release."
            )
        for sensitivity, sigma in zip(sensitivities, sigmas, strict=True):
            self.step(sensitivity=sensitivity, sigma=sigma)

    @property
    def rho(self) -> float:
        """RDP slope of everything recorded: RDP(alpha) = alpha * rho."""
        return math.fsum(self._terms)

    @property
    def mu(self) -> float:
        """Gaussian-DP parameter of the composition, ``sqrt(2 rho)``."""
        return math.sqrt(2.0 * self.rho)

    @abstractmethod
    def get_epsilon(self, *, delta: float) -> float:
        """Epsilon of everything recorded so far at the given ``delta``."""


class ClosedFormAccountant(Accountant):
    """The compact-adaptation paper's conversion, ``eps = rho + 2 sqrt(rho log(1/delta))``."""

    conversion = "closed-form"

    def get_epsilon(self, *, delta: float) -> float:
        return closed_form_epsilon(self.rho, delta=delta)


class BalleAccountant(Accountant):
    """RDP with the Balle et al. 2020 conversion, minimised over continuous orders alpha > 1."""

    conversion = "balle"

    def get_epsilon(self, *, delta: float) -> float:
        return balle_epsilon_gaussian(self.rho, delta=delta)


class ExactGaussianAccountant(Accountant):
    """Exact privacy profile of the composed Gaussian mechanism (``mu = sqrt(sum (Delta/sigma)^2)``)."""

    conversion = "exact"

    def get_epsilon(self, *, delta: float) -> float:
        return epsilon_for_delta(delta, mu=self.mu)


_ACCOUNTANTS: dict[str, type[Accountant]] = {
    cls.conversion: cls for cls in (ClosedFormAccountant, BalleAccountant, ExactGaussianAccountant)
}


def make_accountant(conversion: str = DEFAULT_CONVERSION) -> Accountant:
    """A fresh accountant for ``conversion`` (one of :data:`CONVERSIONS`)."""
    return _ACCOUNTANTS[check_conversion(conversion)]()
