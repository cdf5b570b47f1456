"""Command line: ``dasspec generate | bench | probe NAME | train``.

Every command that writes results takes ``--out DIR`` and writes its files (markdown, JSONL, CSV, PNG) directly
into DIR.
"""

from __future__ import annotations

import argparse
import json
import sys

# Paper knobs get their own flags; any method knob can also be given as --set name=value.
KNOB_FLAGS = {
    "gamma": int, "rounds": int, "w_init": int, "k": int, "draft_depth": int, "block": int, "policy": str,
    "guesses": str, "seed_branch": int,
}


def add_knob_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("method knobs (named after the paper; defaults per model family, Table 5)")
    g.add_argument("--gamma", type=int, help="DAS-Wave verifier capacity / max active width")
    g.add_argument("--rounds", "-J", type=int, help="DAS-Wave refinement rounds J")
    g.add_argument("--w-init", dest="w_init", type=int, help="DAS-Wave initial active width W_init")
    g.add_argument("-k", type=int, help="DAS-Wave core updates per round")
    g.add_argument("--draft-depth", "-d", dest="draft_depth", type=int, help="sequential draft depth d")
    g.add_argument("--block", "-b", type=int, help="sequential draft block length b")
    g.add_argument("--policy", help="prefix read policy: aligned | deep-v (mature-v) | deep-k | deep-kv | k=..,v=..")
    g.add_argument("--guesses", help="DAS-Wave window seed: anchor (repeat it, the paper's) | lookup (prompt lookup) "
                                     "| copy (periodic copy of the latest match)")
    g.add_argument("--trim", dest="trim", action="store_true", default=None,
                   help="DAS-Wave: verify only up to the first proposal the last round changed")
    g.add_argument("--no-trim", dest="trim", action="store_false", help="DAS-Wave: verify every proposal (paper)")
    g.add_argument("--seed-branch", dest="seed_branch", type=int,
                   help="DAS-Wave: verify up to N tokens of the window's seed as a second branch (0 = off)")
    g.add_argument("--copy-run", dest="copy_run", action="store_true", default=None,
                   help="DAS-Wave: after a block whose seed was accepted whole, verify the next seed without rounds")
    g.add_argument("--no-copy-run", dest="copy_run", action="store_false", help="DAS-Wave: always run the rounds")
    g.add_argument("--early-stop", dest="early_stop", action="store_true", default=None,
                   help="DAS-Wave: stop a block's rounds after one that changed no guess (J becomes a cap)")
    g.add_argument("--no-early-stop", dest="early_stop", action="store_false", help="DAS-Wave: always run J rounds")
    g.add_argument("--carry", dest="carry", action="store_true", default=None, help="carry latent states (wave)")
    g.add_argument("--no-carry", dest="carry", action="store_false", help="re-initialise states every round")
    g.add_argument("--set", dest="extra", action="append", default=[], metavar="NAME=VALUE",
                   help="any other method knob, e.g. --set max_ngram=3 (repeatable)")


def knobs_from_args(args: argparse.Namespace) -> dict:
    names = list(KNOB_FLAGS) + ["carry", "trim", "copy_run", "early_stop"]
    knobs = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    for item in getattr(args, "extra", []) or []:
        if "=" not in item:
            raise SystemExit(f"--set expects NAME=VALUE, got {item!r}")
        name, value = item.split("=", 1)
        try:
            knobs[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            knobs[name.strip()] = value
    return knobs


def add_exec_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("execution (GPU options; see dasspec.accel)")
    g.add_argument("--static-shapes", action="store_true", help="fixed-shape attention over the whole cache")
    g.add_argument("--compile", action="store_true", help="torch.compile the model primitives (implies static)")
    g.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs via torch.compile reduce-overhead")


def load_for_args(args: argparse.Namespace):
    """load_model + the execution flags shared by generate / bench / probe / the speed benchmark."""
    import dasspec

    model = dasspec.load_model(args.model, device=args.device, dtype=args.dtype)
    if any(getattr(args, flag, False) for flag in ("static_shapes", "compile", "cuda_graphs")):
        dasspec.optimize(model, static_shapes=True, compile=args.compile, cuda_graphs=args.cuda_graphs)
    return model


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
                           seed=args.seed, streamer=streamer, **knobs_from_args(args))
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
    g.add_argument("--seed", type=int, default=0, help="seed of the per-position initial states")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); EOS always stops")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--quiet", action="store_true", help="print only the final text, no streaming")
    g.add_argument("--stats-json", default=None, help="write tokens, text and statistics to this JSON file")
    add_knob_flags(g)
    add_exec_flags(g)
    g.set_defaults(func=cmd_generate)

    for module in ("dasspec.eval.bench.cli", "dasspec.eval.probes.cli", "dasspec.train.recipe"):
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
