"""The mmap threshold stays fixed, so large freed buffers go back to the system."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tailnet_agent.memory import fix_mmap_threshold

# Frees a 4 MiB block (which raises glibc's dynamic threshold to 4 MiB), then allocates 256 KiB
# and prints whether that got its own mapping (mallinfo2's count of mmapped blocks grew).
PROBE = """
import ctypes, sys
from tailnet_agent.memory import fix_mmap_threshold
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
big = bytearray(4 << 20)
del big
before = libc.mallinfo2().hblks
block = bytearray(256 << 10)
print(libc.mallinfo2().hblks - before)
"""


def mapped_blocks(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_large_buffers_keep_their_own_mapping_once_fixed() -> None:
    assert mapped_blocks("dynamic") == 0, "glibc's dynamic threshold puts 256 KiB on the heap"
    assert mapped_blocks("fixed") == 1


def test_an_explicit_environment_value_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_mmap_threshold() is False
