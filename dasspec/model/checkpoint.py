"""Load and save looped checkpoints in the Hugging Face folder layout.

A folder holds ``config.json``, the weights as one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, and usually ``tokenizer.json`` (+ ``generation_config.json``).  ``source`` may
also be a Hugging Face repo id that resolves from the local HF cache (no network), or None for the bundled model.

Loading is all-or-nothing: names and shapes of every tensor are checked against the layout before any weight is
read, so a malformed checkpoint fails with a message naming the problem and nothing is half-loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigError, LoopedConfig
from .looped import LoopedLM

BUNDLED_DIR = Path(__file__).parents[1] / "assets" / "dasspec-tiny"

# Tensors some checkpoints carry that the runtime recomputes: Huginn's RoPE table (a persistent buffer) and, from
# some exporters, HF rotary ``*.inv_freq`` buffers.  A tied head's duplicate ``lm_head.weight`` is handled apart.
_IGNORED = {"freqs_cis"}
_IGNORED_SUFFIXES = (".inv_freq",)


def _ignored(name: str) -> bool:
    return name in _IGNORED or name.endswith(_IGNORED_SUFFIXES)


class CheckpointError(ValueError):
    """The checkpoint folder is missing files, or its tensors do not match its config."""


def resolve_source(source: str | os.PathLike | None) -> Path:
    """Folder path for ``source``: None -> bundled model; a directory; or an HF repo id in the local HF cache."""
    if source is None:
        if not (BUNDLED_DIR / "config.json").exists():
            raise CheckpointError(f"the bundled model is missing from {BUNDLED_DIR}; run `dasspec train --out DIR` "
                                  "or reinstall the package")
        return BUNDLED_DIR
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    text = str(source)
    if path.exists():
        raise CheckpointError(f"{text} is a file; pass the checkpoint folder (config.json + safetensors)")
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        cached = _hf_cache_snapshot(text)
        if cached is not None:
            return cached
        raise CheckpointError(f"{text!r} is neither a local folder nor in the local Hugging Face cache "
                              f"({_hf_cache_root()}); download it on a connected machine "
                              "(huggingface-cli download) and copy the folder here")
    raise CheckpointError(f"checkpoint folder {text!r} does not exist")


def _hf_cache_root() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def _hf_cache_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    repo_dir = _hf_cache_root() / ("models--" + repo_id.replace("/", "--"))
    if not repo_dir.is_dir():
        return None
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.exists() else revision
    snap = repo_dir / "snapshots" / commit
    if snap.is_dir():
        return snap
    snaps = sorted((repo_dir / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing {path.name} in {path.parent}") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index (sharded) or the single file."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        files = {}
        for name, shard in weight_map.items():
            p = folder / shard
            if not p.exists():
                raise CheckpointError(f"missing shard {shard} (listed in {index.name} for {name})")
            files[name] = p
        return files
    single = folder / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, p in files.items():
        by_file.setdefault(p, []).append(name)
    for p, names in by_file.items():
        try:
            with safe_open(p, "pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{p.name} does not contain {name} (listed in the index)")
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except CheckpointError:
            raise
        except Exception as err:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"cannot read {p}: {err}") from None
    return shapes


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
    hf_cfg = read_json(folder / "config.json")
    files = weight_files(folder)
    shapes = _shapes(files)
    try:
        cfg = LoopedConfig.from_hf(hf_cfg, shapes.keys())
    except ConfigError as err:
        raise ConfigError(f"{folder / 'config.json'}: {err}") from None

    with torch.device("meta"):
        model = LoopedLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s) of the {cfg.family} layout, e.g. "
                              f"{', '.join(missing[:4])}")
    allowed_extra = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unexpected = [k for k in shapes if k not in expected and k not in allowed_extra and not _ignored(k)]
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} tensor(s) the {cfg.family} layout does not use, "
                              f"e.g. {', '.join(unexpected[:4])}")
    for k, shape in expected.items():
        if shapes[k] != shape:
            raise CheckpointError(f"shape mismatch for {k}: checkpoint {list(shapes[k])}, config implies "
                                  f"{list(shape)}")
    if cfg.tie_embeddings and "lm_head.weight" in shapes:
        _check_tied_copy(files, shapes)

    # Everything that can fail cheaply fails before the (possibly many GB of) weights are read.
    tokenizer = None
    if (folder / "tokenizer.json").exists():
        from .tokenizer import load_tokenizer
        tokenizer = load_tokenizer(folder)
    gen = folder / "generation_config.json"
    generation_defaults = read_json(gen) if gen.exists() else {}

    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for p, names in by_file.items():
        with safe_open(p, "pt", device="cpu") as f:
            for name in names:
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    # Buffers built on the meta device are rebuilt for real.
    from .layers import rope_tables
    cos, sin = rope_tables(cfg, cfg.block_size)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.eval().requires_grad_(False)
    if device.type == "cpu":
        model.cpu_weight_layout()
    model.source = str(folder)
    model.generation_defaults = generation_defaults
    model.tokenizer = tokenizer
    return model


def _check_tied_copy(files: dict[str, Path], shapes: dict[str, tuple[int, ...]]) -> None:
    """A tied checkpoint may also store lm_head.weight (Huginn does); it must be the embedding's copy, or the config's
    tie_embeddings is wrong and tying would silently replace a trained head.  A few rows are compared (cheap)."""
    wte, head = "transformer.wte.weight", "lm_head.weight"
    if shapes[head] != shapes[wte]:
        raise CheckpointError(f"config.json ties the head to the embedding, but {head} {list(shapes[head])} has "
                              f"another shape than {wte} {list(shapes[wte])}; is tie_embeddings wrong?")
    V = shapes[wte][0]
    rows = sorted({0, 1, V // 2, V - 2, V - 1} & set(range(V)))
    picked = []
    for name in (wte, head):
        with safe_open(files[name], "pt") as f:
            sl = f.get_slice(name)
            picked.append(torch.stack([sl[r: r + 1][0] for r in rows]))
    if not torch.equal(picked[0], picked[1]):
        raise CheckpointError(f"config.json ties the head to the embedding (tie_embeddings), but the checkpoint's "
                              f"{head} differs from {wte}; set tie_embeddings to false to use the stored head")


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
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
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
