"""dasspec against llama.cpp on the same Nanbeige4.2 weights (issue 53, "Peers"): a mid-size random Nanbeige (width
512, 8 layers x 2 loops, the real 166,144-id vocabulary: ``benchmarks/nanbeige_files.py --preset mid``, then
``python -m dasspec.testing build-real --scale full``), converted to GGUF by llama.cpp's own converter
(``convert_hf_to_gguf.py --outtype f32`` and ``q8_0``).

* llama.cpp: the ``llama-cpp-python`` package (a CPU build from the registry's source distribution, which vendors a
  llama.cpp with the ``nanbeige`` architecture), in a worker process run with ``--llama-path`` on its PYTHONPATH,
  greedy (``top_k=1``) on the same token ids, one prompt at a time (batch 1: its high-level API has no batching);
  and at batch 8 through its low-level API (``llama_decode`` over one ``llama_batch`` holding every sequence, a
  sequence id each, a unified K/V cache: the prompts in one call, then a token per sequence a call, greedy by argmax
  of each sequence's logits), as ``llama-batched-bench`` decodes.
* upstream's HF remote code (``--hf-path``: transformers and ``modeling_nanbeige.py`` as the package ``hfmod``,
  outside the repository), float32, eager attention, greedy through its own cache, batch 1.
* dasspec: ``generate(..., "ar")`` and the default method (``auto``) at batch 1, ``generate_batch(...,
  max_batch=8)`` with AR and ``auto`` at batch 8, float32, in this process.

Sides alternate per round (llama.cpp f32, llama.cpp q8_0, dasspec ...), so drift of a shared machine hits all alike;
tok/s is new tokens over wall time with the prefill, the fastest round reported, ratios per round (median [range]).
Tokens: llama.cpp's float32 greedy against dasspec's AR (how many leading tokens agree, per prompt).

    python benchmarks/nanbeige_peers.py --model /tmp/dasspec-big/nanbeige-mid \\
        --gguf /tmp/dasspec-big/gguf/nanbeige-mid-f32.gguf --gguf-q8 /tmp/dasspec-big/gguf/nanbeige-mid-q8_0.gguf \\
        --llama-path /work/ref/llamapy --out benchmarks/records/performance/nanbeige-peers

A benchmark, not a test: it asserts nothing about speed.
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

PROMPTS = ("Question: A farmer has 12 cows and buys 7 more. How many cows does he have now?\nAnswer:",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The looped transformer reads the same layers twice, so",
           "Write a short poem about the sea.",
           "Translate to French: The weather is nice today.",
           "List three prime numbers greater than 100:",
           "Once upon a time in a small village,",
           "import numpy as np\nx = np.arange(10)\n")


def worker(gguf: str, threads: int) -> None:
    """llama.cpp side: read {"ids": [...], "n": N} per line, answer {"tokens": [...], "seconds": s}."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False, seed=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        llm.reset()
        t = time.perf_counter()
        out = []
        for tok in llm.generate(req["ids"], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) >= req["n"]:
                break
        print(json.dumps({"tokens": out, "seconds": time.perf_counter() - t}), flush=True)


def batch_worker(gguf: str, threads: int) -> None:
    """llama.cpp at batch B: read {"batch": [[ids], ...], "n": N} per line, answer {"tokens": [[...], ...],
    "seconds": s} - every sequence in one ``llama_batch`` (its own sequence id and positions), greedy."""
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    V = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 2048, 2048, 8
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = True
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(2048, 0, 1)
    print(json.dumps({"ready": True}), flush=True)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:     # (token, position, sequence, logits wanted)
        batch.n_tokens = len(items)
        for i, (t, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, pos, 1, want
            batch.seq_id[i][0] = seq
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def greedy(i: int) -> int:
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(V,)).argmax())

    for line in sys.stdin:
        req = json.loads(line)
        seqs, n = req["batch"], req["n"]
        if len(seqs) > 8 or sum(map(len, seqs)) > 2048 or sum(map(len, seqs)) + len(seqs) * n > 4096:
            raise SystemExit("batch_worker: at most 8 sequences, 2,048 prompt tokens and a 4,096-token cache")
        t = time.perf_counter()
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        items = [(tok, p, s, p == len(ids) - 1) for s, ids in enumerate(seqs) for p, tok in enumerate(ids)]
        decode(items)
        last = [i for i, it in enumerate(items) if it[3]]
        out = [[greedy(i)] for i in last]
        for step in range(1, n):
            decode([(o[-1], len(ids) + step - 1, s, True) for s, (ids, o) in enumerate(zip(seqs, out))])
            for s, o in enumerate(out):
                o.append(greedy(s))
        print(json.dumps({"tokens": out, "seconds": time.perf_counter() - t}), flush=True)


def hf_worker(folder: str, threads: int) -> None:
    """Upstream's HF remote code side (``modeling_nanbeige.py`` importable as ``hfmod``; transformers on the path),
    float32, eager attention, greedy through its own DynamicCache: ``upstream_hf.hf_load`` / ``hf_decode``."""
    import torch
    from upstream_hf import hf_decode, hf_load

    torch.set_num_threads(threads)
    model = hf_load("nanbeige", folder, "float32")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t = time.perf_counter()
        out = hf_decode(model, req["ids"], req["n"], cached=True)
        print(json.dumps({"tokens": out, "seconds": time.perf_counter() - t}), flush=True)


class Peer:
    def __init__(self, target: str, path: str, threads: int, kind: str = "llama"):
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", target, "--kind", kind, "--threads",
                                      str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        assert json.loads(self.proc.stdout.readline())["ready"]

    def run(self, ids: list[int], n: int) -> dict:
        return self._ask({"ids": ids, "n": n})

    def run_batch(self, seqs: list[list[int]], n: int) -> dict:
        return self._ask({"batch": seqs, "n": n})

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--gguf")
    p.add_argument("--gguf-q8")
    p.add_argument("--llama-path", default="/work/ref/llamapy")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts (at most 8)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/nanbeige-peers")
    p.add_argument("--hf-path", default=None, help="PYTHONPATH holding transformers and upstream's "
                   "modeling_nanbeige.py as the package hfmod (adds upstream's HF remote code as a side)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kind", default="llama", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        {"hf": hf_worker, "batch": batch_worker}.get(args.kind, worker)(args.worker, args.threads)
        return

    import torch
    import dasspec

    torch.set_num_threads(args.threads)
    model = dasspec.load_model(args.model, device="cpu", dtype=torch.float32)
    tok = model.tokenizer
    prompts = [tok.encode(t) for t in PROMPTS[: args.prompts]]
    n = args.tokens
    peers = {"llama.cpp f32": Peer(args.gguf, args.llama_path, args.threads)} if args.gguf else {}
    batched = {f"llama.cpp f32 B={len(prompts)}": Peer(args.gguf, args.llama_path, args.threads, kind="batch")
               } if args.gguf else {}
    if args.gguf_q8:
        peers["llama.cpp q8_0"] = Peer(args.gguf_q8, args.llama_path, args.threads)
    if args.hf_path:
        peers["upstream HF code f32"] = Peer(args.model, args.hf_path, args.threads, kind="hf")
    auto = dasspec.build_drafter(model, "auto")                  # calibrated once, kept across requests
    opts = dict(max_new_tokens=n, eos=False)

    def dasspec_b1(method):
        t = time.perf_counter()
        outs = [dasspec.generate(model, ids, method, drafter=auto if method == "auto" else None, **opts).tokens
                for ids in prompts]
        return outs, time.perf_counter() - t

    def dasspec_b8(method):
        t = time.perf_counter()
        outs = dasspec.generate_batch(model, prompts, method, max_batch=8,
                                      drafter=auto if method == "auto" else None, **opts)
        return [o.tokens for o in outs], time.perf_counter() - t

    sides = {name: (lambda peer=peer: _peer_all(peer, prompts, n)) for name, peer in peers.items()}
    sides.update({name: (lambda peer=peer: _peer_batch(peer, prompts, n)) for name, peer in batched.items()})
    sides.update({"dasspec AR B=1": lambda: dasspec_b1("ar"), "dasspec auto B=1": lambda: dasspec_b1("auto"),
                  "dasspec AR B=8": lambda: dasspec_b8("ar"), "dasspec auto B=8": lambda: dasspec_b8("auto")})
    rates: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            outs, seconds = sides[name]()
            rates[name].append(len(prompts) * n / seconds)
            tokens[name] = outs
            print(f"round {r} {name}: {rates[name][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    for peer in [*peers.values(), *batched.values()]:
        peer.close()
    ar = tokens["dasspec AR B=1"]
    res = {"model": args.model, "prompts": len(prompts), "prompt_tokens": [len(x) for x in prompts], "tokens": n,
           "threads": args.threads, "rounds": args.rounds, "rates": rates,
           "agree_with_dasspec_ar": {k: [agree(a, b) for a, b in zip(v, ar)] for k, v in tokens.items()},
           "torch": torch.__version__}
    ref = "llama.cpp f32" if "llama.cpp f32" in rates else "dasspec AR B=1"
    base = rates[ref]
    c = model.config
    lines = [f"# Nanbeige (width {c.n_embd}, {c.n_heads} / {c.n_kv_heads} heads of {c.head_dim}, {c.n_core} layers x "
             f"{c.mean_recurrence} loops, vocab {c.vocab_size:,}), random weights, float32 dasspec, "
             f"{args.threads} threads, {len(prompts)} prompts x {n} greedy tokens, {args.rounds} rounds", "",
             f"| side | tok/s (fastest round) | x {ref} per round: median [range] | leading tokens equal to "
             "dasspec AR, per prompt |", "|---|---|---|---|"]
    for k, v in rates.items():
        per = [a / b for a, b in zip(v, base)]
        lines.append(f"| {k} | {max(v):.1f} | {statistics.median(per):.2f} [{min(per):.2f}, {max(per):.2f}] | "
                     f"{res['agree_with_dasspec_ar'][k]} |")
    if f"llama.cpp f32 B={len(prompts)}" in rates:        # the batch against llama.cpp's own batch of as many
        b8 = rates[f"llama.cpp f32 B={len(prompts)}"]
        lines += ["", f"| side | x llama.cpp f32 B={len(prompts)} per round: median [range] |", "|---|---|"]
        for k in ("dasspec AR B=8", "dasspec auto B=8"):
            per = [a / b for a, b in zip(rates[k], b8)]
            lines.append(f"| {k} | {statistics.median(per):.2f} [{min(per):.2f}, {max(per):.2f}] |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _peer_batch(peer: Peer, prompts: list[list[int]], n: int):
    t = time.perf_counter()
    outs = peer.run_batch(prompts, n)["tokens"]
    return outs, time.perf_counter() - t


def _peer_all(peer: Peer, prompts: list[list[int]], n: int):
    t = time.perf_counter()
    outs = [peer.run(ids, n)["tokens"] for ids in prompts]
    return outs, time.perf_counter() - t


if __name__ == "__main__":
    main()
