"""The registry of methods and data kinds: the single source of the names the config, the CLI, Flower,
``fedtailor reproduce`` and the reports know.

In the style of Opacus's ``register_accountant`` / ``create_accountant`` (*Opacus: User-Friendly Differential
Privacy Library in PyTorch*, Yousefpour et al., 2021, arXiv:2109.12298): a method module declares, at import,

    register_method("fedavg", config=FedAvgConfig, build=build_fedavg, family="pfl", fedlag=True)

its name, its config model (a pydantic model whose ``name`` field is the method's name), its builder (the
run's :class:`~fedtailor.fl.setup.Setup` -> a :class:`~fedtailor.fl.method.Method`), the data kind it runs on
and whether FedLAG can wrap it. A data kind module declares ``register_data(kind, build_setup=...,
check_name=...)``. :func:`create_method` builds the method a setup's config names; :func:`method_names`,
:func:`fedlag_bases` and :func:`method_spec` are what the rest of the project reads.

This module imports neither torch nor pydantic; the built-in modules (:data:`BUILTIN_MODULES`, which do import
torch) are imported once, on the first question asked of the registry (:func:`load_builtin`), so that
``import fedtailor.config`` stays light. A method defined anywhere else registers itself the same way, before
its name is used.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

    from fedtailor.fl.method import Method
    from fedtailor.fl.setup import Setup

#: The modules that register the built-in methods and data kinds (each registers itself when imported).
BUILTIN_MODULES = (
    "fedtailor.data.setup",
    "fedtailor.lm.setup",
    "fedtailor.methods.compact.adaptation",
    "fedtailor.methods.pfl.fedavg",
    "fedtailor.methods.pfl.fedprox",
    "fedtailor.methods.pfl.fedper",
    "fedtailor.methods.pfl.fedrep",
    "fedtailor.methods.pfl.fedbabu",
    "fedtailor.methods.pfl.ditto",
    "fedtailor.methods.pfl.fedrod",
    "fedtailor.methods.pfl.lgfedavg",
    "fedtailor.methods.pfl.apfl",
    "fedtailor.methods.dpo.pfeddpo",
)
DEFAULT_METHOD = "compact"


@dataclass(frozen=True)
class MethodSpec:
    """What the project knows of a method.

    ``config``: its pydantic config model (the ``[method]`` section; its ``name`` field holds the method's name);
    ``build``: setup of the method's data kind -> the method; ``data``: the data kind it runs on (a name given to
    :func:`register_data`); ``family``: its family (``"pfl"``, ``"compact"``, ``"dpo"``, ...), for grouping in
    docs and reports; ``fedlag``: a parameter-sharing base that FedLAG wraps (``[method.fedlag]``), picked up by
    ``fedtailor reproduce fedlag-*`` and ``scripts/fedlag_report.py``."""

    name: str
    config: type[BaseModel]
    build: Callable[[Any], Method]
    data: str = "images"
    family: str = ""
    fedlag: bool = False


@dataclass(frozen=True)
class DataSpec:
    """A data kind: ``build_setup`` (a validated RunConfig -> a :class:`~fedtailor.fl.setup.Setup`) and
    ``check_name`` (raises ValueError for a ``data.dataset`` this kind cannot load; cheap, reads nothing)."""

    kind: str
    build_setup: Callable[[Any], Setup]
    check_name: Callable[[str], None]


_METHODS: dict[str, MethodSpec] = {}
_DATA: dict[str, DataSpec] = {}
_loaded = False
_lock = threading.RLock()


def register_method(
    name: str,
    *,
    config: type[BaseModel],
    build: Callable[[Any], Method],
    family: str,
    data: str = "images",
    fedlag: bool = False,
) -> MethodSpec:
    """Register the method ``name``; a second registration of a name is refused unless it is the same spec
    (a module imported twice)."""
    spec = MethodSpec(name=name, config=config, build=build, data=data, family=family, fedlag=fedlag)
    field = getattr(config, "model_fields", {}).get("name")
    if field is None:
        raise ValueError(f"the config model of method {name!r} needs a 'name' field (its default: {name!r}).")
    with _lock:
        old = _METHODS.get(name)
        if old is not None and (old.config.__qualname__, old.config.__module__) != (
            config.__qualname__,
            config.__module__,
        ):
            raise ValueError(f"method {name!r} is registered already (by {old.config.__module__}).")
        _METHODS[name] = spec
    return spec


def unregister_method(name: str) -> None:
    """Remove ``name`` (tests that register a method of their own)."""
    with _lock:
        _METHODS.pop(name, None)


def register_data(kind: str, *, build_setup: Callable[[Any], Setup], check_name: Callable[[str], None]) -> DataSpec:
    """Register the data kind ``kind``."""
    spec = DataSpec(kind=kind, build_setup=build_setup, check_name=check_name)
    with _lock:
        _DATA[kind] = spec
    return spec


def load_builtin() -> None:
    """Import the built-in method and data modules (once)."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if not _loaded:
            for module in BUILTIN_MODULES:
                importlib.import_module(module)
            _loaded = True


def _ordered() -> list[tuple[str, MethodSpec]]:
    """The registered methods, built-in ones first in :data:`BUILTIN_MODULES` order, then the others in
    registration order: the same order whatever imported a method module first."""
    rank = {m: i for i, m in enumerate(BUILTIN_MODULES)}
    items = list(_METHODS.items())
    return sorted(items, key=lambda kv: (rank.get(kv[1].config.__module__, len(rank)), items.index(kv)))


def method_names() -> tuple[str, ...]:
    """Every registered method, the built-in ones first (in :data:`BUILTIN_MODULES` order)."""
    load_builtin()
    return tuple(n for n, _ in _ordered())


def fedlag_bases() -> tuple[str, ...]:
    """The parameter-sharing bases FedLAG wraps, in registration order."""
    load_builtin()
    return tuple(n for n, s in _ordered() if s.fedlag)


def method_spec(name: str) -> MethodSpec:
    """The spec of method ``name``; a KeyError that names the registered ones otherwise."""
    load_builtin()
    try:
        return _METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; registered: {', '.join(method_names())}.") from None


def is_method(name: object) -> bool:
    load_builtin()
    return isinstance(name, str) and name in _METHODS


def data_spec(kind: str) -> DataSpec:
    load_builtin()
    try:
        return _DATA[kind]
    except KeyError:
        raise KeyError(f"unknown data kind {kind!r}; registered: {', '.join(_DATA)}.") from None


def methods() -> Iterator[MethodSpec]:
    load_builtin()
    return iter([spec for _, spec in _ordered()])


def create_method(setup: Setup) -> Method:
    """The method ``setup.cfg.method`` names, built from ``setup``."""
    return method_spec(setup.cfg.method.name).build(setup)
