"""The CPU kernels build where a C++ compiler exists: tests/test_decode_kernel.py skips when they do not, so a broken
build would otherwise leave a green suite with no kernel coverage (issue 51)."""

from __future__ import annotations

import os
import shutil

import pytest

from dasspec.model import decode_kernel


def test_the_cpu_kernels_build_where_a_compiler_exists():
    """Fails (never skips) where ``c++`` or ``g++`` is on PATH and the kernels did not build."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH: the kernels cannot be built here")
    if os.environ.get("DASSPEC_DECODE_KERNEL") == "0":
        pytest.skip("DASSPEC_DECODE_KERNEL=0 switches the kernels off on purpose")
    assert decode_kernel.available(), (f"{compiler} exists but dasspec's CPU kernels did not build (see the "
                                       "warning dasspec gave)")
