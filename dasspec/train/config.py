"""The settings of a training run: ``TrainConfig`` (one flat dataclass, every field overridable by ``--set``) and
the named ``PRESETS``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..host import check_threads

if TYPE_CHECKING:                       # imported where used: the dasspec.model package loads torch
    from ..model.config import LoopedConfig


@dataclass
class TrainConfig:
    preset: str = "tiny"
    # model (Huginn layout)
    vocab_size: int = 4096
    n_embd: int = 192
    n_heads: int = 4
    intermediate_size: int = 512
    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    block_size: int = 4096              # context (RoPE table rows); 8-shot GSM8K + 512 new tokens fit
    rope_theta: float = 50000.0
    # depth schedule (Huginn: mean 32, sigma 0.5, backprop depth 8)
    mean_recurrence: int = 32           # R: mean training depth and the inference depth
    depth_sigma: float = 0.5
    backprop_depth: int = 8             # k: gradient flows through the last k core steps
    min_depth: int = 1                  # floor on r (1 = Huginn's scheme, no floor)
    max_depth: int = 128
    # depth curriculum (Raven retrofit recipe): the sampler's mean rises linearly from depth_warmup_start to
    # mean_recurrence over the first depth_warmup_frac of max_steps; cheap shallow steps while the model is
    # still learning token statistics, Huginn's scheme unchanged afterwards (0 = off)
    depth_warmup_frac: float = 0.3
    depth_warmup_start: int = 4
    init_scale: float = 1.0             # training initial state: like-init (0 = zero state)
    # data
    seq_len: int = 512
    batch_size: int = 4
    long_seq_len: int = 2048            # every ``long_every``-th step trains positions up to long_seq_len
    long_every: int = 8
    val_fraction: float = 0.02
    # optimisation
    lr: float = 1.5e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    # Schedules run on steps (max_steps) so a run is the same on any machine; without max_steps the cosine runs
    # on training time.  time_budget_s is otherwise only a safety stop (the card says when it cut a run short).
    time_budget_s: float = 82 * 60
    max_steps: int | None = 1500        # the shipped run; its duration on the machine it was made on is in its card
    seed: int = 0
    device: str = "cpu"
    threads: int = 2                    # CPU threads (0: leave torch's default)
    share_cpu: bool = True              # drop to 1 thread while other processes load the machine
    autocast_bf16: bool = False
    eval_tokens: int = 16384            # held-out tokens for the final validation loss / agreement
    sample_tokens: int = 64             # greedy sample length in the model card
    log_every: int = 10                 # flush train_log.csv every this many steps
    checkpoint_every: int = 50          # save the resume state every this many steps (0: only on Ctrl-C / at the end)

    def validate(self) -> "TrainConfig":
        """Refuse a run that would fail late, train nothing or train something else than asked, before the corpus
        and tokenizer are built: every field's type and range, and the fields that must agree."""
        for name, (kind, ok, rule) in _RULES.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not _is(value, kind) or not ok(value):
                raise ValueError(f"{name} must be {rule}, got {value!r}")
        if self.max_steps is not None and (not _is(self.max_steps, int) or self.max_steps < 1):
            raise ValueError(f"max_steps must be >= 1 (or null: the cosine runs over the time budget), got "
                             f"{self.max_steps}")
        if len(self.betas) != 2 or not all(_is(b, float) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.min_depth > self.max_depth:
            raise ValueError(f"min_depth ({self.min_depth}) > max_depth ({self.max_depth})")
        if not self.min_depth <= self.mean_recurrence <= self.max_depth:
            raise ValueError(f"mean_recurrence ({self.mean_recurrence}) must lie in [min_depth, max_depth] = "
                             f"[{self.min_depth}, {self.max_depth}]: depths are drawn around it and clipped there")
        for name in ("seq_len", "long_seq_len"):
            if getattr(self, name) > self.block_size:
                raise ValueError(f"{name} ({getattr(self, name)}) must be <= block_size ({self.block_size}), the "
                                 "context the model's RoPE table covers")
        if self.n_embd % self.n_heads:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_heads ({self.n_heads})")
        if (self.n_embd // self.n_heads) % 2:
            raise ValueError(f"n_embd / n_heads ({self.n_embd // self.n_heads}) must be even for RoPE")
        if self.threads:
            check_threads(self.threads, "threads")
        # lazy: the dasspec.model package loads torch (`dasspec train --help` reads this module); the same device
        # check as load_model
        from ..model.checkpoint import resolve_device
        try:
            resolve_device(self.device)
        except ValueError as err:
            raise ValueError(f"{err}; preset {self.preset!r} trains on {self.device!r} - pass --device cpu to run "
                             "it on the CPU") from None
        return self

    def model_config(self, bos: int, eos: int, pad: int) -> "LoopedConfig":
        from ..model.config import LoopedConfig     # lazy: torch, as above

        d = self.n_embd
        return LoopedConfig(
            family="huginn", vocab_size=self.vocab_size, n_embd=d, n_heads=self.n_heads, n_kv_heads=self.n_heads,
            head_dim=d // self.n_heads, intermediate_size=self.intermediate_size, n_prelude=self.n_prelude,
            n_core=self.n_core, n_coda=self.n_coda, mean_recurrence=self.mean_recurrence, norm_eps=1e-6,
            qk_bias=True, rope_theta=self.rope_theta, tie_embeddings=True, embed_scale=math.sqrt(d),
            init_std=math.sqrt(2 / (5 * d)), block_size=self.block_size, bos_token_id=bos, eos_token_id=[eos],
            pad_token_id=pad).validate()

    def to_dict(self) -> dict:
        return asdict(self)


def _is(value, kind) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


_POS = (int, lambda v: v >= 1, ">= 1 (a whole number)")
_NONNEG = (int, lambda v: v >= 0, ">= 0 (a whole number)")
# field -> (type, check, the rule as said in the error)
_RULES = {
    "preset": (str, bool, "a preset name"),
    # the byte-level BPE's alphabet is 256 bytes plus 3 special tokens: a smaller vocabulary cannot hold it
    "vocab_size": (int, lambda v: v >= 259, ">= 259, a whole number (the 256 bytes and 3 special tokens)"),
    "n_embd": _POS, "n_heads": _POS, "intermediate_size": _POS, "n_prelude": _NONNEG, "n_core": _POS,
    "n_coda": _NONNEG, "block_size": _POS,
    "rope_theta": (float, lambda v: v > 0, "a finite number > 0"),
    "mean_recurrence": _POS, "depth_sigma": (float, lambda v: v >= 0, "a finite number >= 0"),
    "backprop_depth": _POS, "min_depth": _POS, "max_depth": _POS,
    "depth_warmup_frac": (float, lambda v: 0 <= v <= 1, "a number in [0, 1] (0: off)"),
    "depth_warmup_start": _POS, "init_scale": (float, lambda v: v >= 0, "a finite number >= 0 (0: zero state)"),
    "seq_len": _POS, "batch_size": _POS, "long_seq_len": _POS,
    "long_every": (int, lambda v: v >= 0, ">= 0 (a whole number; 0: no long steps)"),
    # every source keeps most of its documents for training (val_fraction 1 left it none)
    "val_fraction": (float, lambda v: 0 < v <= 0.5, "a number in (0, 0.5]"),
    "lr": (float, lambda v: v > 0, "> 0 and finite"),
    "min_lr_frac": (float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "warmup_steps": _NONNEG,
    "weight_decay": (float, lambda v: v >= 0, "a finite number >= 0"),
    "grad_clip": (float, lambda v: v >= 0, "a finite number >= 0 (0: no clipping)"),
    # a budget of zero or less would "finish" at once and save an untrained model as if it were trained
    "time_budget_s": (float, lambda v: v > 0, "a positive number of seconds"),
    "seed": (int, lambda v: True, "an integer"), "device": (str, bool, "a device name"),
    "threads": (int, lambda v: v >= 0, ">= 0 (a whole number; 0: torch's default)"),
    "share_cpu": (bool, lambda v: True, "true or false"), "autocast_bf16": (bool, lambda v: True, "true or false"),
    "eval_tokens": _POS, "sample_tokens": _POS, "log_every": _POS,
    "checkpoint_every": (int, lambda v: v >= 0, ">= 0 (a whole number; 0: only on Ctrl-C and at the end)"),
}
_OPTIONAL = frozenset()


PRESETS: dict[str, TrainConfig] = {
    # the bundled model: 2-core CPU, fp32, <= 90 minutes including tokenizer, data and evaluation
    "tiny": TrainConfig(),
    # a few seconds: tests and smoke runs
    "micro": TrainConfig(preset="micro", vocab_size=512, n_embd=32, n_heads=2, intermediate_size=64, block_size=256,
                         mean_recurrence=4, backprop_depth=2, max_depth=8, seq_len=64, batch_size=2,
                         long_seq_len=128, long_every=4, warmup_steps=2, time_budget_s=120, max_steps=6,
                         eval_tokens=256, sample_tokens=8, log_every=1, threads=1),
    # a larger model for a lent GPU (bf16 autocast)
    "cuda-small": TrainConfig(preset="cuda-small", vocab_size=8192, n_embd=512, n_heads=8, intermediate_size=1408,
                              n_core=4, n_prelude=2, n_coda=2, seq_len=2048, batch_size=16, long_seq_len=4096,
                              lr=1e-3, warmup_steps=100, device="cuda", threads=0, autocast_bf16=True,
                              eval_tokens=65536),
}
