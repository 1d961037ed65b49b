import os
import platform
import subprocess
import sys

import pytest

_PROBE = """
import sys
import torch
from fedtailor.allocator import keep_freed_memory

applied = keep_freed_memory() if sys.argv[1] == "on" else False
page = 4096
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * page
before = rss()
x = torch.ones(5_000_000)  # 20 MB, every page touched
del x
print(applied, (rss() - before) / 1e6)
"""

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator only"
)


def _probe(mode: str, **env: str) -> tuple[bool, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], env={**clean, **env}, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", float(out[1])


@glibc
def test_freed_memory_is_kept_for_reuse_only_when_asked():
    applied, kept = _probe("on")
    assert applied and kept > 15  # the freed 20 MB stay in the process, ready for the next step
    applied, kept = _probe("off")
    assert not applied and kept < 5  # glibc's default: a block this size is mapped and handed back when freed


@glibc
def test_the_users_own_allocator_setting_wins():
    applied, kept = _probe("on", MALLOC_TRIM_THRESHOLD_="0")
    assert not applied and kept < 5
