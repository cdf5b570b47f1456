"""dasspec against each family's upstream HF remote code at its real shape (issue 53): random weights, float32 and
bfloat16, greedy, batch 1, the same token ids on every side.

* Nanbeige4.2-3B (``--nanbeige``: ``benchmarks/nanbeige_files.py --preset 3b``, then ``python -m dasspec.testing
  build-real --scale full``, bfloat16 weights): upstream's ``modeling_nanbeige.py`` (package ``hfmod``), greedy
  through its own DynamicCache, ``inv_freq`` recomputed after loading (its buffer is never in a checkpoint: the
  zero-buffer bug, as ``nanbeige_peers.hf_worker``).
* IQuest-Coder-V1-40B-Loop (``--iquest``: ``benchmarks/iquest_real.py``'s published widths at ``--layers 2``, since
  80 layers do not fit): upstream's ``modeling_iquestloopcoder.py`` (package ``iqmod``) twice - greedy by full
  recomputation (its uncached forward on the whole sequence for every token, which dasspec and vLLM follow) and
  greedy through its own cache (prefill, then one-row steps: a different computation past the first decoded token,
  docs/families.md "IQuest-Coder-V1-Loop").
* dasspec: ``generate(..., "ar")`` and ``auto`` (its drafter built once per process).

Each (family, dtype, side group) runs in a worker process of its own (``--hf-path`` on the upstream worker's
PYTHONPATH: transformers and the two packages, kept outside the repository) that loads once and runs every round:
upstream's model is built on the meta device and each checkpoint tensor is converted to the dtype and assigned
alone, so peak memory stays about one copy of the weights. Where both workers fit in memory at once they are
loaded together and alternate prompt by prompt (the sides' order flipping each prompt); otherwise (here Nanbeige-3B
in float32) dasspec's worker runs all its rounds and exits, then upstream's. tok/s of a prompt run is its new tokens
over its wall time with the prefill; median [range] over prompts x rounds. Tokens: how many leading tokens each side
shares with dasspec's AR of the same dtype, per prompt, and float32 against bfloat16; where upstream's greedy leaves
dasspec's AR (IQuest's cached path aside), the top-2 logits of upstream's uncached forward at that point.

    python benchmarks/nanbeige_files.py --out /tmp/uhf/nb3b-files --preset 3b
    python -m dasspec.testing build-real --from /tmp/uhf/nb3b-files --out /tmp/uhf/nb3b --scale full
    python -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \\
        from iquest_real import build; build(Path('/tmp/uhf/iq2l'), 2)"
    python benchmarks/upstream_hf.py --nanbeige /tmp/uhf/nb3b --iquest /tmp/uhf/iq2l \\
        --hf-path /tmp/uhf/site:/tmp/uhf --tokens 8 --rounds 1 \\
        --out benchmarks/records/performance/upstream-hf-2026-12-07

(``--tokens 8 --rounds 1``: the whole run then takes ~25 minutes on 2 shared cores; ``--report results.json``
rewrites results.md from the numbers.)

A benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nanbeige_peers import agree

SIDES = {"nanbeige": {"hf": ("HF cached",), "dasspec": ("dasspec AR", "dasspec auto")},
         "iquest": {"hf": ("HF uncached", "HF cached"), "dasspec": ("dasspec AR", "dasspec auto")}}
LABEL = {"nanbeige": "Nanbeige4.2-3B (22 layers x 2 loops)",
         "iquest": "IQuest-Coder-V1-40B-Loop widths, 2 of 80 layers x 2 loops"}


def _dtype(name: str):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _peak_rss() -> int:
    from dasspec.model.memory import _proc_bytes
    return _proc_bytes("/proc/self/status", "VmHWM") or 0


def hf_load(family: str, folder: str, dtype: str):
    """Upstream's model on the meta device, each checkpoint tensor converted to ``dtype`` and assigned alone."""
    import torch
    from safetensors import safe_open

    if family == "nanbeige":
        from hfmod.configuration_nanbeige import NanbeigeConfig as Config
        from hfmod.modeling_nanbeige import NanbeigeForCausalLM as Model
    else:
        from iqmod.configuration_iquestloopcoder import IQuestLoopCoderConfig as Config
        from iqmod.modeling_iquestloopcoder import IQuestLoopCoderForCausalLM as Model
    cfg = json.loads((Path(folder) / "config.json").read_text())
    config = Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "model_type")})
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = Model(config)
    rename = getattr(Model, "_rename_state_dict_keys", lambda d: d)   # IQuest: gate_projections.i -> layers.i.
    index = Path(folder) / "model.safetensors.index.json"
    shards = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
              else ["model.safetensors"])
    loaded = set()
    for shard in shards:
        with safe_open(str(Path(folder) / shard), framework="pt") as f:
            for key in f.keys():
                (name, t), = rename({key: f.get_tensor(key).to(_dtype(dtype))}).items()
                owner, _, leaf = name.rpartition(".")
                mod = model.get_submodule(owner)
                if leaf in mod._parameters:
                    mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
                else:
                    mod._buffers[leaf] = t
                loaded.add(name)
    for mod in model.modules():                    # RoPE tables are computed, never loaded (Nanbeige: never at all)
        if hasattr(mod, "inv_freq"):
            mod.inv_freq = 1.0 / (mod.base ** (torch.arange(0, mod.dim, 2, dtype=torch.int64).float() / mod.dim))
    left = [k for k, v in [*model.state_dict().items(), *model.named_buffers()] if v.is_meta]   # + non-persistent
    missing = set(dict(model.named_parameters())) - loaded
    assert not left and not missing, (left, missing)
    return model.eval()


def hf_decode(model, ids: list[int], n: int, cached: bool) -> list[int]:
    """Greedy: through the model's own cache (``cached``), or its uncached forward on the whole sequence per token."""
    import torch

    out: list[int] = []
    with torch.inference_mode():
        if not cached:
            while len(out) < n:
                out.append(int(model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1].argmax()))
            return out
        kw = {}
        if type(model).__name__.startswith("Nanbeige"):
            from transformers.cache_utils import DynamicCache
            kw["past_key_values"] = DynamicCache()
        step = model(input_ids=torch.tensor([ids]), use_cache=True, **kw)
        while len(out) < n:
            out.append(int(step.logits[0, -1].argmax()))
            if len(out) < n:
                step = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=step.past_key_values,
                             use_cache=True)
    return out


def hf_top2(model, ids: list[int]) -> list[list]:
    """The two largest logits of the uncached forward after ``ids``: [[id, logit], [id, logit]]."""
    import torch
    with torch.inference_mode():
        v, i = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float().topk(2)
    return [[int(i[k]), float(v[k])] for k in range(2)]


def worker(kind: str, family: str, folder: str, dtype: str, threads: int) -> None:
    """Load once, then answer one JSON request a line: {"side", "ids", "n"} -> {"tokens", "seconds"};
    {"top2": ids} -> {"top2"}; {"rss": true} -> {"peak_rss"}."""
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    if kind == "hf":
        model = hf_load(family, folder, dtype)
    else:
        import dasspec
        model = dasspec.load_model(folder, device="cpu", dtype=_dtype(dtype))
    load_s = time.perf_counter() - t0
    ready = {"ready": True, "load_s": load_s}
    if kind == "dasspec":                          # auto's drafter, built once (calibrated) and kept
        t1 = time.perf_counter()
        drafter = dasspec.build_drafter(model, "auto")
        ready["drafter_s"] = time.perf_counter() - t1
    else:
        import transformers
        ready["transformers"] = transformers.__version__
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if "top2" in req:
            print(json.dumps({"top2": hf_top2(model, req["top2"])}), flush=True)
            continue
        if "rss" in req:
            print(json.dumps({"peak_rss": _peak_rss()}), flush=True)
            continue
        t = time.perf_counter()
        if kind == "hf":
            toks = hf_decode(model, req["ids"], req["n"], cached=req["side"] == "HF cached")
        else:
            method = "auto" if req["side"] == "dasspec auto" else "ar"
            toks = dasspec.generate(model, req["ids"], method, max_new_tokens=req["n"], eos=False,
                                    drafter=drafter if method == "auto" else None).tokens
        print(json.dumps({"tokens": [int(x) for x in toks], "seconds": time.perf_counter() - t}), flush=True)


class Worker:
    """One worker process (``kind`` "hf" or "dasspec"), loaded once; ``ask`` sends a request, waits for the answer."""

    def __init__(self, kind: str, family: str, folder: str, dtype: str, args: argparse.Namespace):
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        if kind == "hf":
            env["PYTHONPATH"] = args.hf_path
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", kind, "--family", family, "--model", folder,
                                      "--dtype", dtype, "--threads", str(args.threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = json.loads(self.proc.stdout.readline())

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> int:
        rss = self.ask(rss=True)["peak_rss"]
        self.proc.stdin.close()
        self.proc.wait()
        return rss


def prompts_for(n: int, vocab_hi: int, lengths: tuple[int, int] = (20, 60), seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``lengths`` (inclusive) random ids in [3, vocab_hi)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_hi) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def weight_bytes(folder: str, dtype: str) -> int:
    """The checkpoint's weights at ``dtype`` (the checkpoints here are bfloat16)."""
    size = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    return size * (2 if dtype == "float32" else 1)


def run_case(family: str, folder: str, dtype: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Every side of one family at one dtype: tok/s of every prompt run, the tokens, load s, peak RSS."""
    from dasspec.model.memory import _proc_bytes
    avail = _proc_bytes("/proc/meminfo", "MemAvailable") or 0
    together = 2 * 1.2 * weight_bytes(folder, dtype) + 2 * 2**30 < avail
    res: dict = {"together": together, "rates": {}, "tokens": {}, "load_s": {}, "peak_rss": {}, "unstable": []}

    def one_round(workers: list[Worker], r: int) -> None:
        """Each prompt on every side of ``workers``, the sides' order flipped from one prompt to the next."""
        for i, ids in enumerate(prompts):
            runs = [(w, side) for w in workers for side in SIDES[family][w.kind]]
            for w, side in runs if (r + i) % 2 == 0 else runs[::-1]:
                a = w.ask(side=side, ids=ids, n=args.tokens)
                res["rates"].setdefault(side, []).append(args.tokens / a["seconds"])
                seen = res["tokens"].setdefault(side, [None] * len(prompts))
                if seen[i] is not None and seen[i] != a["tokens"]:
                    res["unstable"].append([side, i, r])              # a side's tokens changed between rounds
                seen[i] = a["tokens"]
                print(f"{family} {dtype} round {r} prompt {i} {side}: {args.tokens / a['seconds']:.3f} tok/s",
                      file=sys.stderr, flush=True)

    def start(kind: str) -> Worker:
        w = Worker(kind, family, folder, dtype, args)
        for side in SIDES[family][kind]:
            res["load_s"][side] = w.ready["load_s"]
        res.update({k: w.ready[k] for k in ("drafter_s", "transformers") if k in w.ready})
        return w

    def finish(w: Worker) -> None:
        if w.kind == "hf":                         # top-2 gap where upstream's greedy leaves dasspec's AR
            res["gaps"] = {}
            ar = res["tokens"].get("dasspec AR")
            for side in SIDES[family]["hf"]:
                if ar is None or side == "HF cached" and family == "iquest":
                    continue
                gaps = []
                for ids, a, b in zip(prompts, res["tokens"][side], ar):
                    k = agree(a, b)
                    gaps.append(None if k == len(a) else w.ask(top2=ids + b[:k])["top2"])
                res["gaps"][side] = gaps
        rss = w.close()
        for side in SIDES[family][w.kind]:
            res["peak_rss"][side] = rss

    if together:                                   # both resident: alternate prompt by prompt
        ws = [start("dasspec"), start("hf")]
        for r in range(args.rounds):
            one_round(ws, r)
        for w in ws:
            finish(w)
    else:                                          # one at a time: dasspec's rounds, then upstream's
        for kind in ("dasspec", "hf"):
            w = start(kind)
            for r in range(args.rounds):
                one_round([w], r)
            finish(w)
    return res


def table(results: dict) -> str:
    lines = ["| family | dtype | side | tok/s median [range] | load s | peak RSS GiB | leading tokens = dasspec AR "
             "(same dtype), per prompt |", "|---|---|---|---|---|---|---|"]
    for family, by_dtype in results["cases"].items():
        for dtype, res in by_dtype.items():
            ar = res["tokens"]["dasspec AR"]
            for side in [*SIDES[family]["dasspec"], *SIDES[family]["hf"]]:
                rates = res["rates"][side]
                agreeing = [agree(a, b) for a, b in zip(res["tokens"][side], ar)]
                lines.append(f"| {LABEL[family]} | {dtype} | {side} | {statistics.median(rates):.2f} "
                             f"[{min(rates):.2f}, {max(rates):.2f}] | {res['load_s'][side]:.1f} | "
                             f"{res['peak_rss'][side] / 2**30:.2f} | {agreeing} |")
    return "\n".join(lines)


def report(results: dict) -> str:
    """results.md: the table, float32 against bfloat16, the top-2 gaps where upstream leaves dasspec's AR."""
    a = results["args"]
    lengths = a.get("lengths", "20,60").replace(",", "-")
    lines = [f"# Upstream HF remote code against dasspec, random weights, {a['prompts']} prompts of {lengths} random "
             f"ids x {a['tokens']} greedy tokens, batch 1, {a['threads']} threads, {a['rounds']} round(s)", "",
             "tok/s: a prompt run's new tokens over its wall time with the prefill, median [range] over prompts x "
             "rounds. load s: the worker's load (dasspec's without building auto's drafter). peak RSS: the worker's "
             "VmHWM (mapped checkpoint pages included).", "", table(results), ""]
    for family, by_dtype in results["cases"].items():
        if {"float32", "bfloat16"} <= set(by_dtype):
            for side in by_dtype["float32"]["tokens"]:
                f32, bf16 = by_dtype["float32"]["tokens"][side], by_dtype["bfloat16"]["tokens"][side]
                lines.append(f"- {family} {side}: bfloat16 agrees with float32 for "
                             f"{[agree(x, y) for x, y in zip(bf16, f32)]} leading tokens")
        for dtype, res in by_dtype.items():
            for side, gaps in res.get("gaps", {}).items():
                for i, g in enumerate(gaps):
                    if g:
                        lines.append(f"- {family} {dtype} {side}, prompt {i}: leaves dasspec AR where upstream's "
                                     f"uncached top-2 are {g[0]} and {g[1]} (gap {g[0][1] - g[1][1]:.3g})")
            if res["unstable"]:
                lines.append(f"- {family} {dtype}: tokens changed between rounds: {res['unstable']}")
    lines.append(f"\ntorch {results['torch']}, transformers {results['transformers']}, "
                 f"whole run {results['seconds'] / 60:.1f} min")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanbeige", help="a Nanbeige4.2-3B checkpoint folder (random weights)")
    p.add_argument("--iquest", help="an IQuest-Coder-V1-Loop checkpoint folder (benchmarks/iquest_real.py)")
    p.add_argument("--hf-path", default="/tmp/uhf/site:/tmp/uhf", help="PYTHONPATH holding transformers and "
                   "upstream's remote code as the packages hfmod (Nanbeige) and iqmod (IQuest)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--lengths", default="20,60", help="prompt lengths MIN,MAX in random ids (IQuest's window is 64: "
                   "a prompt past it has loop 2 read only its window)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/upstream-hf")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--family", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--report", help="only rewrite results.md beside this results.json")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.family, args.model, args.dtype, args.threads)
        return
    if args.report:
        Path(args.report).with_name("results.md").write_text(report(json.loads(Path(args.report).read_text())))
        return

    t0 = time.perf_counter()
    folders = {k: v for k, v in (("nanbeige", args.nanbeige), ("iquest", args.iquest)) if v}
    results: dict = {"args": {k: v for k, v in vars(args).items() if v is not None and k not in
                              ("worker", "family", "model", "dtype", "report")}, "prompts": {}, "cases": {}}
    for family, folder in folders.items():
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        lo, hi = map(int, args.lengths.split(","))
        prompts = prompts_for(args.prompts, min(vocab, 166000), (lo, hi))      # below Nanbeige's special ids
        results["prompts"][family] = prompts
        results["cases"][family] = {d: run_case(family, folder, d, prompts, args) for d in args.dtypes.split(",")}
    results["seconds"] = time.perf_counter() - t0
    import torch
    results["torch"] = torch.__version__
    results["transformers"] = next(r["transformers"] for c in results["cases"].values() for r in c.values())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
