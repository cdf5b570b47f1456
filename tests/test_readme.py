"""The README's "Use it" snippet runs as written on the bundled model (its own asserts included): a name it never
defines or a CUDA-only call in it fails here."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_python_snippet_runs_as_written():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
