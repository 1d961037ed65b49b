"""Device selection: CUDA when present and asked for, CPU otherwise."""

from __future__ import annotations

import torch


def select_device(name: str = "auto") -> torch.device:
    """Resolve ``"auto" | "cpu" | "cuda" | "cuda:N"`` to a :class:`torch.device`.

    ``auto`` picks CUDA when available. Asking for CUDA on a machine without it is an error, not a silent
    fallback, so that a GPU run is never quietly a CPU run.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}; use 'auto', 'cpu' or 'cuda[:N]'.") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here; use device='cpu' or 'auto'.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {name!r} requested but this machine has {torch.cuda.device_count()} CUDA "
            f"device(s); use cuda:0..cuda:{torch.cuda.device_count() - 1} or 'auto'."
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use 'auto', 'cpu' or 'cuda[:N]'.")
    return dev
