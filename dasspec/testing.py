"""Random checkpoints for tests, examples and benchmarks (no downloads needed): small ones of every family, and
checkpoints of a real configuration (``build_real_checkpoint``, ``python -m dasspec.testing build-real``) built
from a repository's config.json, shard index (when it has one) and tokenizer, at full size or scaled down."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import zlib
from pathlib import Path

import torch

from .engine.api.engine import Engine
from .engine.drafting.context import DraftContext
from .engine.drafting.draft import Draft, Drafter, Session
from .model.checkpoint import _parse_dtype, read_json
from .model.config import LoopedConfig
from .model.layers import rope_tables
from .model.looped import LoopedLM
from .model.safetensors_io import write_streamed
from .train.objective import init_weights


def tiny_config(family: str = "huginn", **overrides) -> LoopedConfig:
    """A few-layer config of ``family`` with the family's quirks switched on (GQA + llama3 scaling for
    raven-llama, q/k norm for raven-olmo, qk_bias + embed scale + tied head for huginn)."""
    base = dict(family=family, vocab_size=97, n_embd=32, n_heads=4, n_kv_heads=4, head_dim=8,
                intermediate_size=48, n_prelude=1, n_core=2, n_coda=1, mean_recurrence=8, block_size=256,
                eos_token_id=[1], bos_token_id=0)
    if family == "huginn":
        base.update(qk_bias=True, tie_embeddings=True, embed_scale=math.sqrt(32), init_std=math.sqrt(2 / (5 * 32)),
                    rope_theta=50000.0, norm_eps=1e-6)
    elif family == "raven-llama":
        base.update(n_kv_heads=2, n_prelude=2, n_core=3, n_coda=2, rope_theta=500000.0, norm_eps=1e-5,
                    init_std=0.0087,
                    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "raven-olmo":
        base.update(qk_norm=True, rope_theta=500000.0, norm_eps=1e-6, init_std=0.0087)
    elif family == "ouro":          # the whole stack loops; no prelude, coda or initial state
        base.update(n_kv_heads=2, n_prelude=0, n_core=3, n_coda=0, mean_recurrence=4, rope_theta=1e6)
    elif family == "iquest-loop":   # two loops; loop 2 mixes K1/V1 with its own K/V in a window of 8 positions
        base.update(n_kv_heads=2, n_prelude=0, n_core=3, n_coda=0, mean_recurrence=2, rope_theta=5e5,
                    norm_eps=1e-5, loop_window=8)
    elif family == "nanbeige":      # Ouro's loop over Llama layers; q / o not square (4 x 16 heads over 32 wide)
        base.update(n_kv_heads=2, head_dim=16, n_prelude=0, n_core=3, n_coda=0, mean_recurrence=2, rope_theta=7e7,
                    norm_eps=1e-5)
    base.update(overrides)
    return LoopedConfig(**base).validate()


def random_model(family: str = "huginn", seed: int = 0, **overrides) -> LoopedLM:
    """A randomly initialised model; norm weights and biases are perturbed so no parameter is trivially 1/0."""
    torch.manual_seed(seed)
    model = LoopedLM(tiny_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "qk_bias" in name:
                p.normal_(0, 0.1)
            elif "wte" in name or "lm_head" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 1.0 / math.sqrt(p.shape[-1]))
    return model.eval().requires_grad_(False)


# --- checkpoints of a real configuration, random weights ----------------------------------------------------------

# The scaled-down widths: every key, shard and tokenizer id of the real layout stays, only the widths shrink (the
# vocabulary stays, so the tokenizer's special ids keep their meaning).  Keyed by Huginn's field names; a config
# that spells a width the HF way gets it under that name.
SMALL_WIDTHS = dict(n_embd=64, n_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=160)
_HF_NAMES = {"n_embd": "hidden_size", "n_heads": "num_attention_heads"}
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
           "chat_template.jinja")


def real_config(src: str | os.PathLike, scale: str = "small") -> dict:
    """The source folder's config.json, at full size or with ``SMALL_WIDTHS`` (and the init values the takase init
    derives from the width: embed scale sqrt(d), std sqrt(2/(5d)), out_proj std / sqrt(2 * effective depth))."""
    if scale not in ("small", "full"):
        raise ValueError(f"scale must be 'small' or 'full', got {scale!r}")
    cfg = read_json(Path(src) / "config.json")
    if scale == "small":
        cfg.update({key if key in cfg else _HF_NAMES.get(key, key): v for key, v in SMALL_WIDTHS.items()})
    if scale == "small" and "init_values" in cfg:
        d = cfg["n_embd"]
        std = math.sqrt(2 / (5 * d))
        depth = cfg.get("effective_expected_depth") or (
            cfg["n_layers_in_prelude"] + cfg["n_layers_in_coda"]
            + cfg["n_layers_in_recurrent_block"] * cfg["mean_recurrence"])
        cfg["init_values"] = dict(cfg.get("init_values") or {}, embed_scale=math.sqrt(d), std=std, embedding=std,
                                  out_proj=std / math.sqrt(2 * depth))
    return cfg


def real_tensor_specs(cfg: dict, weight_map: dict[str, str] | None = None) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor the index lists (without an index: every tensor the family's checkpoints hold), for
    ``cfg``: the family's checkpoint tensors, a tied head's duplicate and Huginn's ``freqs_cis`` RoPE table
    [1, block_size, 1, head_dim/2, 2]."""
    lcfg = LoopedConfig.from_hf(cfg, weight_map.keys() if weight_map is not None else None)
    slots = _slots(lcfg)
    if weight_map is None:
        return {name: slot.shape for name, slot in slots.items()}
    specs = {}
    for name in weight_map:
        if name in slots:
            specs[name] = slots[name].shape
        elif name == lcfg.spec.head and lcfg.tie_embeddings:
            specs[name] = slots[lcfg.spec.embedding].shape
        elif name == "freqs_cis":
            specs[name] = (1, lcfg.block_size, 1, lcfg.head_dim // 2, 2)
        else:
            raise ValueError(f"the index lists {name}, which the {lcfg.family} layout does not have")
    return specs


def _slots(lcfg: LoopedConfig) -> dict:
    """The family's checkpoint tensors of a model of ``lcfg`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = LoopedLM(lcfg)
    return lcfg.spec.tensor_map(lcfg, {k: tuple(v.shape) for k, v in model.state_dict().items()})


def _normal_tensor(name: str, shape: tuple[int, ...], std: float, seed: int,
                   chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """One tensor of Hugging Face's default init (``initializer_range``): norm weights 1, biases 0, every other
    weight normal(0, std), drawn in row chunks from the tensor's own seed (float32)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    out = torch.empty(shape)
    flat = out.reshape(shape[0], -1)
    step = max(1, chunk_bytes // max(1, flat.shape[1] * 4))
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    for a in range(0, flat.shape[0], step):
        part = flat[a: a + step]
        part.normal_(0.0, std, generator=g)
    return out


def _takase_tensor(model: LoopedLM, name: str, seed: int, chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """One parameter drawn by ``dasspec.train.objective.init_weights`` (the takase init) without materialising the
    others: ``model`` lives on the meta device, where init_weights' draws on every other parameter cost nothing.
    The parameter is drawn in row chunks of about ``chunk_bytes`` (the init's temporaries are several times the
    tensor drawn; its values are i.i.d., so a chunk is drawn like the whole).  Each tensor has its own seed, so a
    tensor drawn twice (a tied head's duplicate) is the same tensor."""
    module_name, leaf = name.rsplit(".", 1)
    module = model.get_submodule(module_name)
    meta = getattr(module, leaf)
    out = torch.empty(meta.shape)
    rows = out.shape[0] if out.dim() else 1
    step = max(1, chunk_bytes // max(1, out[0].numel() * 4 if out.dim() else 4))
    flat = out.reshape(rows, -1) if out.dim() else out.reshape(1, 1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            for a in range(0, rows, step):
                part = torch.nn.Parameter(torch.empty((min(rows, a + step) - a, *meta.shape[1:])),
                                          requires_grad=False)
                setattr(module, leaf, part)
                init_weights(model)
                flat[a: a + part.shape[0]] = part.data.reshape(part.shape[0], -1)
    finally:
        setattr(module, leaf, meta)
    return out


def build_real_checkpoint(src: str | os.PathLike, out: str | os.PathLike, scale: str = "small",
                          seed: int = 0) -> Path:
    """A checkpoint of the real configuration in ``src`` (config.json, the tokenizer files and, when the repository
    has one, model.safetensors.index.json - the real repository without its weights) with random weights: the same
    keys, shard files and index format (without an index: one model.safetensors, as transformers saves a model
    that fits one shard), in the config's ``torch_dtype``, the tokenizer copied.  Weights follow the init the config
    describes: the takase init of its ``init_values`` (Huginn) or normal(0, ``initializer_range``) (Ouro).  ``scale``
    "full" keeps every width (Huginn-0125: 15.6 GB of float32; Ouro-1.4B: 2.9 GB of bfloat16), written one tensor
    at a time, so building needs about one tensor's memory; "small" shrinks the widths (``SMALL_WIDTHS``) for tests."""
    src, out = Path(src), Path(out)
    has_index = (src / "model.safetensors.index.json").is_file()
    cfg = real_config(src, scale)
    if has_index:
        weight_map = read_json(src / "model.safetensors.index.json")["weight_map"]
        specs = real_tensor_specs(cfg, weight_map)
    else:
        specs = real_tensor_specs(cfg)
        weight_map = dict.fromkeys(specs, "model.safetensors")
    lcfg = LoopedConfig.from_hf(cfg, weight_map.keys())
    dtype = _parse_dtype(cfg.get("torch_dtype") or "float32")
    slots = _slots(lcfg)

    if "init_values" in cfg:
        with torch.device("meta"):
            model = LoopedLM(lcfg)
        tied_source = "transformer.wte.weight" if lcfg.tie_embeddings else "lm_head.weight"

        def draw(name: str) -> torch.Tensor:
            return _takase_tensor(model, tied_source if name == "lm_head.weight" else slots[name].param, seed)
    else:
        std = float(cfg.get("initializer_range", 0.02))

        def draw(name: str) -> torch.Tensor:
            return _normal_tensor(name, specs[name], std, seed)

    def produce(name: str) -> torch.Tensor:
        if name == "freqs_cis":
            cos, sin = rope_tables(lcfg, lcfg.block_size)
            return torch.stack((cos, sin), dim=-1)[None, :, None].to(dtype)
        return draw(name).to(dtype)

    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for shard in sorted(set(weight_map.values())):
        names = [n for n in weight_map if weight_map[n] == shard]
        total += write_streamed(out / shard, [(n, specs[n], dtype) for n in names], produce)
    if has_index:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m dasspec.testing build-real --from DIR --out DIR [--scale small|full] [--seed N]``"""
    p = argparse.ArgumentParser(prog="python -m dasspec.testing", description="random checkpoints for tests and "
                                "benchmarks")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-real", help="a checkpoint of a real configuration (the repository's config.json, "
                       "index and tokenizer, without weights) with random weights of the init its config describes")
    b.add_argument("--from", dest="src", required=True, help="folder with config.json, the tokenizer files and "
                   "(when the repository has one) model.safetensors.index.json")
    b.add_argument("--out", required=True, help="folder to write the checkpoint to")
    b.add_argument("--scale", choices=("small", "full"), default="small")
    b.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    folder = build_real_checkpoint(args.src, args.out, args.scale, args.seed)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()


# --- driving one request through the engine, a block at a time (tests) -------------------------------------------

class Stepper:
    """One request in an engine of its own, driven block by block with hand-made drafts - how tests exercise the
    verifier and the decode loop on the path production takes (``Engine.step``).

        s = Stepper(model, prompt, max_new_tokens=8)
        s.prefill()                          # the first token is committed
        verdict = s.step(Draft(tokens, layout=TreeLayout(parents)))   # one engine step with this draft
        s.generated, s.done, s.stats, s.req.cache   # the committed tokens, the executor's request
    """

    def __init__(self, model: LoopedLM, prompt: list[int], max_new_tokens: int, *, init_scale: float = 1.0,
                 state_seed: int = 0, width: int = 16, stop_ids=(), num_steps: int | None = None, **add):
        queue: list = []
        verdicts: list = []

        class Scripted(Session):
            def propose(self):
                return queue.pop(0) if queue else Draft()

            def observe(self, verdict):
                verdicts.append(verdict)

        class ScriptedDrafter(Drafter):
            name = "scripted"
            session = Scripted

        drafter = ScriptedDrafter()
        drafter.width = width
        self._queue, self._verdicts = queue, verdicts
        self.engine = Engine(model, num_steps=num_steps, drafter=drafter, max_batch=1)
        self.rid = self.engine.add(prompt, max_new_tokens=max_new_tokens, init_scale=init_scale,
                                   state_seed=state_seed, stop=list(stop_ids), eos=False, **add)
        self.entry = self.engine._table[self.rid]

    @property
    def req(self):
        """The executor's state of the request (token buffer, paged cache)."""
        return self.engine.executor.requests.get(self.rid)

    @property
    def ctx(self):
        return DraftContext(self.req)

    @property
    def generated(self) -> list[int]:
        return self.entry.generated

    @property
    def done(self) -> bool:
        return self.entry.status == "finished"

    @property
    def stats(self):
        """Its statistics so far (the output processor's; a finished request's are its result's)."""
        out = self.engine.output
        return out.results[self.rid].stats if self.rid in out.results else out.stats(self.rid)

    @property
    def n(self) -> int:
        return self.req.n

    def prefill(self) -> None:
        with torch.inference_mode():
            while not self.generated and not self.done:
                self.engine.step()

    def step(self, draft=None):
        """One engine step whose draft is ``draft`` (None: an AR step); the verdict the session observed."""
        if draft is not None:
            self._queue.append(draft)
        before = len(self._verdicts)
        with torch.inference_mode():
            self.engine.step()
        return self._verdicts[-1] if len(self._verdicts) > before else None

    def back(self, width: int) -> None:
        """Back the rows a draft of ``width`` inputs past the anchor needs (what the scheduler does before a step),
        for tests that call a drafter's model passes directly."""
        e, pool = self.entry, self.engine.pool
        need = pool.blocks_for(self.n + 1 + width) - len(e.blocks)
        if need > 0:
            got = pool.allocate(need, after=e.blocks[-1])
            e.blocks += got
            with torch.inference_mode():
                self.req.cache.table.append(got)

    def rows(self) -> list[torch.Tensor]:
        """The verified rows [0, n) of every cache tensor (core K/V at every depth, prelude, coda)."""
        return self.req.cache.save()
