"""The privacy ledger (every Gaussian release, per client) and the budget guard (``docs/privacy.md``).

The ledger is the record of what was released: ``(client, round, sensitivity, sigma, mechanism)`` for the
one-shot context release and for every coefficient-gradient release, and for a client's DP-SGD in a round also
the records' sampling rate ``q`` and the number of noisy steps (each step a Poisson-subsampled Gaussian), and for a
trusted server's noisy aggregate of a fixed-size sample of clients the sample's ``q`` and population. From it,
``eps_i`` of every client and ``eps = max_i eps_i`` follow at any time: for plain Gaussian releases under any of
the conversions of :mod:`fedtailor.privacy.accountant` (their RDP composes exactly as ``rho``); for a client with
subsampled steps by dp-accounting's RDP accountant (``PoissonSampledDpEvent`` of a ``GaussianDpEvent``, composed
per client; the maintained implementation of Mironov, Talwar, Zhang 2019, *Renyi Differential Privacy of the
Sampled Gaussian Mechanism*, arXiv:1908.10530; for fixed-size samples ``SampledWithoutReplacementDpEvent`` under
replace-one adjacency, Wang, Balle, Kasiviswanathan 2019, *Subsampled Renyi Differential Privacy and Analytical
Moments Accountant*, arXiv:1808.00087). It serialises to JSON exactly (floats round-trip), so a resumed
run continues from the same numbers.

The guard refuses, before anything is released, (i) a fixed schedule under which some client would end
above the target eps and (ii) a single release that would take a client above it.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from fedtailor.privacy.accountant import DEFAULT_CONVERSION, check_conversion, epsilon_from_rho
from fedtailor.privacy.rdp import check_release
from fedtailor.safeload import state_class

_FORMAT = "fedtailor.privacy.ledger/1"


class PrivacyBudgetExceeded(RuntimeError):
    """A release or a planned schedule would take a client past the target epsilon."""

    def __init__(self, *, client: int, epsilon: float, target: float, context: str) -> None:
        self.client = client
        self.epsilon = epsilon
        self.target = target
        self.overshoot = epsilon - target
        super().__init__(
            f"client {client} would reach eps = {epsilon:.6g} {context}, above the target eps = {target:.6g} "
            f"by {self.overshoot:.3g} ({self.overshoot / target:.3%}). "
            "Raise sigma (calibrate it from T_max), "
            "plan fewer participations for this client, or raise the target."
        )


@dataclass(frozen=True)
class Release:
    """One Gaussian release: L2 ``sensitivity`` (under the adjacency its mechanism states: replace-one for the
    compact releases and the client-level updates, add/remove-one record for DP-SGD), noise std ``sigma``; or
    ``steps`` of them, each on the records sampled with probability ``sampling_rate`` (DP-SGD); or, with
    ``population = n > 0``, on a fixed-size sample of ``sampling_rate * n`` out of ``n`` (replace-one)."""

    client: int
    round: int
    sensitivity: float
    sigma: float
    mechanism: str
    sampling_rate: float = 1.0
    steps: int = 1
    population: int = 0

    @property
    def sampled(self) -> bool:
        return self.sampling_rate < 1.0

    @property
    def rho(self) -> float:
        """RDP slope of the (unsampled) release(s), ``steps Delta^2 / (2 sigma^2)``."""
        if self.sampled:
            raise ValueError("a subsampled release has no rho; its RDP curve comes from dp-accounting.")
        return self.steps * self.sensitivity**2 / (2.0 * self.sigma**2)


#: RDP orders for subsampled steps: 2 to 512, dense where eps is usually attained, cheap to evaluate. Orders below
#: 2 are left out: at noise multipliers below about 1 dp-accounting's series for them runs 1,000 terms without
#: converging (seconds per call, then the order is dropped anyway); without them eps can only be larger.
SAMPLED_ORDERS = (2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 4.5, *range(5, 65), 80, 96, 128, 192, 256, 512)


Event = tuple[float, float, float, int, int]


def sampled_epsilon(events: Iterable[tuple[float, ...]], *, delta: float) -> float:
    """``eps`` at ``delta`` of composed ``(sensitivity, sigma, sampling_rate, steps[, population])`` Gaussian
    mechanisms (each step on Poisson-sampled records when ``sampling_rate < 1``, or on a fixed-size sample of
    ``sampling_rate * population`` out of ``population`` when ``population > 0``), by dp-accounting's RDP
    accountant; identical events are composed at once. Fixed-size samples are accounted under replace-one
    adjacency, Poisson ones under add/remove-one: one client's events must not mix the two."""
    groups: dict[tuple[float, float, int], int] = {}
    for event in events:
        sensitivity, sigma, q, steps = event[:4]
        population = int(event[4]) if len(event) > 4 else 0
        if sensitivity == 0 or steps == 0:
            continue
        key = (float(q), float(sigma) / float(sensitivity), population)  # noise multiplier
        groups[key] = groups.get(key, 0) + int(steps)
    if {p > 0 for q, _, p in groups if q < 1.0} == {True, False}:
        raise ValueError(
            "a client's releases mix Poisson and fixed-size sampling; they compose under different "
            "adjacencies and cannot be accounted together."
        )
    return _sampled_epsilon(tuple(sorted(groups.items())), float(delta)) if groups else 0.0


@functools.lru_cache(maxsize=4096)
def _sampled_epsilon(groups: tuple[tuple[tuple[float, float, int], int], ...], delta: float) -> float:
    from dp_accounting import dp_event, rdp
    from dp_accounting.privacy_accountant import NeighboringRelation

    fixed = any(p > 0 and q < 1.0 for (q, _, p), _ in groups)
    relation = NeighboringRelation.REPLACE_ONE if fixed else NeighboringRelation.ADD_OR_REMOVE_ONE
    accountant = rdp.RdpAccountant(orders=SAMPLED_ORDERS, neighboring_relation=relation)
    for (q, z, population), count in groups:
        event: dp_event.DpEvent = dp_event.GaussianDpEvent(z)
        if q < 1.0 and population > 0:
            event = dp_event.SampledWithoutReplacementDpEvent(population, round(q * population), event)
        elif q < 1.0:
            event = dp_event.PoissonSampledDpEvent(q, event)
        accountant.compose(event, count)
    return float(accountant.get_epsilon(delta))


def _check_sampling(sampling_rate: float, steps: int, population: int = 0) -> tuple[float, int, int]:
    q = float(sampling_rate)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_rate must lie in (0, 1], got {sampling_rate!r}.")
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}.")
    if isinstance(population, bool) or int(population) != population or population < 0:
        raise ValueError(f"population must be a non-negative integer, got {population!r}.")
    if population and abs(q * population - round(q * population)) > 1e-9 * population:
        raise ValueError(f"a fixed-size sample needs sampling_rate * population integral, got {q} * {population}.")
    return q, int(steps), int(population)


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or int(value) != value:
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    return int(value)


@state_class
class PrivacyLedger:
    """All releases of a run, grouped per client, with eps reporting under a chosen conversion."""

    def __init__(self, *, delta: float, conversion: str = DEFAULT_CONVERSION) -> None:
        delta = float(delta)
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {delta!r}.")
        self.delta = delta
        self.conversion = check_conversion(conversion)
        self._releases: list[Release] = []
        self._by_client: dict[int, list[Release]] = {}
        self._keys: set[tuple[int, int, str]] = set()

    def recorded(self, *, client: int, round: int, mechanism: str) -> bool:
        """Whether this release is already in the ledger."""
        return (int(client), int(round), mechanism) in self._keys

    def record(
        self,
        *,
        client: int,
        round: int,
        sensitivity: float,
        sigma: float,
        mechanism: str,
        sampling_rate: float = 1.0,
        steps: int = 1,
        population: int = 0,
    ) -> Release:
        """Add one release (``steps`` subsampled ones with ``sampling_rate < 1``; a fixed-size sample of a
        ``population`` when that is > 0). The same (client, round, mechanism) twice is refused as a double
        count."""
        client, round = _as_int(client, "client"), _as_int(round, "round")
        sensitivity, sigma = check_release(sensitivity, sigma)
        sampling_rate, steps, population = _check_sampling(sampling_rate, steps, population)
        if not isinstance(mechanism, str) or not mechanism:
            raise ValueError(f"mechanism must be a non-empty name such as 'context' or 'coef-grad', got {mechanism!r}.")
        key = (client, round, mechanism)
        if key in self._keys:
            raise ValueError(
                f"release {mechanism!r} of client {client} in round {round} is already recorded; "
                "a resumed run "
                "must continue after the last recorded round."
            )
        release = Release(client, round, sensitivity, sigma, mechanism, sampling_rate, steps, population)
        self._keys.add(key)
        self._releases.append(release)
        self._by_client.setdefault(client, []).append(release)
        return release

    @property
    def releases(self) -> tuple[Release, ...]:
        """Every release in the order recorded."""
        return tuple(self._releases)

    @property
    def clients(self) -> list[int]:
        """Clients with at least one release, sorted."""
        return sorted(self._by_client)

    def rho(self, client: int) -> float:
        """RDP slope ``sum_j Delta_j^2/(2 sigma_j^2)`` of one client's releases (0 if it has none); a client
        with subsampled releases has none (ValueError)."""
        return math.fsum(r.rho for r in self._by_client.get(client, ()))

    def epsilon(self, client: int, *, conversion: str | None = None, delta: float | None = None) -> float:
        """``eps_i`` of one client at the ledger's delta (or ``delta``) under the ledger's conversion (a client
        with subsampled releases: the smaller of dp-accounting's RDP accountant for the sampled mechanisms and the
        same releases composed without the sampling credit, both valid bounds)."""
        return self._epsilon(self._events(client, ()), conversion=conversion, delta=delta)

    def _events(self, client: int, extra: Iterable[tuple[float, ...]]) -> list[Event]:
        events = [
            (r.sensitivity, r.sigma, r.sampling_rate, r.steps, r.population) for r in self._by_client.get(client, ())
        ]
        for e in extra:
            sensitivity, sigma = check_release(e[0], e[1])
            events.append((sensitivity, sigma, *_check_sampling(*(e[2:] if len(e) > 2 else (1.0, 1)))))
        return events

    def _epsilon(self, events: list[Event], *, conversion: str | None, delta: float | None) -> float:
        delta = self.delta if delta is None else delta
        rho = math.fsum(steps * s**2 / (2.0 * sigma**2) for s, sigma, _, steps, _ in events)
        plain = epsilon_from_rho(rho, delta=delta, conversion=conversion or self.conversion)
        if any(e[2] < 1.0 for e in events):  # sampling never costs more than the full Gaussian: both bounds hold
            return min(sampled_epsilon(events, delta=delta), plain)
        return plain

    def epsilon_with(self, client: int, extra: Iterable[tuple[float, ...]], *, conversion: str | None = None) -> float:
        """``eps_i`` the client would have after further ``(sensitivity, sigma)`` releases, or
        ``(sensitivity, sigma, sampling_rate, steps[, population])`` ones (not recorded)."""
        return self._epsilon(self._events(client, extra), conversion=conversion, delta=None)

    def epsilons(self, *, conversion: str | None = None, delta: float | None = None) -> dict[int, float]:
        """``{client: eps_i}`` for every client with a release."""
        return {c: self.epsilon(c, conversion=conversion, delta=delta) for c in self.clients}

    def max_epsilon(self, *, conversion: str | None = None, delta: float | None = None) -> float:
        """``eps = max_i eps_i`` (0 before any release)."""
        return max(self.epsilons(conversion=conversion, delta=delta).values(), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form: format tag, delta, conversion and the list of releases."""
        return {
            "format": _FORMAT,
            "delta": self.delta,
            "conversion": self.conversion,
            "releases": [asdict(r) for r in self._releases],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger saved with :meth:`to_dict`; the releases are re-recorded in order."""
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a privacy ledger: format is {data.get('format')!r}, expected {_FORMAT!r}.")
        ledger = cls(delta=data["delta"], conversion=data["conversion"])
        for r in data["releases"]:
            ledger.record(
                client=r["client"],
                round=r["round"],
                sensitivity=r["sensitivity"],
                sigma=r["sigma"],
                mechanism=r["mechanism"],
                sampling_rate=r.get("sampling_rate", 1.0),
                steps=r.get("steps", 1),
                population=r.get("population", 0),
            )
        return ledger

    def to_json(self) -> str:
        """JSON text of :meth:`to_dict` (floats round-trip exactly)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))


class BudgetGuard:
    """Refuses plans and releases that would take any client past ``target_eps``.

    ``rtol`` (default 1e-9) is the relative slack on the target, so that a schedule calibrated to reach the
    target exactly is accepted despite rounding.
    """

    def __init__(
        self, ledger: PrivacyLedger, *, target_eps: float, conversion: str | None = None, rtol: float = 1e-9
    ) -> None:
        target_eps = float(target_eps)
        if not (target_eps > 0.0 and math.isfinite(target_eps)):
            raise ValueError(f"target_eps must be finite and > 0, got {target_eps!r}.")
        if not 0.0 <= rtol < 1e-3:
            raise ValueError(f"rtol must be a small non-negative slack (e.g. 1e-9), got {rtol!r}.")
        self.ledger = ledger
        self.target_eps = target_eps
        self.conversion = check_conversion(conversion or ledger.conversion)
        self.rtol = rtol

    def _over(self, eps: float) -> bool:
        return eps > self.target_eps * (1.0 + self.rtol)

    def check_plan(self, planned: Mapping[int, Iterable[tuple[float, float]]]) -> dict[int, float]:
        """Check planned ``{client: [(sensitivity, sigma), ...]}`` on top of what is already recorded.

        Returns every client's final eps; raises :class:`PrivacyBudgetExceeded` naming the worst client if
        any would end above the target.
        """
        final = {
            int(c): self.ledger.epsilon_with(int(c), releases, conversion=self.conversion)
            for c, releases in planned.items()
        }
        over = {c: e for c, e in final.items() if self._over(e)}
        if over:
            worst = max(over, key=over.__getitem__)
            others = f"; {len(over) - 1} other client(s) too" if len(over) > 1 else ""
            raise PrivacyBudgetExceeded(
                client=worst,
                epsilon=over[worst],
                target=self.target_eps,
                context=(
                    f"by the end of the planned schedule ({self.conversion}, delta={self.ledger.delta:g}){others}"
                ),
            )
        return final

    def check_release(
        self,
        *,
        client: int,
        round: int,
        sensitivity: float,
        sigma: float,
        mechanism: str,
        sampling_rate: float = 1.0,
        steps: int = 1,
        population: int = 0,
    ) -> float:
        """eps the client would reach with this release; :class:`PrivacyBudgetExceeded` if over target."""
        extra = [(sensitivity, sigma, sampling_rate, steps, population)]
        eps = self.ledger.epsilon_with(int(client), extra, conversion=self.conversion)
        if self._over(eps):
            raise PrivacyBudgetExceeded(
                client=int(client),
                epsilon=eps,
                target=self.target_eps,
                context=(
                    f"with release {mechanism!r} in round {round} ({self.conversion}, delta={self.ledger.delta:g})"
                ),
            )
        return eps

    def record(
        self,
        *,
        client: int,
        round: int,
        sensitivity: float,
        sigma: float,
        mechanism: str,
        sampling_rate: float = 1.0,
        steps: int = 1,
        population: int = 0,
    ) -> Release:
        """Check, then record in the ledger; nothing is recorded when the check fails."""
        kw = {"sensitivity": sensitivity, "sigma": sigma, "mechanism": mechanism, "population": population}
        self.check_release(client=client, round=round, sampling_rate=sampling_rate, steps=steps, **kw)
        return self.ledger.record(client=client, round=round, sampling_rate=sampling_rate, steps=steps, **kw)
