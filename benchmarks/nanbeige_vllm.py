"""dasspec (AR and its default method, ``auto``) against vLLM's CPU build on the mid-size random Nanbeige4.2 (issue 53,
"Peers"): tokens and tok/s at batch 1 and 8, side by side in one run.

    python benchmarks/nanbeige_vllm.py --model /tmp/dasspec-big/nanbeige-mid \\
        --vllm-model /tmp/dasspec-big/nanbeige-mid-vllm --vllm-python /work/ref/vllmpy/bin/python \\
        --out runs/nanbeige-vllm

The checkpoint (``--model``): width 512, 8 layers x 2 loops, 8 query / 2 key-value heads of 128, FFN 1536, the real
166,144-id vocabulary, random weights, float32 (``benchmarks/nanbeige_files.py --preset mid``, then ``python -m
dasspec.testing build-real --scale full``; see ``nanbeige_peers.py``).  Prompts: ``--prompts`` random token-id
prompts of 40-120 ids below the special tokens, each decoded greedily for ``--max-new-tokens`` with EOS ignored.

vLLM (a benchmark only, never a dependency) has no native Nanbeige, so its worker (under ``--vllm-python``) runs the
**Transformers backend** (``LLM(..., model_impl="transformers", trust_remote_code=True)``) on upstream's HF remote
code.  That code is not in this repository and must not be: ``--vllm-model`` is a copy of the checkpoint folder
outside the repository - the weights and tokenizer symlinked to ``--model``'s (dasspec reads no symlink that leaves
its folder, hence two folders), ``modeling_nanbeige.py`` and ``configuration_nanbeige.py`` from the HF repository
Nanbeige/Nanbeige4.2-3B (or the community-patched ``patch/`` copies of johnhalloran321/Nanbeige4.2-3B-mps-fix @
a8de726, which fix the zero ``inv_freq``), and ``auto_map`` in its config.json (the one nanbeige_files.py writes).

As shipped, vLLM 0.32 refuses that code ("The Transformers implementation of 'NanbeigeForCausalLM' is not compatible
with vLLM": its attention does not dispatch through transformers' ``ALL_ATTENTION_FUNCTIONS``), with or without any
option.  ``--vllm-shim`` (applied in the worker, at run time; neither vLLM's nor upstream's files are edited):

* ``none``: as shipped; the refusal is recorded and the run goes on with dasspec alone.
* ``shared``: the remote code's attention replaced by one that computes q / k / v and RoPE with the module's own
  weights and upstream's ``apply_rotary_pos_emb``, then calls the attention interface (so vLLM takes it); vLLM
  gives each attention module ONE paged K/V cache, which both loops then write: loop 2 overwrites loop 1's K/V at
  the same positions, so the first token (from the prefill) is right and later ones read the wrong K/V.
* ``per-loop`` (default): ``shared`` plus one more vLLM ``Attention`` (its own K/V cache) per layer for each loop
  >= 2, used by that loop: one K/V per (loop, layer), as upstream's cache keeps them.

dasspec: ``generate_batch(model, prompts, method, max_batch=B, eos=False)``, float32, in this process.  vLLM:
``LLM.generate``, float32, greedy, ``ignore_eos``, every prompt alone for B = 1, all with ``max_num_seqs`` = B
otherwise; --threads torch threads on both sides (results.json: vllm_threads, read in the worker after start-up).
Rounds alternate the sides (drift of a shared machine hits both); tok/s = new tokens / wall time, prefill included,
the fastest round reported; ratios per round, median and range.  Tokens are compared with dasspec AR at B = 1.
Writes results.json and results.md to --out (the worker's log: vllm.log); asserts nothing about speed.  The
measuring code is iquest_vllm.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from iquest_vllm import REPO, VLLM, add_arguments, compare, random_prompts, serve, start_worker, vllm_job

SPECIAL = 166100                                          # ids from <|im_start|> up are special tokens
OFF = ("qk_layernorm", "loop_share_kv", "enable_depth_attention", "enable_double_loop_split", "enable_mhc",
       "enable_hyper_connection", "emb_neighbor_num", "attention_bias")   # options the shim's attention lacks

SHIM: dict = {}


class _LoopView:
    """What the attention interface reads for loop t >= 2: that loop's vLLM Attention under the usual name."""

    def __init__(self, name: str, attn):
        setattr(self, name, attn)


def _attention_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                       output_attentions=False, use_cache=False, cache_position=None, **kwargs):
    """NanbeigeAttention.forward for vLLM: upstream's q / k / v, RoPE and o_proj, attention through the interface
    (vLLM finds the module by this call); loop t >= 2 hands it that loop's own Attention under ``per-loop``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    bsz, q_len, _ = hidden_states.shape
    q = self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
    k = self.k_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
    v = self.v_proj(hidden_states).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
    cos, sin = self.rotary_emb(v, position_ids)
    q, k = SHIM["rope"](q, k, cos, sin)
    loop = kwargs.get("loop_idx", 0)
    owner = self if loop == 0 or not SHIM["per_loop"] else getattr(self, f"vllm_loop{loop}")
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    out, _ = attention_interface(owner, q, k, v, attention_mask)
    return self.o_proj(out.reshape(bsz, q_len, -1)), None, past_key_value


def install_shim(folder: str, per_loop: bool) -> None:
    """Patch upstream's classes (loaded from ``folder`` as vLLM will load them: same module, cached) and, for
    ``per_loop``, vLLM's Transformers backend so that it makes one more Attention per layer and extra loop."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    cfg = json.loads((Path(folder) / "config.json").read_text())
    on = [k for k in OFF if cfg.get(k)] + (["pretraining_tp"] if cfg.get("pretraining_tp", 1) != 1 else [])
    if on:
        raise ValueError(f"the shim's attention does not implement {on}")
    cls = get_class_from_dynamic_module("modeling_nanbeige.NanbeigeForCausalLM", folder)
    mod = sys.modules[cls.__module__]
    mod.NanbeigePreTrainedModel._supports_attention_backend = True
    mod.NANBEIGE_ATTENTION_CLASSES["vllm"] = mod.NanbeigeAttention
    mod.NanbeigeAttention.forward = _attention_forward
    SHIM.update(rope=mod.apply_rotary_pos_emb, per_loop=per_loop)
    if not per_loop:
        return
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.transformers import base

    create = base.Base._create_attention_instances

    def create_per_loop(self, prefix: str = ""):
        create(self, prefix)
        loops = self.model._get_num_loops()
        for module in list(self.model.modules()):
            first = getattr(module, base.VLLM_ATTN_ATTR, None)
            if not isinstance(first, Attention):
                continue
            for t in range(1, loops):
                extra = Attention(num_heads=first.num_heads, head_size=first.head_size, scale=first.impl.scale,
                                  num_kv_heads=first.num_kv_heads, cache_config=self.cache_config,
                                  quant_config=self.quant_config, prefix=f"{first.layer_name}.loop{t}")
                module.add_module(f"vllm_attn_loop{t}", extra)
                object.__setattr__(module, f"vllm_loop{t}", _LoopView(base.VLLM_ATTN_ATTR, extra))

    base.Base._create_attention_instances = create_per_loop


def vllm_worker() -> None:
    """The Nanbeige worker: vLLM's Transformers backend on the remote code of job["model"], under job["shim"]."""
    job = start_worker()
    from vllm import LLM

    def make():
        if job["shim"] != "none":
            install_shim(job["model"], per_loop=job["shim"] == "per-loop")
        return LLM(model=job["model"], model_impl="transformers", trust_remote_code=True, dtype="float32",
                   max_model_len=job["max_model_len"], max_num_seqs=job["max_batch"], seed=0,
                   skip_tokenizer_init=True, enable_prefix_caching=job["prefix_caching"])

    serve(job, make)


def _same_checkpoint(model: Path, copy: Path) -> str | None:
    """Why --vllm-model is not --model's checkpoint with remote code added, or None."""
    if not (copy / "modeling_nanbeige.py").exists() or not (copy / "configuration_nanbeige.py").exists():
        return f"{copy} lacks modeling_nanbeige.py / configuration_nanbeige.py (upstream's remote code)"
    a, b = (json.loads((f / "config.json").read_text()) for f in (model, copy))
    if "auto_map" not in b:
        return f"{copy}/config.json has no auto_map"
    if {k: v for k, v in a.items() if k != "auto_map"} != {k: v for k, v in b.items() if k != "auto_map"}:
        return f"{copy}/config.json differs from {model}'s"
    files = {p.name for p in model.glob("*.safetensors")}
    if not files or any(not (copy / f).exists() or (copy / f).resolve() != (model / f).resolve()
                        and (copy / f).stat().st_size != (model / f).stat().st_size for f in files):
        return f"{copy} does not hold {model}'s weight files"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/dasspec-big/nanbeige-mid", help="the checkpoint, as dasspec reads it")
    p.add_argument("--vllm-model", default="/tmp/dasspec-big/nanbeige-mid-vllm",
                   help="its copy with upstream's remote code (outside the repository), for vLLM")
    p.add_argument("--vllm-shim", choices=("none", "shared", "per-loop"), default="per-loop")
    add_arguments(p)
    a = p.parse_args(argv)

    import torch
    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(REPO))
    import dasspec

    folder, copy = Path(a.model), Path(a.vllm_model)
    if not (folder / "config.json").exists():
        p.error(f"{folder} has no config.json (build it: see the docstring)")
    if a.vllm_python and (why := _same_checkpoint(folder, copy)):
        p.error(why)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    model = dasspec.load_model(folder, dtype=torch.float32)
    prompts = random_prompts(a.prompts, SPECIAL)
    vllm = None
    if a.vllm_python:
        vllm = VLLM(a.vllm_python, vllm_job(copy, prompts, a, shim=a.vllm_shim), Path(a.out) / "vllm.log",
                    script=__file__)
    c = model.config
    title = (f"Nanbeige (width {c.n_embd}, {c.n_heads} / {c.n_kv_heads} heads of {c.head_dim}, {c.n_core} layers x "
             f"{c.mean_recurrence} loops, vocabulary {c.vocab_size:,}), random weights, float32")
    notes = [f"vLLM: Transformers backend on upstream's remote code, shim `{a.vllm_shim}` (docstring)."] if vllm else []
    return compare(model, prompts, a, vllm, title, {"model": str(folder), "vllm_model": str(copy),
                                                    "vllm_shim": a.vllm_shim if vllm else None}, notes)


if __name__ == "__main__":
    if sys.argv[1:] == ["--vllm-worker"]:
        vllm_worker()
    else:
        sys.exit(main())
