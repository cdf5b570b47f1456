"""Chat templates: compiled as Hugging Face's ``apply_chat_template`` compiles them, and rendered either in this
process (``Tokenizer.apply_chat_template``) or in a sandbox process with bounded time, output and memory
(``TemplateSandbox``, what the server uses: a checkpoint's template is untrusted code, and Jinja's own sandbox
bounds what a template may touch, not how long it runs or how much it allocates).

This module imports only the standard library and jinja2: the sandbox runs it as a script (``python -I
chat_template.py``), so a render process starts in a fraction of a second and never loads torch.
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence


@functools.lru_cache(maxsize=8)          # compiled once per template, not per request
def compile_chat_template(template: str):
    """A Jinja template compiled as Hugging Face's ``apply_chat_template`` does: sandboxed (a checkpoint's template
    is untrusted code), trim_blocks + lstrip_blocks, loop controls, the ``{% generation %}`` tag (rendered as its
    body: only training masks care about it), ``raise_exception`` and ``tojson``."""
    # lazy: jinja2 when a template is first compiled (the sandbox's child imports this module, and only jinja2)
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


class TemplateLimit(ValueError):
    """A chat template exceeded the sandbox's time, output or memory bound (``bound`` True), or failed by itself
    (its ``raise_exception``, a type error: ``bound`` False)."""

    def __init__(self, message: str, bound: bool = True):
        super().__init__(message)
        self.bound = bound


START_TIMEOUT_S = 30.0     # how long the render process may take to start (not counted in a template's limit)


class TemplateSandbox:
    """Renders chat templates in a child process (started on first use, restarted after it is killed) with
    bounded wall time (``timeout_s``: past it the child is killed), output (``max_chars``: rendering stops there)
    and address space (``memory_bytes`` beyond the child's own at start).  ``render`` is thread-safe and blocks
    the calling thread only: call it off an event loop.  Any failure is a ``TemplateLimit`` naming the bound or the
    template's own error."""

    def __init__(self, timeout_s: float, max_chars: int, memory_bytes: int = 256 << 20):
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise ValueError(f"the template time limit must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s, self.max_chars, self.memory_bytes = float(timeout_s), int(max_chars), int(memory_bytes)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._count = threading.Lock()
        self.rendering = 0           # renders asked for and not yet answered (those waiting for the child too)

    def render(self, template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               special_tokens: Mapping[str, str], template_kwargs: Mapping[str, Any] | None = None) -> str:
        """``template_kwargs``: the template's own variables (``enable_thinking``), under the messages, the
        generation flag and the special tokens (which they cannot replace)."""
        request = json.dumps({"template": template, "messages": [dict(m) for m in messages],
                              "add_generation_prompt": add_generation_prompt, "special": dict(special_tokens),
                              "kwargs": dict(template_kwargs or {}), "max_chars": self.max_chars}).encode() + b"\n"
        with self._count:
            self.rendering += 1
        try:
            with self._lock:
                proc = self._child()
                try:
                    proc.stdin.write(request)
                    proc.stdin.flush()
                except OSError:
                    self._kill()
                    raise TemplateLimit("the chat template's render process stopped (exceeded its memory?)") from None
                line = self._read_line(proc, time.monotonic() + self.timeout_s)
        finally:
            with self._count:
                self.rendering -= 1
        answer = json.loads(line)
        if "error" in answer:
            raise TemplateLimit(answer["error"], answer.get("bound", True))
        text = answer["text"]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise TemplateLimit("the chat template produced text with a lone UTF-16 surrogate", False) from None
        return text

    def close(self) -> None:
        with self._lock:
            self._kill()

    # --- the child --------------------------------------------------------------------------------------------
    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(self.memory_bytes)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          close_fds=True)
            self._buf = b""
            # the time limit is the template's, not the interpreter's start (slow on a loaded machine): wait for
            # the child's "ready" line under a bound of its own
            if json.loads(self._read_line(self._proc, time.monotonic() + START_TIMEOUT_S, "start")) != {"ready": True}:
                self._kill()
                raise TemplateLimit("the chat template's render process did not start properly")
        return self._proc

    def _read_line(self, proc: subprocess.Popen, deadline: float, what: str = "render") -> bytes:
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self._kill()
                if what == "start":
                    raise TemplateLimit(f"the chat template's render process did not start within "
                                        f"{START_TIMEOUT_S:g} s (the machine is overloaded?)")
                raise TemplateLimit(f"the chat template did not finish within {self.timeout_s:g} s "
                                    "(dasspec serve --template-timeout); it was stopped")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self._kill()
                raise TemplateLimit(f"the chat template's render process stopped (it exceeded the "
                                    f"{self.memory_bytes >> 20} MiB memory bound?)")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass


def _child_main(memory_bytes: int) -> None:
    """The render loop: one JSON request per line on stdin, one JSON answer per line on stdout."""
    import resource     # optional: Unix only; in the child, which bounds its own memory with it

    import jinja2       # lazy: as in compile_chat_template
    with open("/proc/self/statm") as f:                 # pages of address space in use now (Linux)
        base = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = base + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            ctx = {**req.get("kwargs", {}), "messages": req["messages"],
                   "add_generation_prompt": req["add_generation_prompt"], **req["special"]}
            parts, size = [], 0
            for piece in compile_chat_template(req["template"]).generate(**ctx):
                size += len(piece)
                if size > req["max_chars"]:
                    raise TemplateLimit(f"the chat template's output passed {req['max_chars']} characters, more "
                                        "than any prompt that fits the model's context")
                parts.append(piece)
            answer = {"text": "".join(parts)}
        except TemplateLimit as err:
            answer = {"error": str(err)}
        except MemoryError:
            answer = {"error": f"the chat template exceeded its {memory_bytes >> 20} MiB memory bound"}
        except RecursionError:
            answer = {"error": "the chat template recursed too deeply"}
        except (jinja2.TemplateError, Exception) as err:      # the template's raise_exception, a type error, ...
            answer = {"error": f"the chat template failed: {type(err).__name__}: {str(err)[:300]}", "bound": False}
        parts = []
        try:
            data = json.dumps(answer).encode()
        except MemoryError:
            data = json.dumps({"error": "the chat template's output exceeded the memory bound"}).encode()
        out.write(data + b"\n")
        out.flush()


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
