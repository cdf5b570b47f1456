"""Command line: ``dasspec generate | bench | probe NAME | train``.

Every command that writes results takes ``--out DIR`` and writes its files (markdown, JSONL, CSV, PNG) directly
into DIR.
"""

from __future__ import annotations

import argparse
import json
import sys

def add_knob_flags(p: argparse.ArgumentParser) -> None:
    """Every registered method's knobs as flags (derived from their dataclasses), plus --set NAME=VALUE."""
    from .methods import all_knobs
    from .methods.knobs import add_knob_flags as add

    g = p.add_argument_group("method knobs (named after the paper; defaults per model family, Table 5)")
    add(g, all_knobs())
    g.add_argument("--set", dest="extra", action="append", default=[], metavar="NAME=VALUE",
                   help="a method knob as NAME=VALUE (repeatable), e.g. --set static_corpus=docs.jsonl")


def knobs_from_args(args: argparse.Namespace) -> dict:
    from .methods import all_knobs
    from .methods.knobs import knobs_from_args as parse

    return parse(args, all_knobs(), getattr(args, "extra", []))


def add_sampling_flags(p) -> None:
    p.add_argument("--temperature", type=float, default=None,
                   help="sample at this temperature (> 0; 0 = greedy, the default); lossless: every method emits "
                        "what AR sampling emits at the same --seed")
    p.add_argument("--top-k", dest="top_k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", dest="top_p", type=float, default=None, help="sample from the top tokens holding p")
    p.add_argument("--min-p", dest="min_p", type=float, default=None,
                   help="sample from tokens at least min_p x as likely as the most likely one")


def sampling_from_args(args: argparse.Namespace) -> dict:
    """generate()'s sampling options from the flags: a temperature > 0 or any filter samples (temperature 1.0 by
    default); --temperature 0 (or none of them) decodes greedily."""
    filters = {k: getattr(args, k) for k in ("top_k", "top_p", "min_p") if getattr(args, k, None) is not None}
    t = getattr(args, "temperature", None)
    if t == 0:
        if filters:
            raise ValueError(f"--temperature 0 decodes greedily; {', '.join(filters)} need sampling (a temperature "
                             "> 0)")
        return {}
    if t is None and not filters:
        return {}
    return {"do_sample": True, "temperature": t, **filters}


def add_exec_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("execution (GPU options; see dasspec.Runtime)")
    g.add_argument("--static-shapes", action="store_true", help="fixed-shape attention over the whole cache")
    g.add_argument("--compile", action="store_true", help="torch.compile the model primitives (implies static)")
    g.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs via torch.compile reduce-overhead")


def runtime_from_args(args: argparse.Namespace, track_memory: bool = False):
    from .engine.runtime import Runtime

    return Runtime(static_shapes=getattr(args, "static_shapes", False), compile=getattr(args, "compile", False),
                   cuda_graphs=getattr(args, "cuda_graphs", False), track_memory=track_memory)


def load_for_args(args: argparse.Namespace):
    """load_model for the --model / --device / --dtype flags shared by generate / bench / probe and benchmarks."""
    import dasspec

    return dasspec.load_model(args.model, device=args.device, dtype=args.dtype)


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


def cmd_generate(args: argparse.Namespace) -> int:
    import dasspec

    model = load_for_args(args)
    if model.tokenizer is None:
        raise SystemExit(f"{args.model}: no tokenizer.json next to the weights; cannot encode --prompt")
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    ids = model.tokenizer.encode(prompt)
    streamer = None if args.quiet else TextStreamer(model.tokenizer, prompt=prompt)
    res = dasspec.generate(model, ids, method=args.method, max_new_tokens=args.max_new_tokens,
                           num_steps=args.num_steps, init_scale=args.init_scale, stop=args.stop or None,
                           seed=args.seed, streamer=streamer, runtime=runtime_from_args(args),
                           **sampling_from_args(args), **knobs_from_args(args))
    s = res.stats
    if args.quiet:
        print(res.text)
    print(f"[{s.method}] {s.new_tokens} tokens in {s.wall_time:.2f}s ({s.tokens_per_second:.1f} tok/s); "
          f"stop: {s.stop_reason}; verifications {s.verify_events}, A={s.A:.2f}, G={s.G:.2f}; "
          f"sequential core passes {s.sequential_passes}", file=sys.stderr)
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump({"tokens": res.tokens, "text": res.text, **s.to_dict()}, f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .methods import method_names

    p = argparse.ArgumentParser(prog="dasspec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with any method (streams to stdout)")
    g.add_argument("--model", default=None, help="checkpoint folder or HF repo id in the local cache "
                                                  "(default: the bundled model)")
    g.add_argument("--prompt", default=None, help="prompt text (default: read stdin)")
    g.add_argument("--method", default="ar", choices=method_names())
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--num-steps", type=int, default=None, help="target recurrence depth R (default: config)")
    g.add_argument("--init-scale", type=float, default=1.0, help="initial-state scale (0: zero state)")
    g.add_argument("--seed", type=int, default=0, help="seed of the per-position initial states and of sampling")
    add_sampling_flags(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); EOS always stops")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--quiet", action="store_true", help="print only the final text, no streaming")
    g.add_argument("--stats-json", default=None, help="write tokens, text and statistics to this JSON file")
    add_knob_flags(g)
    add_exec_flags(g)
    g.set_defaults(func=cmd_generate)

    for module in ("dasspec.eval.bench.cli", "dasspec.eval.probes.cli", "dasspec.train.cli"):
        try:
            mod = __import__(module, fromlist=["add_parser"])
        except ModuleNotFoundError as err:
            if err.name and err.name.startswith("dasspec"):
                continue
            raise
        mod.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        from .model.cache import CacheCapacityError
        from .model.checkpoint import CheckpointError
        from .model.config import ConfigError
        if isinstance(err, (CheckpointError, ConfigError, CacheCapacityError, ValueError, FileNotFoundError)):
            print(f"dasspec: error: {err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
