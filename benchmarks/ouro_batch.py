"""Batched AR throughput of dasspec on an Ouro checkpoint, and optionally of vLLM's CPU build on the same prompts
(issue 34, "Batched throughput against vLLM").

    python benchmarks/ouro_batch.py --model /tmp/ouro-mid --out runs/ouro-batch
    python benchmarks/ouro_batch.py --model /tmp/ouro-mid --out runs/ouro-batch \\
        --vllm-python /tmp/vllm-venv/bin/python --vllm-ouro /tmp/vllm026/x/vllm/model_executor/models/ouro.py

dasspec: ``dasspec.generate_batch(model, prompts, "ar", max_new_tokens=N, max_batch=B, eos=False)``, float32, in
this process.  vLLM (a benchmark only - never a dependency of dasspec): a worker process run by ``--vllm-python``
(a separate venv with vLLM's CPU build) loads the Ouro model file vLLM shipped until 0.26 (``--vllm-ouro``, the path
of that file, out of tree: registered with ``ModelRegistry.register_model``) and runs ``LLM.generate`` greedily
with ``ignore_eos`` on the same token ids - every prompt alone for B = 1, all of them with ``max_num_seqs`` = B
otherwise.  Both sides are timed round by round, alternating (dasspec B, vLLM B, next B, ...; the vLLM worker
stays up between its turns and idles while dasspec runs), so drift of a shared machine hits both alike.  Tokens/s
is new tokens over wall time, prefill included; the fastest round per (side, B) is reported, and ratios are
taken per round and given as the median with their range.  vLLM's tokens are checked against dasspec's, and
dasspec's at every B against its own B = 1.

Prompts: the first ``--prompts`` GSM8K test questions (no few-shot prefix), encoded by the checkpoint's tokenizer.
Writes results.json and results.md to --out.  A benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# --- the vLLM worker (runs under --vllm-python: stdlib and vLLM only, never dasspec) --------------------------------

def vllm_worker() -> None:
    """Read a job (one JSON line) on stdin, load the model, answer "ready", then for each line "B" run the prompts
    at that batch size and answer one JSON line {seconds, tokens}.  vLLM's own logs go to stderr."""
    job = json.loads(sys.stdin.readline())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")    # one process: the out-of-tree class is seen
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # keep torch's thread count (set below)
    import importlib.util

    import torch
    torch.set_num_threads(job["threads"])
    from transformers import AutoConfig, Qwen2Config
    from vllm import LLM, ModelRegistry, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models.utils import AutoWeightsLoader

    class OuroConfig(Qwen2Config):          # transformers has no "ouro" config; Ouro's is Qwen2's plus total_ut_steps
        model_type = "ouro"

    AutoConfig.register("ouro", OuroConfig)
    name = "vllm.model_executor.models.ouro"    # its relative imports resolve inside vLLM's models package
    spec = importlib.util.spec_from_file_location(name, job["ouro_py"])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)

    class OuroForCausalLM(mod.OuroForCausalLM):
        def load_weights(self, weights):    # 0.32's AutoWeightsLoader has no skip_prefixes (the head is untied)
            return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)

    ModelRegistry.register_model("OuroForCausalLM", OuroForCausalLM)
    llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"], max_num_seqs=job["max_batch"],
              seed=0, skip_tokenizer_init=True, enable_prefix_caching=job.get("prefix_caching", False))
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:2], sp, use_tqdm=False)                    # warm-up
    print("@@", json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        B = int(line)
        t = time.perf_counter()
        if B == 1:
            outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        else:                                                       # one call: the scheduler keeps B running
            outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        print("@@", json.dumps({"seconds": dt, "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


class VLLM:
    """The worker process, one model load for the whole run."""

    def __init__(self, python: str, job: dict, log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([python, __file__, "--vllm-worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd="/tmp")
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        self.info = self._read()

    def _read(self) -> dict:
        while True:                              # answers are the lines marked "@@" (vLLM may print others)
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the vLLM worker stopped (log: {self.log.name})")
            if line.startswith("@@ "):
                return json.loads(line[3:])

    def run(self, B: int) -> dict:
        self.proc.stdin.write(f"{B}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


# --- the benchmark -------------------------------------------------------------------------------------------------

def load_prompts(data: Path, n: int) -> list[str]:
    with open(data / "gsm8k" / "test.jsonl") as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an Ouro checkpoint folder (float32 weights)")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=os.environ.get("DASSPEC_DATA") or str(REPO.parent / "shared" / "data"))
    p.add_argument("--code", default=str(REPO), help="the dasspec tree to import (default: this one; another "
                   "commit's worktree for a before/after run)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build")
    p.add_argument("--vllm-ouro", default=None, help="vLLM 0.26's vllm/model_executor/models/ouro.py")
    p.add_argument("--vllm-prefix-caching", action="store_true",
                   help="leave vLLM's prefix cache on (its default; runs before 2026-12-06 had it): the rounds repeat "
                        "the same prompts, whose K/V dasspec's generate_batch calls never keep")
    a = p.parse_args(argv)
    if a.vllm_python and not a.vllm_ouro:
        p.error("--vllm-python needs --vllm-ouro (the Ouro model file of vLLM <= 0.26)")

    import torch
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(Path(a.code).resolve()))
    import dasspec

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = dasspec.load_model(a.model, dtype=torch.float32)
    prompts = [model.tokenizer.encode(q) for q in load_prompts(Path(a.data), a.prompts)]
    batches = [int(b) for b in a.batches.split(",")]
    sides = ["dasspec"]
    vllm = None
    if a.vllm_python:
        job = dict(model=str(Path(a.model).resolve()), ouro_py=str(Path(a.vllm_ouro).resolve()), threads=a.threads,
                   max_model_len=max(map(len, prompts)) + a.max_new_tokens + 16, max_batch=max(batches),
                   max_new_tokens=a.max_new_tokens, prompts=prompts, prefix_caching=a.vllm_prefix_caching)
        vllm = VLLM(a.vllm_python, job, out / "vllm.log")
        sides.append("vllm")

    def run_dasspec(B: int) -> dict:
        t = time.perf_counter()
        outs = dasspec.generate_batch(model, prompts, "ar", max_new_tokens=a.max_new_tokens, max_batch=B, eos=False)
        return {"seconds": time.perf_counter() - t, "tokens": [o.tokens for o in outs]}

    run_dasspec(min(batches))                                          # warm-up (and the packed weights)
    records = []
    try:
        for rnd in range(a.rounds):
            order = batches if rnd % 2 == 0 else batches[::-1]
            for B in order:
                for side in (sides if rnd % 2 == 0 else sides[::-1]):
                    r = run_dasspec(B) if side == "dasspec" else vllm.run(B)
                    r.update(side=side, B=B, round=rnd, new_tokens=sum(map(len, r["tokens"])))
                    r["tokens_per_second"] = r["new_tokens"] / r["seconds"]
                    records.append(r)
                    print(f"round {rnd} {side:8s} B={B:<3d} {r['tokens_per_second']:7.1f} tok/s", flush=True)
    finally:
        if vllm is not None:
            vllm.close()

    ref = next(r["tokens"] for r in records if r["side"] == "dasspec" and r["B"] == min(batches))
    same = {f"{r['side']} B={r['B']} round {r['round']}": r["tokens"] == ref for r in records}
    best = {(s, B): max(r["tokens_per_second"] for r in records if r["side"] == s and r["B"] == B)
            for s in sides for B in batches}

    def ratio(num, den) -> dict:
        vals = []
        for rnd in range(a.rounds):
            x = {(r["side"], r["B"]): r["tokens_per_second"] for r in records if r["round"] == rnd}
            vals.append(x[num] / x[den])
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    summary = {"model": a.model, "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
               "max_new_tokens": a.max_new_tokens, "threads": a.threads, "rounds": a.rounds,
               "torch": torch.__version__, "dasspec": str(Path(dasspec.__file__).parent),
               "vllm_threads": vllm.info.get("threads") if vllm else None,
               "best_tokens_per_second": {f"{s} B={B}": v for (s, B), v in best.items()},
               "dasspec_x_B1": {f"B={B}": ratio(("dasspec", B), ("dasspec", min(batches))) for B in batches},
               "same_tokens_as_dasspec_B1": same, "dasspec_B1_tokens": ref}
    if vllm:
        summary["dasspec_over_vllm"] = {f"B={B}": ratio(("dasspec", B), ("vllm", B)) for B in batches}
    (out / "results.json").write_text(json.dumps({"summary": summary, "runs": [
        {k: v for k, v in r.items() if k != "tokens"} for r in records]}, indent=2) + "\n")

    lines = [f"# Batched AR on {a.model}", "",
             f"{len(prompts)} GSM8K prompts ({summary['prompt_tokens']} prompt tokens), {a.max_new_tokens} greedy "
             f"tokens each, float32, {a.threads} threads, {a.rounds} rounds alternating; tok/s = fastest round.", "",
             "| B | dasspec tok/s | " + ("vLLM tok/s | dasspec / vLLM (median [range]) | " if vllm else "")
             + "dasspec x its B=1 |", "|---|---|" + ("---|---|" if vllm else "") + "---|"]
    for B in batches:
        row = f"| {B} | {best[('dasspec', B)]:.1f} | "
        if vllm:
            r = summary["dasspec_over_vllm"][f"B={B}"]
            row += f"{best[('vllm', B)]:.1f} | {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}] | "
        r = summary["dasspec_x_B1"][f"B={B}"]
        lines.append(row + f"{r['median']:.2f} |")
    lines += ["", f"Tokens equal to dasspec's at B = {min(batches)}: "
              + ("all runs" if all(same.values()) else ", ".join(k for k, v in same.items() if not v) + " DIFFER")]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--vllm-worker"]:
        vllm_worker()
    else:
        sys.exit(main())
