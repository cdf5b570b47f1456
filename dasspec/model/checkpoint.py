"""Load and save looped checkpoints in the Hugging Face folder layout.

A folder holds ``config.json``, the weights as one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, and usually ``tokenizer.json`` (+ ``generation_config.json``).  ``source`` may
also be a Hugging Face repo id that resolves from the local HF cache (no network), or None for the bundled model.

Loading is all-or-nothing: the config's fields, its sizes against the tensors present (shapes come from the
safetensors headers), every tensor's name, shape and dtype, the tied copy, the tokenizer and the memory the weights
will take are checked before any weight is read, so a malformed checkpoint fails with a message naming the problem
and nothing is allocated for it.  Weights are then read tensor by tensor, in bounded chunks, straight into the
load's dtype and layout (``safetensors_io``): peak memory stays near the loaded model's size.  Only regular files
inside the folder are opened, and no code from the checkpoint ever runs (pickles and ``auto_map`` are ignored).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path, PurePosixPath

import torch
from safetensors.torch import save_file

from . import memory          # memory.available_memory: one reading of free memory, the loader's and the cache's
from .config import ConfigError, LoopedConfig
from .fields import eos_list
from .layers import rope_tables
from .looped import LoopedLM
from .safetensors_io import (FLOAT_CODES, CheckpointError, TensorEntry, checkpoint_root, confine, read_header,
                             read_into, read_rows)
from .source import BUNDLED_DIR, read_json, resolve_source  # noqa: F401  (re-exported: part of this module's API)
from .tokenizer import load_tokenizer

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint", "resolve_source", "resolve_device",
           "read_json", "weight_entries"]

# Tensors some checkpoints carry that the runtime recomputes: Huginn's RoPE table (a persistent buffer) and, from
# some exporters, HF rotary ``*.inv_freq`` buffers.  A tied head's duplicate ``lm_head.weight`` is handled apart.
_IGNORED = {"freqs_cis"}
_IGNORED_SUFFIXES = (".inv_freq",)
# A weight location: the file and the tensor's entry in its header.
Located = tuple[Path, TensorEntry]


def _ignored(name: str) -> bool:
    return name in _IGNORED or name.endswith(_IGNORED_SUFFIXES)


def _shard_path(folder: Path, shard: object, name: object, index: Path) -> Path:
    """The file an index entry names, refused unless it is a relative path inside the folder (an index is a small
    text file: it must not be able to point the loader at /dev, /proc or ../elsewhere)."""
    if not isinstance(name, str) or not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: weight_map entries must map tensor names to file names, got "
                              f"{name!r}: {shard!r}")
    parts = PurePosixPath(shard).parts
    if PurePosixPath(shard).is_absolute() or "\\" in shard or ".." in parts:
        raise CheckpointError(f"{index} lists shard {shard!r} for {name}: only files inside {folder} are read")
    return folder.joinpath(*parts)


def weight_entries(folder: Path) -> dict[str, Located]:
    """Tensor name -> (file, header entry), from the index (sharded) or the single file; headers only.  Every file
    lies inside the checkpoint after symlinks (``checkpoint_root``)."""
    root = checkpoint_root(folder)
    index = folder / "model.safetensors.index.json"
    if os.path.lexists(index):
        weight_map = read_json(index, within=root).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map object")
        files = {name: _shard_path(folder, shard, name, index) for name, shard in weight_map.items()}
        headers: dict[Path, dict[str, TensorEntry]] = {}
        located = {}
        for name, p in files.items():
            if p not in headers:
                if not os.path.lexists(p):
                    raise CheckpointError(f"missing shard {weight_map[name]} (listed in {index.name} for {name})")
                headers[p] = read_header(confine(p, root, "weight file"))
            if name not in headers[p]:
                raise CheckpointError(f"{p.name} does not contain {name} (listed in the index)")
            located[name] = (p, headers[p][name])
        return located
    single = folder / "model.safetensors"
    if not os.path.lexists(single):
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    return {name: (single, e) for name, e in read_header(confine(single, root, "weight file")).items()}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to load onto (default: CUDA when available, else CPU), refused up front when this torch build or
    machine cannot provide it - instead of an assertion deep inside the first CUDA call."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} is not available: torch {torch.__version__} "
                             + ("was built without CUDA" if torch.version.cuda is None else "sees no GPU"))
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} is not available: {torch.cuda.device_count()} GPU(s) visible")
    return dev


def load_checkpoint(source: str | os.PathLike | None = None, device: str | torch.device | None = None,
                    dtype: torch.dtype | str | None = None) -> LoopedLM:
    folder = resolve_source(source)
    device = resolve_device(device)
    dtype = _parse_dtype(dtype) if dtype is not None else (torch.bfloat16 if device.type == "cuda"
                                                          else torch.float32)
    root = checkpoint_root(folder)          # every file opened lies inside it after symlinks
    config_path = folder / "config.json"
    hf_cfg = read_json(config_path, within=root)
    located = weight_entries(folder)
    shapes = {name: e.shape for name, (_, e) in located.items()}
    try:
        cfg = LoopedConfig.from_hf(hf_cfg, shapes.keys())
    except ConfigError as err:
        raise ConfigError(f"{config_path}: {err}") from None
    family = cfg.spec
    _check_sizes(cfg, shapes, config_path, device)

    with torch.device("meta"):
        model = LoopedLM(cfg)
    params = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    slots = family.tensor_map(cfg, params)          # checkpoint name -> where it goes (a tied head is left out)
    missing = [k for k in slots if k not in shapes]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s) of the {cfg.family} layout, e.g. "
                              f"{', '.join(missing[:4])}")
    allowed_extra = {family.head} if cfg.tie_embeddings else set()
    unexpected = [k for k in shapes if k not in slots and k not in allowed_extra and not _ignored(k)]
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} tensor(s) the {cfg.family} layout does not use, "
                              f"e.g. {', '.join(unexpected[:4])}")
    for k, slot in slots.items():
        if shapes[k] != slot.shape:
            raise CheckpointError(f"shape mismatch for {k}: checkpoint {list(shapes[k])}, config implies "
                                  f"{list(slot.shape)}")
        path, entry = located[k]
        if entry.code not in FLOAT_CODES:
            raise CheckpointError(f"tensor {k} in {path} has dtype {entry.code}; a float parameter must be stored "
                                  f"as {', '.join(sorted(FLOAT_CODES))}")
    if cfg.tie_embeddings and family.head in shapes:
        _check_tied_copy(located, family.embedding, family.head)

    # Everything that can fail cheaply fails before the (possibly many GB of) weights are read.
    tokenizer = _load_tokenizer(folder, cfg)
    gen = folder / "generation_config.json"
    generation_defaults = read_json(gen, within=root) if os.path.lexists(gen) else {}
    # stop ids too (``default_stop_ids``): checked here, as config.json's are
    eos_list(generation_defaults.get("eos_token_id"), "eos_token_id of generation_config.json")
    itemsize = torch.empty((), dtype=dtype).element_size()
    weight_bytes = sum(math.prod(slot.shape) for slot in slots.values()) * itemsize
    _check_memory(weight_bytes + _rope_bytes(cfg), device,
                  f"the weights in {str(dtype).removeprefix('torch.')} and the RoPE table")

    # Each tensor goes straight from its file into its final dtype (a part of a fused weight into its rows), so no
    # second copy of the model exists at any point (the transient memory is one read chunk).
    state: dict[str, torch.Tensor] = {}
    for param in dict.fromkeys(slot.param for slot in slots.values()):
        state[param] = torch.empty(params[param], device=device, dtype=dtype)
    for name in sorted(slots, key=lambda k: (str(located[k][0]), located[k][1].begin)):
        path, entry = located[name]
        read_into(path, entry, slots[name].view(state[slots[name].param]))
    model.load_state_dict(state, strict=False, assign=True)
    del state
    if cfg.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    # Buffers built on the meta device are rebuilt for real.
    cos, sin = rope_tables(cfg, cfg.block_size)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.eval().requires_grad_(False)
    model.source = str(folder)
    model.generation_defaults = generation_defaults
    model.tokenizer = tokenizer
    return model


def _rope_bytes(cfg: LoopedConfig) -> int:
    """The cos and sin tables LoopedLM builds: block_size x head_dim/2 float32 each."""
    return 2 * cfg.block_size * (cfg.head_dim // 2) * 4


def _check_sizes(cfg: LoopedConfig, shapes: dict[str, tuple[int, ...]], config_path: Path,
                 device: torch.device) -> None:
    """Pin every size the module build allocates or loops over to the tensors present (their shapes come from the
    file headers, which were checked against the files' lengths), before anything is built: a config.json that
    claims 10^6 layers, a 10^9 width or a 10^10-position context is refused here, instead of minutes of module
    construction, an overflow inside torch or a RoPE table of terabytes.  The names checked are the family's."""
    family = cfg.spec
    wte = shapes.get(family.embedding)
    if wte is None:
        raise CheckpointError(f"checkpoint lacks {family.embedding}, the token embedding")
    if wte != (cfg.vocab_size, cfg.n_embd):
        raise CheckpointError(f"shape mismatch for {family.embedding}: checkpoint {list(wte)}, config implies "
                              f"{[cfg.vocab_size, cfg.n_embd]} (vocabulary rows x n_embd={cfg.n_embd}) in "
                              f"{config_path}")
    for group in family.layer_groups:
        found = set()
        for name in shapes:
            m = re.match(rf"{re.escape(group.prefix)}\.(\d+)\.", name)
            if m:
                found.add(int(m.group(1)))
        n = getattr(cfg, group.attr)
        if found != set(range(n)):
            short = group.prefix.rsplit(".", 1)[-1]
            held = (f"{len(found)} ({short} {min(found)}..{max(found)})" if found else "none")
            raise CheckpointError(f"{config_path}: {group.field}={n}, but the checkpoint's {group.prefix}.* "
                                  f"layers number {held}")
    suffix, per_unit = family.mlp_probe
    mlp = next((shape for name, shape in shapes.items() if name.endswith(suffix)), None)
    if mlp is not None and mlp[0] != per_unit * cfg.intermediate_size:
        raise CheckpointError(f"{config_path}: intermediate_size={cfg.intermediate_size}, but the checkpoint's MLP "
                              f"weights ({list(mlp)}) hold {mlp[0] // per_unit}")
    table = shapes.get("freqs_cis")
    if table is not None and math.prod(table) != cfg.block_size * cfg.head_dim:
        raise CheckpointError(f"{config_path}: block_size={cfg.block_size}, but the checkpoint's RoPE table "
                              f"freqs_cis {list(table)} holds {math.prod(table) // max(1, cfg.head_dim)} positions")
    _check_memory(_rope_bytes(cfg), device, f"the RoPE table of {cfg.block_size} positions (the context length: "
                                            f"block_size / max_position_embeddings in {config_path})")


def _check_memory(need: int, device: torch.device, what: str) -> None:
    """Refuse, before allocating, what cannot fit in the device's available memory (DASSPEC_IGNORE_MEMORY=1 skips
    the check, as for the depth cache)."""
    free = memory.available_memory(device)
    if free is not None and need > free and not os.environ.get("DASSPEC_IGNORE_MEMORY"):
        raise CheckpointError(f"loading needs {memory.format_bytes(need)} for {what}, but only "
                              f"{memory.format_bytes(free)} is available on "
                              f"{device}; free memory or load in a smaller dtype (set DASSPEC_IGNORE_MEMORY=1 to "
                              "try anyway)")


def _load_tokenizer(folder: Path, cfg: LoopedConfig):
    """The folder's tokenizer (None without tokenizer.json), its files checked first, and refused when it can
    produce ids the embedding does not have."""
    if not os.path.lexists(folder / "tokenizer.json"):
        return None
    tokenizer = load_tokenizer(folder)        # which checks its files (regular, JSON objects) by name
    ids = tokenizer.backend.get_vocab(with_added_tokens=True).values()
    top = max(ids, default=-1)
    if top >= cfg.vocab_size:
        raise CheckpointError(f"{folder / 'tokenizer.json'} has token ids up to {top}, but the model's embedding "
                              f"({cfg.spec.embedding}) has {cfg.vocab_size} rows: the tokenizer belongs to "
                              "another model")
    return tokenizer


def _check_tied_copy(located: dict[str, Located], wte: str, head: str) -> None:
    """A tied checkpoint may also store its head (Huginn stores lm_head.weight); it must be the embedding's copy, or
    the config's tying is wrong and tying would silently replace a trained head.  A few rows are compared (cheap)."""
    (wte_path, wte_entry), (head_path, head_entry) = located[wte], located[head]
    if head_entry.shape != wte_entry.shape:
        raise CheckpointError(f"config.json ties the head to the embedding, but {head} {list(head_entry.shape)} has "
                              f"another shape than {wte} {list(wte_entry.shape)}; is tie_embeddings (or "
                              "tie_word_embeddings) wrong?")
    V = wte_entry.shape[0]
    rows = sorted({0, 1, V // 2, V - 2, V - 1} & set(range(V)))
    a = read_rows(wte_path, wte_entry, rows).float()
    b = read_rows(head_path, head_entry, rows).float()
    if not torch.equal(a, b):
        raise CheckpointError(f"config.json ties the head to the embedding (tie_embeddings / tie_word_embeddings), "
                              f"but the checkpoint's {head} differs from {wte}; set it to false to use the stored "
                              "head")


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(table)}")
    return table[dtype]


def save_checkpoint(model: LoopedLM, folder: str | os.PathLike, shard_bytes: int | None = None,
                    extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json and safetensors (sharded with an index when the weights exceed ``shard_bytes``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    params = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    slots = cfg.spec.tensor_map(cfg, {k: tuple(v.shape) for k, v in params.items()})
    # under the checkpoint's names; a part of a fused weight is cloned (safetensors refuses shared storage)
    state = {name: params[s.param] if s.start is None else s.view(params[s.param]).clone()
             for name, s in slots.items()}
    state.update(extra_tensors or {})
    (folder / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    for stale in list(folder.glob("model*.safetensors")) + [folder / "model.safetensors.index.json"]:
        if stale.exists():
            stale.unlink()
    total = sum(t.numel() * t.element_size() for t in state.values())
    if shard_bytes is None or total <= shard_bytes:
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in state.items():
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nb
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return folder
