"""Command line: ``dasspec generate | bench | probe NAME | train | serve | eval``.

Every command that writes results takes ``--out DIR`` and writes its files (markdown, JSONL, CSV, PNG) directly
into DIR.  A bad input ends any command with one line ``dasspec: error: ...`` and exit code 2 (argparse's code for
a bad command line); Ctrl-C ends it with one line and exit code 130.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import sys
from collections.abc import Iterable

import dasspec

from .flags import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, add_exec_flags,  # noqa: F401  (re-exported)
                    add_exit_flags, add_knob_flags, add_sampling_flags, exit_from_args, knobs_from_args,
                    load_for_args, runtime_from_args, sampling_from_args)
from .host import THREADS_HELP, check_out_file, set_threads

# Errors that mean "the input is wrong" (a value, a path, a file's contents): a message, never a traceback.
# ValueError covers the domain errors (CheckpointError, ConfigError, ResumeError, DataFormatError), bad UTF-8 and
# bad JSON; FileNotFoundError covers DataError.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


class TextStreamer:
    """Prints decoded text as chunks arrive (HF streamer protocol: put / end; the first put is the prompt's ids,
    which it replaces by the prompt as typed, like transformers.TextStreamer(skip_prompt=True) plus an echo)."""

    def __init__(self, tokenizer, out=None, prompt: str = ""):
        # resolve sys.stdout now, not at import: redirect_stdout / capture replace it after this module loads
        self.tok, self.out = tokenizer, out if out is not None else sys.stdout
        self.ids: list[int] = []
        self.printed = 0
        self.prompt = prompt          # echoed at the first put: an input error raised before it prints alone
        self.prompt_seen = False

    def _echo_prompt(self) -> None:
        if self.prompt:
            self.out.write(self.prompt)
            self.prompt = ""

    def put(self, chunk) -> None:
        self._echo_prompt()
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(chunk.reshape(-1).tolist())
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):      # an incomplete UTF-8 sequence: wait for the next token
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def end(self) -> None:
        self._echo_prompt()
        text = self.tok.decode(self.ids)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


def utf8_text(text: str, source: str) -> str:
    """Command-line text, refused when it is not UTF-8: Python passes such bytes through as lone surrogates
    (PEP 383), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        byte = ord(text[err.start]) - 0xDC00 if "\udc80" <= text[err.start] <= "\udcff" else None
        what = f"byte {byte:#04x}" if byte is not None else f"{text[err.start]!r}"
        raise ValueError(f"{source} is not UTF-8 text ({what} at character {err.start + 1}); convert it, e.g. "
                         "with iconv -t UTF-8") from None
    return text


def read_prompt(args: argparse.Namespace) -> str:
    """``--prompt``, else all of stdin, as UTF-8 text (an error names which one is not)."""
    if args.prompt is not None:
        return utf8_text(args.prompt, "--prompt")
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:                             # a text stream put in place of stdin (tests, embedding)
        return utf8_text(sys.stdin.read(), "stdin")
    data = raw.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"stdin is not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); convert "
                         "it, e.g. with iconv -t UTF-8") from None


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)                  # every input check before the model loads
    stops = [utf8_text(s, "--stop") for s in args.stop]
    target = exit_from_args(args)
    if args.stats_json:
        check_out_file(args.stats_json, "--stats-json")
    if args.trace:
        check_out_file(args.trace, "--trace")
    set_threads(args.threads)
    model = load_for_args(args)
    if model.tokenizer is None:
        raise ValueError(f"{model.source}: no tokenizer.json next to the weights; cannot encode the prompt")
    if args.chat:               # one user turn in the checkpoint's template, which places its own special tokens
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ids = model.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = model.tokenizer.encode(prompt)
    streamer = None if args.quiet else TextStreamer(model.tokenizer, prompt="" if args.chat else prompt)
    try:
        res = dasspec.generate(model, ids, method=args.method, max_new_tokens=args.max_new_tokens,
                               num_steps=args.num_steps, init_scale=args.init_scale, stop=stops or None,
                               seed=args.seed, streamer=streamer, runtime=runtime_from_args(args),
                               trace=bool(args.trace), **target, **sampling_from_args(args), **knobs_from_args(args))
    except KeyboardInterrupt:
        if streamer is not None and streamer.prompt_seen:
            print(flush=True)                   # end the streamed line: the message goes on a line of its own
        raise
    s = res.stats
    if args.quiet:
        print(res.text)
    print(f"[{s.method}] {s.new_tokens} tokens in {s.wall_time:.2f}s ({s.tokens_per_second:.1f} tok/s); "
          f"stop: {s.stop_reason}; verifications {s.verify_events}, A={s.A:.2f}, G={s.G:.2f}; "
          f"sequential core passes {s.sequential_passes}", file=sys.stderr)
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump({"tokens": res.tokens, "text": res.text, **s.to_dict()}, f, indent=2)
    if args.trace:
        write_trace(args.trace, res.trace)
    return 0


def write_trace(path: str, trace: list) -> None:
    """One JSON line per verified block: the draft's tokens, what the target accepted and committed, and the
    drafter's notes (method auto: the arm, the rule that decided, the batch plan, the estimates compared)."""
    def plain(x):
        if hasattr(x, "tolist"):
            return x.tolist()
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)
    with open(path, "w") as f:
        for i, (draft, verdict) in enumerate(trace):
            f.write(json.dumps({"block": i, "draft": plain(draft.tokens), "accepted": verdict.accepted,
                                "committed": list(verdict.tokens), "notes": plain(draft.notes or {})}) + "\n")


def add_parser(sub) -> argparse.ArgumentParser:
    """``dasspec generate``: its flags, with every registered method's knobs (importing the methods loads torch,
    so this runs only when the command is used)."""
    from .methods import method_names       # lazy: torch, for this command's parser only (not dasspec --help)

    g = sub.add_parser("generate", help=COMMANDS["generate"][0])
    g.add_argument("--model", default=None, help="checkpoint folder or HF repo id in the local cache "
                                                  "(default: the bundled model)")
    g.add_argument("--prompt", default=None, help="prompt text (default: read stdin); UTF-8")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as one user turn in the checkpoint's chat template (a plain 'role: "
                        "content' one when it has none) and print only the reply")
    g.add_argument("--method", default="ar", choices=method_names(), metavar="METHOD",
                   help=f"decoding method: {', '.join(method_names())} (default: %(default)s, full-depth "
                        "autoregressive; every method emits its tokens)")
    g.add_argument("--max-new-tokens", type=int, default=128,
                   help="most tokens to generate, prompt excluded (default: %(default)s)")
    g.add_argument("--num-steps", type=int, default=None, help="target recurrence depth R (default: config)")
    g.add_argument("--init-scale", type=float, default=1.0,
                   help="initial-state scale (0: zero state; default: %(default)s)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the per-position initial states and of sampling (default: %(default)s)")
    add_sampling_flags(g)
    add_exit_flags(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); EOS always stops")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA when available, else CPU)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight and compute type (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    g.add_argument("--quiet", action="store_true", help="print only the final text, no streaming")
    g.add_argument("--stats-json", default=None, help="write tokens, text and statistics to this JSON file")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="write every verified block to this JSONL file: its draft, what was accepted and committed, "
                        "and the drafter's notes (method auto: the arm, the rule that decided and the estimates it "
                        "compared)")
    add_knob_flags(g)
    add_exec_flags(g)
    g.set_defaults(func=cmd_generate)
    return g


# The commands: name -> (its one-line help, the module whose add_parser(sub) declares it).  A module is imported
# only when its command is used, so ``dasspec --help`` starts without torch; each module passes the same help line
# to sub.add_parser (tests/test_reliability.py checks that the two listings agree).
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate text with any method (streams to stdout)", __name__),
    "bench": ("paired speedup benchmark (paper Table 1) into --out DIR", "dasspec.eval.bench.cli"),
    "probe": ("mechanism probes (maturity, channels, grid, factorial, sweep, cost)", "dasspec.eval.probes.cli"),
    "train": ("train the bundled looped model (or a bigger preset on a GPU); rerun to resume", "dasspec.train.cli"),
    "serve": ("OpenAI-compatible HTTP server (completions, chat, streaming, metrics)", "dasspec.serve.cli"),
    "eval": ("lm-evaluation-harness with dasspec's model and offline tasks (lm-eval's own arguments)",
             "dasspec.eval.lm_eval_cli"),
    "kernels": ("build the CPU kernels ahead of time (build), or show the ISA and the exactness guarantee (info)",
                "dasspec.kernels_cli"),
}


class OneLineParser(argparse.ArgumentParser):
    """A flag error is one line and exit 2, like every other bad input (argparse prints its whole usage first)."""

    def error(self, message: str):
        raise SystemExit(f"{message} (see: {self.prog} --help)")     # main() prints it as its one line, exit 2


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``dasspec`` parser with ``commands`` declared in full (default: all of them); the others are listed
    by name and help line only, which needs none of their imports."""
    p = OneLineParser(prog="dasspec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    full = set(COMMANDS if commands is None else commands)
    for name, (help_line, module) in COMMANDS.items():
        if name in full:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_line)
    return p


def main(argv: list[str] | None = None) -> int:
    """``dasspec``: every command's input errors end with one line on stderr and exit code 2, Ctrl-C with one
    line and 130 - never a traceback (a traceback means a bug in dasspec)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if sys.stdout is None or _closed(sys.stdout):
        # (`dasspec ... >&-`): Python starts with no stdout; every command prints its result or progress there
        return _fail("error: stdout is closed; redirect it instead (> FILE, or > /dev/null to discard it)",
                     EXIT_USAGE)
    try:
        parser = build_parser([argv[0]] if argv and argv[0] in COMMANDS else [])
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt as stop:
        return _fail(f"interrupted{f': {stop}' if str(stop) else ''}", EXIT_INTERRUPTED)
    except SystemExit as stop:
        if isinstance(stop.code, str):          # raise SystemExit("message") in a command
            return _fail(f"error: {stop.code}", EXIT_USAGE)
        raise
    except BrokenPipeError:                     # `dasspec generate ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except Exception as err:
        if is_user_error(err) and not os.environ.get("DASSPEC_TRACEBACK"):
            # (a ValueError can also come from a bug, deep inside: DASSPEC_TRACEBACK=1 shows where)
            return _fail(f"error: {err}", EXIT_USAGE)
        if isinstance(err, OSError):
            return _fail(f"error: {err}", EXIT_FAILED)
        raise


def _closed(stream) -> bool:
    """Whether ``stream``'s descriptor is closed (an in-memory stream put in its place is not)."""
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return bool(getattr(stream, "closed", False))
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` reports a bad input (answered with a message), not a bug (answered with a traceback)."""
    if isinstance(err, USER_ERRORS):
        return True
    cache = sys.modules.get("dasspec.model.cache")      # loaded if a model was: no torch import just to check
    return cache is not None and isinstance(err, cache.CacheCapacityError)


def _fail(message: str, code: int) -> int:
    print(f"dasspec: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
