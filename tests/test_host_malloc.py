"""Freed host memory kept mapped (jaxpaged/step/host_malloc.py): a pattern that glibc's defaults hand back to the
kernel and fault in again every round (two 3 MiB blocks freed together: over the trim threshold that the first
mmapped block set) runs without page faults once `keep_freed_memory` took its settings; a fresh process each."""
import subprocess
import sys

import pytest

ROUNDS = """
import ctypes, resource
from jaxpaged.step import host_malloc
took = host_malloc.keep_freed_memory() if KEEP else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def round_():
    blocks = [libc.malloc(3 << 20) for _ in range(2)]
    for b in blocks:
        ctypes.memset(b, 1, 3 << 20)
    for b in blocks:
        libc.free(b)
round_(); round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    round_()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(keep: bool) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", f"KEEP = {keep}\n" + ROUNDS], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_freed_blocks_are_reused_without_faults():
    took, kept = faults(True)
    if took != "True":
        pytest.skip("this libc does not take glibc's malloc settings")
    _, default = faults(False)
    assert default >= 5 * 1000  # the pattern does fault afresh under the defaults (1536 pages a round)
    assert kept <= 20
