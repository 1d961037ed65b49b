"""numpy's and scipy's BLAS on one thread, so that their idle threads never steal torch's cores.

The numpy and scipy wheels each bring their own OpenBLAS, with a pool of as many threads as the machine has
cores. After a BLAS call those threads keep spinning for a while before they sleep, and on a machine with few
cores they then hold a core that torch's intra-op pool waits for: a training round whose numpy work (a codec's
transform, a decode) comes before a torch step saw that step's small parallel regions stall by 5-15 ms each
(measured on a 2-core machine: 20 rounds of compact adaptation in 4.6 s instead of 6.1 s once numpy's BLAS had one
thread; docs/compact.md, "Time, and what bounds it"). The numpy calls here are small, so one thread costs them
nothing. The command line, the worker processes and the Flower apps call :func:`single_thread_numpy_blas` once
at start; a library user can do the same.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variables with which a user sets OpenBLAS's threads; when any is set it wins.
_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")


def single_thread_numpy_blas() -> bool:
    """Limit the BLAS libraries numpy and scipy loaded (never torch's own) to one thread; returns whether it did
    (False when the user set ``OPENBLAS_NUM_THREADS``, which then stays in charge, or when threadpoolctl finds no
    such library). Loads numpy and scipy's linear algebra first, so that both copies are there to be limited."""
    if any(k in os.environ for k in _BLAS_ENV):
        return False
    import numpy  # noqa: F401  (loads its OpenBLAS)
    import scipy.linalg  # noqa: F401  (loads scipy's own copy)
    from threadpoolctl import ThreadpoolController

    libs = [
        lib
        for lib in ThreadpoolController().select(user_api="blas").lib_controllers
        if "torch" not in Path(lib.filepath).parts
    ]
    for lib in libs:
        lib.set_num_threads(1)
    return bool(libs)
