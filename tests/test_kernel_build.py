"""The CPU kernels build wherever a C++ compiler exists: the suite fails (not skips) when they do not, since every
exactness test would otherwise run on torch's kernels and prove less than it claims."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from dasspec.model import decode_kernel


def test_the_kernels_build_where_a_compiler_exists():
    if os.environ.get("DASSPEC_DECODE_KERNEL") == "0":
        pytest.skip("DASSPEC_DECODE_KERNEL=0 turns the kernels off on purpose")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        pytest.skip("no C++ compiler here: dasspec runs on torch's kernels (decode_kernel.GUARANTEE_TORCH)")
    assert decode_kernel.available(), f"the CPU kernels did not build: {decode_kernel.error()}"
    assert decode_kernel.isa() in decode_kernel.isas_here() and "portable" in decode_kernel.isas_here()


def test_a_process_without_kernels_says_so_once_and_keeps_working(tmp_path):
    """DASSPEC_DECODE_KERNEL=0 (or a failed build): one warning naming what the guarantee becomes, the model still
    decodes, and `dasspec kernels info` reports it."""
    code = ("import warnings, dasspec, torch\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    m = dasspec.testing.random_model('ouro', seed=1, mean_recurrence=2, n_core=1)\n"
            "    out = dasspec.generate(m, [3, 4, 5], 'das-wave', max_new_tokens=4, eos=False)\n"
            "    out2 = dasspec.generate(m, [3, 4, 5], 'ar', max_new_tokens=4, eos=False)\n"
            "print(len([x for x in w if 'could not be built' in str(x.message)]), out.tokens == out2.tokens)\n")
    env = {**os.environ, "DASSPEC_DECODE_KERNEL": "0"}
    got = subprocess.run([sys.executable, "-c", "import dasspec.testing\n" + code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["1", "True"]
    info = subprocess.run([sys.executable, "-m", "dasspec.cli", "kernels", "info"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0 and "not available" in info.stdout and "torch's kernels" in info.stdout


def test_two_checkouts_of_the_same_sources_compile_the_same_paths(tmp_path, monkeypatch):
    """torch rebuilds an extension whose source paths changed: a second checkout (a worktree, another venv) of the
    same sources must hand the compiler the same paths - copies beside the build - or the two rebuild in turn."""
    import torch.utils.cpp_extension as cpp

    calls = []
    monkeypatch.setattr(cpp, "load", lambda name, sources, **kw: calls.append((sources, kw["extra_include_paths"])))
    monkeypatch.setenv("DASSPEC_KERNEL_DIR", str(tmp_path / "kernels"))
    decode_kernel._build()
    other = tmp_path / "other-checkout" / "csrc"
    shutil.copytree(decode_kernel.CSRC, other)
    monkeypatch.setattr(decode_kernel, "CSRC", other)
    decode_kernel._build()
    assert calls[0] == calls[1]
    folder = tmp_path / "kernels" / decode_kernel.build_tag()
    for path in calls[0][0] + calls[0][1]:
        assert path.startswith(str(folder)), path
    for name in decode_kernel.SOURCES + decode_kernel.HEADERS:
        assert (folder / "src" / name).read_bytes() == (other / name).read_bytes()


def test_each_torch_installation_gets_a_build_of_its_own(monkeypatch):
    """Two environments (two venvs of one checkout, or two checkouts) compile with different torch header paths:
    sharing one build folder made each rebuild it in turn, holding the others on its lock."""
    from dasspec.model import decode_kernel

    here = decode_kernel.build_tag()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/site-packages/torch/__init__.py")
    assert decode_kernel.build_tag() != here


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch.utils.cpp_extension guards a build with a lock file; a build killed mid-way leaves it, and every later
    load of the kernels waited on it for good (before the fix: this load timed out)."""
    if not decode_kernel.available():
        pytest.fail(f"the CPU kernels did not build: {decode_kernel.error()}")
    lock = decode_kernel.build_dir() / decode_kernel.build_tag() / "lock"
    lock.touch()
    try:
        got = subprocess.run([sys.executable, "-c", "from dasspec.model import decode_kernel as k; "
                              "print(k.available())"], capture_output=True, text=True, timeout=120)
        assert got.stdout.strip() == "True", got.stderr[-2000:]
    finally:
        lock.unlink(missing_ok=True)
