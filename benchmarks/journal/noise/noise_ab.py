"""Sampled decoding with the Gumbel noise drawn once per distinct position in blocks of rows, in place (new) against
the formula drawn for every row at once (old), paired in one process: ``generate`` (B = 1) or ``generate_batch``
(B = 8) of 4 prompts of GSM8K (random ids without data) x ``--tokens`` sampled tokens (T 0.7, seed = the prompt's
index), the arms alternating; tokens checked equal; prints new / old speed per method (median [range] over pairs).

    python benchmarks/journal/noise/noise_ab.py --model /tmp/dasspec-big/nanbeige-mid \
        [--methods ar,das-wave,token-recycling,auto] [--batches 1,8] [--tokens 16] [--pairs 3] [--threads 2]

(``--model ''``: the bundled model.)"""
import argparse, statistics, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))      # benchmarks/
import dasspec
from dasspec.engine.base import sampling
from dasspec.model.noise import _GUMBEL_STREAM, _MASK32, _hash32, gumbel_noise, seed_key
from iquest_vllm import random_prompts

p = argparse.ArgumentParser()
p.add_argument("--model", default="")
p.add_argument("--methods", default="ar,das-wave,token-recycling,auto")
p.add_argument("--batches", default="1,8")
p.add_argument("--tokens", type=int, default=16)
p.add_argument("--pairs", type=int, default=3)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)


def old_noise(positions, vocab, seed):
    """The formula as it was drawn before: every row, whole tensors at once."""
    s = torch.tensor(seed_key(seed, _GUMBEL_STREAM), dtype=torch.int64, device=positions.device)
    row = _hash32((positions.to(torch.int64) ^ s) & _MASK32)
    bits = _hash32(_hash32(row[:, None] ^ torch.arange(vocab, device=positions.device)) + 0x9E3779B9 & _MASK32)
    u = (bits.to(torch.float64) + 0.5) / float(1 << 32)
    return (-torch.log(-torch.log(u))).to(torch.float32)


model = dasspec.load_model(a.model or None, dtype=torch.float32)
tok = model.tokenizer
prompts = random_prompts(4, min(166100, model.config.vocab_size))
name = (a.model or "bundled").rstrip("/").split("/")[-1]
opts = dict(max_new_tokens=a.tokens, eos=False, do_sample=True, temperature=0.7)
print(f"{name}: vocabulary {model.config.vocab_size:,}, {a.threads} threads, {a.tokens} sampled tokens", flush=True)


def run(arm, method, B):
    sampling.gumbel_noise = gumbel_noise if arm == "new" else old_noise
    if B == 1:
        return [dasspec.generate(model, q, method, seed=i, **opts).tokens for i, q in enumerate(prompts)]
    return [r.tokens for r in dasspec.generate_batch(model, prompts, method, seed=list(range(len(prompts))),
                                                     max_batch=B, **opts)]


for B in (int(b) for b in a.batches.split(",")):
    for m in a.methods.split(","):
        times = {"old": [], "new": []}
        ref = run("old", m, B)
        for i in range(a.pairs):
            for arm in (("old", "new") if i % 2 == 0 else ("new", "old")):
                t = time.perf_counter()
                got = run(arm, m, B)
                times[arm].append(time.perf_counter() - t)
                assert got == ref, (m, B, arm)
        ratios = [o / n for o, n in zip(times["old"], times["new"])]
        print(f"B={B} {m:16s} new/old speed {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
              f"  old {statistics.median(times['old']):.2f} s, new {statistics.median(times['new']):.2f} s", flush=True)
