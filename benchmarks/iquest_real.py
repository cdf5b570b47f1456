"""IQuest-Coder-V1-40B-Loop at its published shape: the layout checked at full depth, loaded and decoded at a
reduced depth (the full model is ~80 GB in bfloat16; this machine has 24 GiB).

The published config (IQuestLab/IQuest-Coder-V1-40B-Loop-Instruct: hidden 5120, FFN 27648, 80 layers x loop_num 2,
40 query / 8 key-value heads of 128, vocabulary 76800, loop_window_size 64, untied head) is written out here, since
the repository's files are not on this machine; rope_theta and rms_norm_eps are the remote config class's defaults.

1. Layout at full depth (no weights): the tensor names and shapes ``load_model`` expects for the 80-layer config
   (the count must be the published checkpoint's 883: 80 x (9 Llama tensors + 2 gate tensors) + embedding, norm,
   head), the bfloat16 weight bytes, and the depth cache's bytes per token - what the pool allocates (both loops at
   every row) and what loop 2's window lets it keep (loop 1 every row, loop 2 the last 64).
2. A random checkpoint of the same widths at ``--layers`` layers (bfloat16, one shard per layer, written one tensor
   at a time so memory stays bounded), loaded as a user would, and decoded: AR and a speculative method, their
   tokens compared, load time, peak memory, tokens/s.

    python benchmarks/iquest_real.py --out /tmp/dasspec-big/iquest-40b-loop-2l --layers 2 --tokens 8 \
        [--results runs/iquest-real]

``--out`` is the checkpoint's folder; ``--results DIR`` also writes what is printed (``results.md``) and the numbers
(``results.json``) there.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

PUBLISHED = {
    "architectures": ["IQuestLoopCoderForCausalLM"], "model_type": "iquestloopcoder",
    "auto_map": {"AutoConfig": "configuration_iquestloopcoder.IQuestLoopCoderConfig",
                 "AutoModelForCausalLM": "modeling_iquestloopcoder.IQuestLoopCoderForCausalLM"},
    "vocab_size": 76800, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 80,
    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
    "loop_num": 2, "loop_window_size": 64, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
PUBLISHED_TENSORS = 883          # the released checkpoint's count (its GGUF conversion's summary)
CONTEXTS = (1024, 8192, 32768, 131072)


def layout(cfg: dict) -> dict:
    """Names, shapes and bytes the loader expects for ``cfg``, built on the meta device; the cache's bytes."""
    import torch
    from dasspec.model.cache import bytes_per_token
    from dasspec.model.config import LoopedConfig
    from dasspec.model.looped import LoopedLM

    lcfg = LoopedConfig.from_hf(cfg)
    with torch.device("meta"):
        model = LoopedLM(lcfg)
    params = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    slots = lcfg.spec.tensor_map(lcfg, params)
    weights = sum(math.prod(s.shape) for s in slots.values())
    per_row_loop = bytes_per_token(lcfg, 1, torch.bfloat16)         # one loop's K+V of every layer
    allocated = {n: n * per_row_loop * lcfg.mean_recurrence for n in CONTEXTS}
    windowed = {n: n * per_row_loop + min(n, lcfg.loop_window) * per_row_loop * (lcfg.mean_recurrence - 1)
                for n in CONTEXTS}
    return dict(tensors=len(slots), names=sorted(slots), shapes={k: list(s.shape) for k, s in slots.items()},
                params=weights, bf16_bytes=2 * weights, kv_bytes_per_row=per_row_loop * lcfg.mean_recurrence,
                cache_allocated=allocated, cache_windowed=windowed)


def build(out: Path, layers: int, seed: int = 0) -> Path:
    """A random bfloat16 checkpoint of the published widths at ``layers`` layers: one shard per layer plus the
    embedding's and the head's, each tensor drawn and written alone (peak memory ~ one layer, ~1 GB)."""
    import torch
    from safetensors.torch import save_file

    cfg = dict(PUBLISHED, num_hidden_layers=layers)
    out.mkdir(parents=True, exist_ok=True)
    lay = layout(cfg)
    g = torch.Generator().manual_seed(seed)
    groups: dict[str, list[str]] = {"embed": [], "head": []}
    for name in lay["names"]:
        if name.startswith("model.layers.") or name.startswith("model.gate_projections."):
            groups.setdefault(f"layer{int(name.split('.')[2]):03d}", []).append(name)
        else:
            groups["embed" if "embed" in name else "head"].append(name)
    weight_map = {}
    for i, (group, names) in enumerate(sorted(groups.items())):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = lay["shapes"][name]
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                t = 0.5 + torch.rand(shape, generator=g)
            elif name.startswith("model.gate_projections.") and name.endswith(".bias"):
                t = 0.5 * torch.randn(shape, generator=g)
            else:
                t = torch.randn(shape, generator=g) / math.sqrt(shape[-1] if "embed" not in name else 1)
            tensors[name] = t.to(torch.bfloat16)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        del tensors
    total = sum(2 * math.prod(s) for s in lay["shapes"].values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def child(folder: str, tokens: int, method: str) -> dict:
    """In a fresh process: load (bfloat16) and decode AR and ``method``; seconds, peak RSS, tokens/s, tokens."""
    import torch
    import dasspec
    from dasspec.model.memory import _proc_bytes

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    model = dasspec.load_model(folder, device="cpu", dtype=torch.bfloat16)
    load_s = time.perf_counter() - t0
    prompt = list(range(100, 180))                  # 80 positions: past loop 2's window of 64
    out = {"load_s": load_s}
    for m in ("ar", method):
        t0 = time.perf_counter()
        r = dasspec.generate(model, prompt, m, max_new_tokens=tokens, eos=False)
        out[m] = dict(tokens=r.tokens, s=time.perf_counter() - t0)
    out["peak_rss"] = _proc_bytes("/proc/self/status", "VmHWM")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/dasspec-big/iquest-40b-loop-2l")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--method", default="self-spec")
    ap.add_argument("--results", help="a folder for results.md and results.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.out, args.tokens, args.method)))
        return
    lines: list[str] = []

    def say(text: str) -> None:                    # printed, and kept for --results
        lines.append(text)
        print(text, flush=True)

    full = layout(PUBLISHED)
    say(f"full depth (80 layers x 2 loops): {full['tensors']} tensors (published: {PUBLISHED_TENSORS}), "
        f"{full['params'] / 1e9:.2f} B parameters, {full['bf16_bytes'] / 2**30:.1f} GiB in bfloat16")
    assert full["tensors"] == PUBLISHED_TENSORS, full["tensors"]
    gate = full["shapes"]["model.gate_projections.0.weight"]
    say(f"gate projection per layer: weight {gate} + bias {full['shapes']['model.gate_projections.0.bias']}")
    say(f"depth cache, bfloat16: {full['kv_bytes_per_row'] / 1024:.0f} KiB per position (both loops)")
    say("context | pool allocates (both loops, every row) | loop 2 kept to its window | saved")
    for n in CONTEXTS:
        a, w = full["cache_allocated"][n], full["cache_windowed"][n]
        say(f"{n:>7} | {a / 2**30:8.2f} GiB | {w / 2**30:8.2f} GiB | {1 - w / a:.1%}")
    folder = Path(args.out)
    t0 = time.perf_counter()
    if not (folder / "config.json").exists():
        build(folder, args.layers)
    say(f"built {args.layers}-layer checkpoint in {time.perf_counter() - t0:.0f} s: {folder}")
    res = subprocess.run([sys.executable, __file__, "--child", "--out", str(folder), "--tokens", str(args.tokens),
                          "--method", args.method], capture_output=True, text=True, check=True)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    say(f"load (bfloat16): {r['load_s']:.1f} s, peak RSS {r['peak_rss'] / 2**30:.2f} GiB")
    for m in ("ar", args.method):
        say(f"{m}: {args.tokens / r[m]['s']:.2f} tok/s ({r[m]['s']:.1f} s for {args.tokens}), tokens {r[m]['tokens']}")
    say(f"{args.method} tokens == AR tokens: {r[args.method]['tokens'] == r['ar']['tokens']} (bfloat16: need not "
        f"hold; float32 is where lossless is asserted)")
    if args.results:
        dst = Path(args.results)
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "results.md").write_text(f"# IQuest-Coder-V1-40B-Loop at its published shape, {args.layers} layers\n\n"
                                        "```\n" + "\n".join(lines) + "\n```\n")
        summary = {k: full[k] for k in ("tensors", "params", "bf16_bytes", "kv_bytes_per_row")}
        summary["cache"] = {n: {"allocated": full["cache_allocated"][n], "windowed": full["cache_windowed"][n]}
                            for n in CONTEXTS}
        (dst / "results.json").write_text(json.dumps({"layers": args.layers, "tokens": args.tokens,
                                                      "method": args.method, "full_depth": summary, "run": r},
                                                     indent=1))


if __name__ == "__main__":
    main()
