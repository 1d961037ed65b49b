import os
import subprocess
import sys

_PROBE = """
import json, sys
import torch
from threadpoolctl import threadpool_info
from fedtailor.blas import single_thread_numpy_blas

torch.set_num_threads(2)
applied = single_thread_numpy_blas()
blas = sorted({(i["filepath"], i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"})
print(json.dumps({"applied": applied, "blas": blas, "torch": torch.get_num_threads()}))
"""


def _probe(**env: str) -> dict:
    import json

    clean = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**clean, "OMP_NUM_THREADS": "2", **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_numpy_and_scipy_blas_get_one_thread_and_torch_keeps_its_own():
    got = _probe()
    assert got["applied"] and len(got["blas"]) >= 1  # the numpy and scipy wheels' OpenBLAS (one copy each)
    assert all(threads == 1 for _, threads in got["blas"])
    assert got["torch"] == 2  # torch's intra-op pool untouched


def test_the_users_own_blas_setting_wins():
    got = _probe(OPENBLAS_NUM_THREADS="2")
    assert not got["applied"] and all(threads == 2 for _, threads in got["blas"])
