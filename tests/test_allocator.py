"""The command line's allocator settings (grpolens/allocator.py): applied where the C library is
glibc, and only by the command line, never by importing grpolens as a library."""

import platform
import subprocess
import sys

import pytest

from grpolens.allocator import keep_freed_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_glibc_accepts_both_thresholds():
    # mallopt returns 0 for a value glibc rejects (e.g. an mmap threshold beyond its maximum)
    assert keep_freed_memory() is True


@pytest.mark.skipif(GLIBC, reason="on glibc the settings apply")
def test_other_c_libraries_are_left_alone():
    assert keep_freed_memory() is False


def test_importing_grpolens_does_not_touch_the_allocator():
    code = ("import sys, grpolens, grpolens.analysis.recompute, grpolens.metrics.engine; "
            "print('grpolens.allocator' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
