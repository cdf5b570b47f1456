"""dasspec (AR and its default method, ``auto``) against vLLM's CPU build on a mid-size random IQuest-Coder-V1-Loop
(issue 53, "Peers"): tokens and tok/s at batch 1 and 8, side by side in one run.

    python benchmarks/iquest_vllm.py --model /tmp/iquest-mid --out runs/iquest-vllm \\
        --vllm-python /work/venv-vllm/bin/python

The checkpoint (built once when ``--model`` has no config.json): the published layout at width 512 - 8 layers x
loop_num 2, 8 query / 2 key-value heads of 64, FFN 1408, loop_window_size 64, the real vocabulary size (76,800),
random weights (std 1/sqrt(fan-in)), float32.  Prompts: ``--prompts`` random token-id prompts of 40-120 ids (the
repository's tokenizer is not on this machine), each decoded greedily for ``--max-new-tokens`` with EOS ignored, so
prompt + output run past the 64-row window.

dasspec: ``generate_batch(model, prompts, method, max_batch=B, eos=False)``, float32, in this process.  vLLM (a
benchmark only, never a dependency): a worker under ``--vllm-python`` runs its native ``IQuestLoopCoderForCausalLM``
(``LLM.generate``, greedy, ``ignore_eos``; every prompt alone for B = 1, all with ``max_num_seqs`` = B otherwise);
transformers has no ``iquestloopcoder`` config, so the worker registers Llama's config under that name with the
two loop fields.  Rounds alternate the sides (drift of a shared machine hits both); tok/s = new tokens / wall
time, prefill included, the fastest round reported; ratios per round, median and range.  Tokens are compared
with dasspec AR at B = 1.  Writes results.json and results.md to --out; asserts nothing about speed.
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
MID = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
           intermediate_size=1408, vocab_size=76800, loop_num=2, loop_window_size=64)


def start_worker() -> dict:
    """A vLLM worker's first steps (any model): read its job line, keep vLLM in this process and on the job's
    torch thread count."""
    job = json.loads(sys.stdin.readline())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")      # vLLM's log to vllm.log, not the pipe
    import torch
    torch.set_num_threads(job["threads"])
    return job


def serve(job: dict, make_llm) -> None:
    """A vLLM worker's loop (any model): ``make_llm()`` builds the LLM (an exception is answered "@@ {error}" and
    ends the worker); then a warm-up, "@@ {ready}", and per line "B" one "@@ {seconds, tokens}" (greedy,
    ``ignore_eos``; every prompt alone for B = 1, all at once otherwise)."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    try:
        llm = make_llm()
    except Exception as e:                                           # recorded, not raised: "vLLM refused"
        import traceback
        traceback.print_exc()
        print("@@", json.dumps({"error": f"{type(e).__name__}: {e}".strip()}), flush=True)
        return
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:2], sp, use_tqdm=False)                    # warm-up
    print("@@", json.dumps({"ready": True, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        B = int(line)
        t = time.perf_counter()
        outs = ([llm.generate([p], sp, use_tqdm=False)[0] for p in prompts] if B == 1
                else llm.generate(prompts, sp, use_tqdm=False))
        print("@@", json.dumps({"seconds": time.perf_counter() - t,
                                "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


def vllm_worker() -> None:
    """The IQuest worker: vLLM's native IQuestLoopCoderForCausalLM, with Llama's config registered under
    ``iquestloopcoder``."""
    job = start_worker()
    from transformers import AutoConfig, LlamaConfig
    from vllm import LLM

    class IQuestLoopCoderConfig(LlamaConfig):
        model_type = "iquestloopcoder"

        def __init__(self, loop_num=2, loop_window_size=64, **kw):
            self.loop_num, self.loop_window_size = loop_num, loop_window_size
            super().__init__(**kw)

    AutoConfig.register("iquestloopcoder", IQuestLoopCoderConfig)
    serve(job, lambda: LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"],
                           max_num_seqs=job["max_batch"], seed=0, skip_tokenizer_init=True,
                           enable_prefix_caching=job["prefix_caching"]))


class VLLM:
    """A worker process under ``python`` running ``script --vllm-worker`` (this file's worker by default);
    ``info`` is its first answer: {"ready": ...} or {"error": why vLLM refused}."""

    def __init__(self, python: str, job: dict, log: Path, script: str = __file__):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([python, script, "--vllm-worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, cwd="/tmp")
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        self.info = self._read()
        self.error = self.info.get("error")

    def _read(self) -> dict:
        while True:
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


def build(folder: Path) -> None:
    import torch
    sys.path.insert(0, str(REPO / "tests"))
    from iquest_reference import write_iquest_checkpoint
    shape = {k: MID[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "intermediate_size")}
    write_iquest_checkpoint(folder, vocab_size=MID["vocab_size"], seed=0, n_shards=2, loop_num=MID["loop_num"],
                            window=MID["loop_window_size"], shape=shape,
                            config_edits={"max_position_embeddings": 4096, "torch_dtype": "float32"})
    del torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options every dasspec-against-vLLM comparison takes (its own add --model and the like)."""
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--methods", default="ar,auto")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--vllm-prefix-caching", action="store_true",
                   help="leave vLLM's prefix cache on (its default): every round repeats the same prompts, so from the "
                        "warm-up on it may reuse their K/V, which dasspec's generate_batch calls never keep")


def random_prompts(n: int, high: int, seed: int = 7) -> list[list[int]]:
    """``n`` prompts of 40-120 random ids in [3, high)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (int(k),), generator=g).tolist() for k in torch.randint(40, 121, (n,), generator=g)]


def vllm_job(folder: Path, prompts: list[list[int]], a: argparse.Namespace, **extra) -> dict:
    """The job line a worker reads (``extra``: what the model's worker needs besides)."""
    batches = [int(b) for b in a.batches.split(",")]
    return dict(model=str(folder.resolve()), threads=a.threads, max_model_len=max(map(len, prompts))
                + a.max_new_tokens + 16, max_batch=max(batches), max_new_tokens=a.max_new_tokens, prompts=prompts,
                prefix_caching=a.vllm_prefix_caching, **extra)


def compare(model, prompts: list[list[int]], a: argparse.Namespace, vllm: "VLLM | None", title: str,
            head: dict, notes: list[str] = ()) -> int:
    """dasspec's ``generate_batch`` (each method of --methods, each B of --batches) against the vLLM worker
    (``None``: dasspec alone), rounds alternating the sides; writes results.json and results.md to --out and returns
    0 when every run emitted dasspec AR's tokens at the smallest B, else 1. ``head`` opens the summary; a worker
    that refused (``vllm.error``) is recorded and left out."""
    import torch
    import dasspec
    from dasspec.engine.api.prefix_cache import common_prefix

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in a.batches.split(",")]
    methods = a.methods.split(",")
    sides = [f"dasspec-{m}" for m in methods]
    vllm_error = None
    if vllm is not None and vllm.error:
        vllm_error = vllm.error
        print(f"vLLM refused: {vllm_error}", flush=True)
        vllm.close()
        vllm = None
    if vllm is not None:
        sides.append("vllm")

    def run_dasspec(method: str, B: int) -> dict:
        t = time.perf_counter()
        outs = dasspec.generate_batch(model, prompts, method, max_new_tokens=a.max_new_tokens, max_batch=B, eos=False)
        return {"seconds": time.perf_counter() - t, "tokens": [o.tokens for o in outs]}

    for m in methods:
        run_dasspec(m, min(batches))                                    # warm-up
    records = []
    try:
        for rnd in range(a.rounds):
            for B in (batches if rnd % 2 == 0 else batches[::-1]):
                for side in (sides if rnd % 2 == 0 else sides[::-1]):
                    r = vllm.run(B) if side == "vllm" else run_dasspec(side.removeprefix("dasspec-"), B)
                    r.update(side=side, B=B, round=rnd, new_tokens=sum(map(len, r["tokens"])))
                    r["tokens_per_second"] = r["new_tokens"] / r["seconds"]
                    records.append(r)
                    print(f"round {rnd} {side:14s} B={B:<3d} {r['tokens_per_second']:7.1f} tok/s", flush=True)
    finally:
        if vllm is not None:
            vllm.close()

    ref = next(r["tokens"] for r in records if r["side"] == "dasspec-ar" and r["B"] == min(batches))
    same = {f"{r['side']} B={r['B']} round {r['round']}": r["tokens"] == ref for r in records}
    lead = {f"{r['side']} B={r['B']} round {r['round']}": [common_prefix([x, y]) for x, y in zip(r["tokens"], ref)]
            for r in records}
    best = {(s, B): max(r["tokens_per_second"] for r in records if r["side"] == s and r["B"] == B)
            for s in sides for B in batches}

    def ratio(num, den) -> dict:
        vals = []
        for rnd in range(a.rounds):
            x = {(r["side"], r["B"]): r["tokens_per_second"] for r in records if r["round"] == rnd}
            vals.append(x[num] / x[den])
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    summary = {**head, "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
               "max_new_tokens": a.max_new_tokens, "threads": a.threads, "rounds": a.rounds,
               "torch": torch.__version__, "best_tokens_per_second": {f"{s} B={B}": v for (s, B), v in best.items()},
               "same_tokens_as_dasspec_ar_B1": same, "leading_tokens_equal_per_prompt": lead}
    if vllm:
        summary["vllm_threads"] = vllm.info.get("threads")
        summary["over_vllm"] = {f"{s} B={B}": ratio((s, B), ("vllm", B)) for s in sides if s != "vllm"
                                for B in batches}
    if vllm_error:
        summary["vllm_error"] = vllm_error
    (out / "results.json").write_text(json.dumps({"summary": summary, "runs": [
        {k: v for k, v in r.items() if k != "tokens"} for r in records]}, indent=2) + "\n")
    lines = [f"# {title}", "",
             f"{len(prompts)} random prompts ({summary['prompt_tokens']} tokens), {a.max_new_tokens} greedy tokens "
             f"each, {a.threads} threads, {a.rounds} rounds alternating; tok/s = fastest round.", "",
             "| side | " + " | ".join(f"B = {B} tok/s" for B in batches)
             + (" | " + " | ".join(f"/ vLLM B = {B} (median [range])" for B in batches) if vllm else "") + " |",
             "|---|" + "---|" * (len(batches) * (2 if vllm else 1))]
    for s in sides:
        row = f"| {s} | " + " | ".join(f"{best[(s, B)]:.1f}" for B in batches)
        if vllm:
            cells = []
            for B in batches:
                r = summary["over_vllm"].get(f"{s} B={B}")
                cells.append(f"{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]" if r else "-")
            row += " | " + " | ".join(cells)
        lines.append(row + " |")
    lines += ["", "Tokens equal to dasspec AR's at B = 1: "
              + ("all runs" if all(same.values()) else "; ".join(f"{k} DIFFER (leading tokens equal, per prompt: "
                                                                 f"{lead[k]})" for k, v in same.items() if not v))]
    if vllm_error:
        lines += ["", f"vLLM refused the model: `{' '.join(vllm_error.split())}`"]
    lines += [n for note in notes for n in ("", note)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(same.values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/iquest-mid")
    add_arguments(p)
    a = p.parse_args(argv)

    import torch
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(REPO))
    import dasspec

    folder = Path(a.model)
    if not (folder / "config.json").exists():
        build(folder)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    model = dasspec.load_model(folder, dtype=torch.float32)
    prompts = random_prompts(a.prompts, MID["vocab_size"])
    vllm = VLLM(a.vllm_python, vllm_job(folder, prompts, a), Path(a.out) / "vllm.log") if a.vllm_python else None
    return compare(model, prompts, a, vllm, "IQuest-Loop (width 512, 8 layers x 2 loops, window 64, vocabulary "
                   "76,800), float32", {"model": str(folder), "shape": MID})


if __name__ == "__main__":
    if sys.argv[1:] == ["--vllm-worker"]:
        vllm_worker()
    else:
        sys.exit(main())
