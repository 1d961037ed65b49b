"""Record-level central DP for federated releases: accountants, calibration, mechanisms, ledger.

* :mod:`~fedtailor.privacy.rdp`, :mod:`~fedtailor.privacy.gaussian`: pure math (RDP of composed Gaussians,
  the closed-form and Balle et al. conversions, exact Gaussian accounting).
* :mod:`~fedtailor.privacy.accountant`: ``Accountant`` and one class per conversion
  (``"closed-form"``, ``"balle"``, ``"exact"``).
* :mod:`~fedtailor.privacy.calibrate`: the fixed uniform schedule, ``T_max`` and ``calibrate_sigma``.
* :mod:`~fedtailor.privacy.mechanisms`: per-record gradients (torch.func), clipping, Gaussian noise.
* :mod:`~fedtailor.privacy.ledger`: ``PrivacyLedger`` and ``BudgetGuard``.
"""

from fedtailor.privacy.accountant import (
    CONVERSIONS,
    DEFAULT_CONVERSION,
    Accountant,
    BalleAccountant,
    ClosedFormAccountant,
    ExactGaussianAccountant,
    epsilon_from_rho,
    make_accountant,
)
from fedtailor.privacy.calibrate import (
    calibrate_sigma,
    gradient_sensitivity,
    participation_counts,
    planned_releases,
    t_max,
    uniform_schedule,
)
from fedtailor.privacy.ledger import BudgetGuard, PrivacyBudgetExceeded, PrivacyLedger, Release
from fedtailor.privacy.mechanisms import (
    clip_rows,
    clipped_mean,
    flatten_named,
    gaussian_mechanism,
    per_example_gradients,
    unflatten_like,
)

__all__ = [
    "CONVERSIONS",
    "DEFAULT_CONVERSION",
    "Accountant",
    "BalleAccountant",
    "BudgetGuard",
    "ClosedFormAccountant",
    "ExactGaussianAccountant",
    "PrivacyBudgetExceeded",
    "PrivacyLedger",
    "Release",
    "calibrate_sigma",
    "clip_rows",
    "clipped_mean",
    "epsilon_from_rho",
    "flatten_named",
    "gaussian_mechanism",
    "gradient_sensitivity",
    "make_accountant",
    "participation_counts",
    "per_example_gradients",
    "planned_releases",
    "t_max",
    "unflatten_like",
    "uniform_schedule",
]
