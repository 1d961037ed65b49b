"""From a validated config to the pieces of a run: the setup of the method's data kind, then the method.

Both come from the registry (:mod:`fedtailor.fl.registry`): the config's method names its data kind
(``"images"``: :mod:`fedtailor.data.setup`; ``"preferences"``: :mod:`fedtailor.lm.setup`) and its builder. The
runner and the Flower adapters share this code; nothing here knows a method or a data kind by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fedtailor.data.setup import ImageSetup, client_data
from fedtailor.fl import registry
from fedtailor.fl.method import Method
from fedtailor.fl.setup import Setup, train_sizes

__all__ = [
    "METHOD_BUILDERS",
    "ImageSetup",
    "Setup",
    "build_method",
    "build_setup",
    "check_data_name",
    "client_data",
    "train_sizes",
]


def build_setup(cfg: Any) -> Setup:
    """The setup of ``cfg``: data, clients and schedule, built by the data kind of the method it names."""
    return registry.data_spec(registry.method_spec(cfg.method.name).data).build_setup(cfg)


def build_method(setup: Setup) -> Method:
    """The method ``setup.cfg.method`` names (:func:`fedtailor.fl.registry.create_method`)."""
    return registry.create_method(setup)


def check_data_name(cfg: Any) -> None:
    """The config's data name is one its method's data kind can load (cheap: nothing is read)."""
    registry.data_spec(registry.method_spec(cfg.method.name).data).check_name(cfg.data.dataset)


class _Builders(Mapping[str, Callable[[Any], Method]]):
    """Every registered method's builder by name: a live, read-only view of the registry."""

    def __getitem__(self, name: str) -> Callable[[Any], Method]:
        return registry.method_spec(name).build

    def __iter__(self) -> Iterator[str]:
        return iter(registry.method_names())

    def __len__(self) -> int:
        return len(registry.method_names())


METHOD_BUILDERS: Mapping[str, Callable[[Any], Method]] = _Builders()
