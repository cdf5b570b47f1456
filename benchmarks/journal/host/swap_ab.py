"""A change to a few Python functions, paired in one process: each round runs one workload with the functions as
they were at ``--base`` (their source from git, compiled in today's modules) and as they are now, in alternating
order, and checks that both sides decode the same tokens.  For host-work changes, whose few percent a run of two
processes on this host cannot resolve (docs/performance-journal.md, "Host work per model call").

    python benchmarks/journal/host/swap_ab.py --base HEAD~1 \\
        --swap dasspec.model.layers:kernel_pair,dasspec.model.layers:NormedBlock.plain_parts \\
        --model /tmp/ouro-mid --method ar --batch 8 --tokens 32 --rounds 6

``--swap``: ``module:function`` or ``module:Class.method``, comma-separated; a function that other modules import
by name is swapped there too.  Workload: ``--batch`` 1 decodes 4 GSM8K questions one ``generate`` call each; more
decodes ``--batch`` questions in one ``generate_batch``; a checkpoint without a tokenizer decodes random ids.
Prints one markdown row: new / old speed per round (old seconds / new), median [range], and whether every run's
tokens were equal.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import dasspec  # noqa: E402
from dasspec.eval.data import data_dir  # noqa: E402


def old_source(base: str, module: str, name: str) -> tuple[str, str]:
    """The module's import statements and the source of ``name`` (a function or ``Class.method``) in ``module`` at
    git revision ``base``."""
    path = module.replace(".", "/") + ".py"
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{base}:{path}"], capture_output=True, text=True,
                         check=True).stdout
    body = ast.parse(src).body
    imports = "\n".join(ast.get_source_segment(src, n) for n in body if isinstance(n, (ast.Import, ast.ImportFrom))
                        and not (isinstance(n, ast.ImportFrom) and n.module == "__future__"))
    cls, _, fn = name.rpartition(".")
    for node in body:
        if not cls and isinstance(node, ast.FunctionDef) and node.name == fn:
            return imports, ast.get_source_segment(src, node)
        if cls and isinstance(node, ast.ClassDef) and node.name == cls:
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef) and sub.name == fn:
                    return imports, textwrap.dedent(ast.get_source_segment(src, sub))
    raise SystemExit(f"{name} is not defined in {path} at {base}")


def swaps(base: str, names: list[str]) -> list[tuple[object, str, object, object]]:
    """(owner, attribute, old object, new object) per swapped name, and per module that imported a function."""
    out = []
    for spec in names:
        module, name = spec.split(":")
        mod = importlib.import_module(module)
        ns = dict(vars(mod))                      # today's module globals: the old body sees today's helpers,
        imports, source = old_source(base, module, name)
        exec(compile(imports, f"<{base}:{module} imports>", "exec"), ns)     # and the names its module imported
        exec(compile(source, f"<{base}:{spec}>", "exec"), ns)
        cls, _, fn = name.rpartition(".")
        owner = getattr(mod, cls) if cls else mod
        new = getattr(owner, fn)
        out.append((owner, fn, ns[fn], new))
        if not cls:                              # modules that imported the function by name
            for other in list(sys.modules.values()):
                if other is not mod and getattr(other, "__name__", "").startswith("dasspec") \
                        and getattr(other, fn, None) is new:
                    out.append((other, fn, ns[fn], new))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision whose functions are the 'old' side")
    p.add_argument("--swap", required=True, help="module:function or module:Class.method, comma-separated")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled model)")
    p.add_argument("--method", default="ar")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = dasspec.load_model(a.model)
    if model.tokenizer is not None or a.model is None:
        tok = dasspec.load_tokenizer(a.model)
        lines = (data_dir(required=True) / "gsm8k" / "test.jsonl").read_text().splitlines()
        prompts = [tok.encode(json.loads(line)["question"]) for line in lines[:8]]
    else:
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, model.config.vocab_size, (int(k),), generator=g).tolist()
                   for k in torch.randint(40, 121, (8,), generator=g)]
    table = swaps(a.base, a.swap.split(","))

    def use(side: str) -> None:
        for owner, attr, old, new in table:
            setattr(owner, attr, old if side == "old" else new)

    def run() -> tuple[float, str]:
        t = time.perf_counter()
        if a.batch == 1:
            res = [dasspec.generate(model, q, a.method, max_new_tokens=a.tokens, eos=False) for q in prompts[:4]]
        else:
            res = dasspec.generate_batch(model, prompts[: a.batch], a.method, max_new_tokens=a.tokens, eos=False,
                                         max_batch=a.batch)
        seconds = time.perf_counter() - t
        return seconds, hashlib.md5(str([[int(x) for x in r.tokens] for r in res]).encode()).hexdigest()

    try:
        for side in ("old", "new"):              # warm-up: both sides' first calls
            use(side)
            run()
        times: dict[str, list[float]] = {"old": [], "new": []}
        runs = set()
        for i in range(a.rounds):
            for side in (("old", "new") if i % 2 == 0 else ("new", "old")):
                use(side)
                seconds, tokens = run()
                times[side].append(seconds)
                runs.add(tokens)
    finally:
        use("new")
    r = [o / n for o, n in zip(times["old"], times["new"])]
    print(f"| {a.model or 'bundled'} | {a.method} | {a.batch} | {statistics.median(r):.3f} [{min(r):.3f}, "
          f"{max(r):.3f}] | {statistics.median(times['old']):.3f} s | {statistics.median(times['new']):.3f} s | "
          f"{'equal' if len(runs) == 1 else 'DIFFER'} |")
    return 0 if len(runs) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
