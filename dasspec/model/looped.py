"""LoopedLM: prelude P, shared core F applied R times, coda H (paper eq. 1), exposed as three primitives.

    inj = model.prelude(ids, span, cache)                         # e = P(x), the injected prelude output
    h   = model.start_state(h0, inj)                              # what step 1 reads (h0, or e for Ouro)
    h   = model.core_step(h, inj, span, cache, read=(kappa, nu))  # h <- F(h, e): (adapter) + core layers (+ ln_f)
    z   = model.readout(h, span, cache)                           # H(h): (ln_f) + coda + (ln_f) + head, float32

Every decoder composes these; none reaches into layers.  ``read`` is the verified-prefix read policy of eq. (2)-(3):
keys from depth kappa, values from depth nu.  The draft-side rows of the call are stored at ``own`` depths
(default: the read depths), which is where verification and AR materialise depth r (``read = own = (r, r)``).
What differs between families (injection, where ln_f sits, the initial state, an exit gate) is the family's
(``dasspec/model/families``); the parentheses above mark those parts.

The adapter acts on concat[h, e] in one matmul per step, exactly as the upstream modeling files do.  Hoisting its
e-half out of the loop would save ~1% of the core FLOPs but changes fp32 rounding at every step, and a recurrence
amplifies that: on random checkpoints the logits drifted ~1e-4 from the upstream formulation at depth 8.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .cache import DepthCache
from .config import LoopedConfig
from .attention import CausalSpan, Span
from .exit import ExitRule
from .layers import RMSNorm, rope_operands, rope_tables
from .linear import Linear
from .noise import position_noise


def steps_of(depths, reads: list[tuple[int, int]] | None, R: int) -> range | list[int]:
    """The core steps of a ``recur`` call: ``depths`` (default 1..R) as a range or list, with one (kappa, nu) per
    step in ``reads`` where given (not silently fewer steps)."""
    steps = depths if isinstance(depths, (range, list)) else range(1, R + 1) if depths is None else list(depths)
    if reads is not None and len(reads) != len(steps):
        raise ValueError(f"reads: one (kappa, nu) per step, got {len(reads)} for {len(steps)} steps")
    return steps


class Recurrence:
    """The target's computation, composed from the three primitives ``prelude``, ``core_step`` and ``readout`` of
    whatever provides them (the model, or its compiled primitives: ``dasspec.engine.base.runtime``), and the model's two
    hooks ``start_state`` and ``exit_logits``, which a wrapper holding the model as ``model`` takes from it."""

    R: int
    model: "LoopedLM"

    def start_state(self, h0: Tensor, inj: Tensor) -> Tensor:
        return self.model.start_state(h0, inj)

    def exit_logits(self, h: Tensor) -> Tensor:
        return self.model.exit_logits(h)

    def recur(self, h: Tensor, inj: Tensor, span: Span, cache: DepthCache | None = None,
              depths: range | None = None, reads: list[tuple[int, int]] | None = None) -> Tensor:
        """Core steps r in ``depths`` (default 1..R), each reading and writing the cache at depth r (aligned
        reads): the target's recurrence, as AR, verification, prefill, training and every full forward run it.
        ``reads``: a draft's steps instead - step r reads the verified prefix at depths reads[i] = (kappa, nu) and
        stores at r."""
        steps = steps_of(depths, reads, self.R)
        if reads is None:
            for r in steps:
                h = self.core_step(h, inj, span, cache, read=(r, r))
            return h
        for r, read in zip(steps, reads):
            h = self.core_step(h, inj, span, cache, read=read, own=(r, r))
        return h

    def full_depth(self, ids: Tensor, h: Tensor, span: Span, cache: DepthCache | None = None, R: int | None = None,
                   rows: slice | None = None, exit: ExitRule | None = None) -> Tensor:
        """Prelude of ``ids`` [B, W], R aligned core steps from the initial states ``h`` [B, W, d] (through
        ``start_state``), readout: float32 logits [B, W', V] (``rows`` of the W positions).  With a cache, the
        span's K/V are written at every depth.  ``exit`` (validated by ``LoopedLM.exit_rule``): every step still
        runs, and each position is read out from the step the rule picks; None reads the last step."""
        inj = self.prelude(ids, span, cache)
        h = self.start_state(h, inj)
        steps = range(1, (R or self.R) + 1)
        if exit is None:
            h = self.recur(h, inj, span, cache, steps)
        else:
            states = []
            for r in steps:
                h = self.core_step(h, inj, span, cache, read=(r, r))
                states.append(h)
            h = exit.select(states, self.exit_logits)
        return self.readout(h, span, cache, rows)


class LoopedLM(Recurrence, nn.Module):
    def __init__(self, cfg: LoopedConfig):
        super().__init__()
        self.config = cfg.validate()
        self.family = family = cfg.spec
        d, Block = cfg.n_embd, family.block
        parts = dict(wte=nn.Embedding(cfg.vocab_size, d),
                     prelude=nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude)))
        if family.injection:
            parts["adapter"] = Linear(2 * d, d, bias=False)
        parts.update(core_block=nn.ModuleList(Block(cfg) for _ in range(cfg.n_core)),
                     coda=nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda)),
                     ln_f=RMSNorm(d, cfg.norm_eps))
        if family.exit_gate:
            parts["exit_gate"] = Linear(d, 1, bias=True)
        self.transformer = nn.ModuleDict(parts)
        self.lm_head = Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        cos, sin = rope_tables(cfg, cfg.block_size)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tokenizer = None                   # attached by load_model when the folder has tokenizer.json
        self.generation_defaults: dict = {}     # knobs from generation_config.json
        self.source: str | None = None

    # --- small helpers ---------------------------------------------------------------------------------
    @property
    def R(self) -> int:
        return self.config.mean_recurrence

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def depth(self, num_steps: int | None = None) -> int:
        """The recurrence depth R of a call: the model's own when ``num_steps`` is None, else a whole number >= 1."""
        if num_steps is None:
            return self.R
        if isinstance(num_steps, bool) or int(num_steps) != num_steps:
            raise ValueError(f"num_steps must be a whole number, got {num_steps!r}")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps!r}")
        return int(num_steps)

    def span(self, n: int, start: int, W: int, positions: Tensor | None = None,
             mask: Tensor | None = None, static_capacity: int | None = None) -> Span:
        """Describe one call: queries at cache rows [start, start+W) over a verified prefix of n rows.
        ``positions`` (default: the rows) set RoPE; ``mask`` [W, start+W] overrides causal visibility.
        ``static_capacity``: build the static-shape form (visibility over all cache rows, rows as a tensor)."""
        if positions is None and start + W > self.config.block_size:     # (given positions: checked by the caller)
            raise ValueError(f"position {start + W - 1} is beyond the model context ({self.config.block_size})")
        if positions is None:
            cos, sin = self.rope_cos[start: start + W], self.rope_sin[start: start + W]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        rot = rope_operands(cos, sin, self.config.rope_style == "interleaved")
        if static_capacity is not None:
            return self._static_span(n, start, W, rot, mask, static_capacity)
        causal, causal_rows = False, mask is None
        if mask is None and W > 1:
            if start > 0:                # its mask and bias built only if a torch path asks (the row kernel does not)
                return CausalSpan.of(n, start, W, rot, self.dtype)
            causal = True
        bias = None
        if mask is not None and self.device.type == "cpu":       # built once, used by every layer and step
            bias = torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(~mask, float("-inf"))
        return Span(n=n, start=start, W=W, rot=rot, mask=mask, causal=causal, bias=bias, causal_rows=causal_rows)

    def _static_span(self, n: int, start: int, W: int, rot, mask: Tensor | None, capacity: int) -> Span:
        dev = self.device
        cols = torch.arange(capacity, device=dev)
        rows = torch.arange(start, start + W, device=dev)
        if mask is None:
            visible = cols[None, :] <= rows[:, None]
        else:
            visible = torch.zeros(W, capacity, dtype=torch.bool, device=dev)
            visible[:, : start + W] = mask
        return Span(n=n, start=start, W=W, rot=rot, mask=visible, rows=rows)

    def initial_state(self, positions: Tensor, init_scale: float = 1.0, seed: int = 0) -> Tensor:
        """The checkpoint's initialisation for the given absolute positions: truncated normal with
        std = init_values.std * init_scale, times the embedding scale; zeros for init_scale == 0.  [len, d]"""
        if not (math.isfinite(init_scale) and init_scale >= 0):
            raise ValueError(f"init_scale must be a finite number >= 0 (0: zero state), got {init_scale!r}")
        cfg = self.config
        d = cfg.n_embd
        std = cfg.init_std * init_scale
        if std == 0.0:
            return torch.zeros(positions.numel(), d, device=self.device, dtype=self.dtype)
        z = position_noise(positions.to(self.device), d, seed)
        return (z * (std * cfg.embed_scale)).to(self.dtype)

    def recur(self, h: Tensor, inj: Tensor, span: Span, cache: DepthCache | None = None,
              depths: range | None = None, reads: list[tuple[int, int]] | None = None) -> Tensor:
        steps = steps_of(depths, reads, self.R)
        if reads is not None and all(rd == (r, r) for r, rd in zip(steps, reads)):
            reads = None                      # aligned: the target's own steps
        # a batched call's steps in one kernel call where the family has one - unless core_step is not this class's
        # (a subclass's or an instance's own), which every step must then go through
        if (cache is not None and len(steps) and type(self).core_step is LoopedLM.core_step
                and "core_step" not in vars(self)):
            y = self.family.recur_rows(self, h, span, cache, steps, inj, reads)
            if y is not None:
                return y
        return super().recur(h, inj, span, cache, steps, reads)

    # --- the three primitives ----------------------------------------------------------------------------
    def prelude(self, ids: Tensor, span: Span, cache: DepthCache | None = None) -> Tensor:
        """Token ids [B, W] -> the injected embedding e (the prelude output) [B, W, d].
        With a cache, prelude K/V are written at the span's rows."""
        t = self.transformer
        x = t.wte(ids)
        if self.config.embed_scale != 1.0:
            x = x * self.config.embed_scale
        for i, block in enumerate(t.prelude):
            x = block(x, span, cache.prelude_kv(i) if cache is not None else None)
        return x

    def core_step(self, h: Tensor, inj: Tensor, span: Span, cache: DepthCache | None = None,
                  read: tuple[int, int] = (1, 1), own: tuple[int, int] | None = None) -> Tensor:
        """One recurrence: h <- core(adapter(concat[h, e])) (without injection: core(h); a family that norms every
        step: ln_f(core(...))).  Prefix keys are read at depth read[0] (kappa) and values at read[1] (nu); the
        span's own K/V are stored at ``own`` (default ``read``)."""
        t = self.transformer
        x = t.adapter(torch.cat(torch.broadcast_tensors(h, inj), dim=-1)) if self.family.injection else h
        own = read if own is None else own
        family = self.family
        for i, block in enumerate(t.core_block):
            x = block(x, span, family.core_kv(cache, i, read, own, span))
        return t.ln_f(x) if self.family.norm_every_step else x

    def readout(self, h: Tensor, span: Span, cache: DepthCache | None = None,
                rows: slice | None = None) -> Tensor:
        """State [B, W, d] -> float32 logits [B, W, V] through (ln_f), the coda, ln_f and the head (only for
        ``rows`` of the W positions when given; a family whose steps end in ln_f skips the last one, since the state
        is already normed).  The coda reads the prefix's full-depth coda K/V (the only coda K/V that is
        materialised) and writes the span's own."""
        t = self.transformer
        x = t.ln_f(h) if self.family.norm_after_loop else h
        for i, block in enumerate(t.coda):
            x = block(x, span, cache.coda_kv(i) if cache is not None else None)
        if rows is not None:
            x = x[:, rows]
        return self.lm_head(x if self.family.norm_every_step else t.ln_f(x)).float()

    # --- the family's hooks ---------------------------------------------------------------------------------
    def start_state(self, h0: Tensor, inj: Tensor) -> Tensor:
        """The state the first core step reads, from a position's initial state ``h0`` and its prelude output
        ``inj``: h0 (Huginn, Raven), or the embedding itself (Ouro).  Every path into the recurrence takes it."""
        return self.family.start_state(h0, inj)

    def exit_logits(self, h: Tensor) -> Tensor:
        """The early-exit gate's logit of each position of a step's state h [B, W, d] -> [B, W], model dtype."""
        if not self.family.exit_gate:
            raise ValueError(f"the {self.family.name} family has no early-exit gate")
        return self.transformer.exit_gate(h).squeeze(-1)

    def exit_rule(self, exit_threshold: float | None = None, exit_at_step: int | None = None,
                  num_steps: int | None = None) -> ExitRule | None:
        """The target's exit rule for the two options (None: the last step), checked against this model's family
        and the call's depth.  Families without an exit gate refuse both options."""
        rule = ExitRule.of(exit_threshold, exit_at_step)
        if rule is None:
            return None
        if not self.family.exit_gate:
            raise ValueError(f"exit_threshold / exit_at_step need a model with an early-exit gate (Ouro); a "
                             f"{self.family.name} model has none and always reads its last recurrence step")
        return rule.check_depth(self.depth(num_steps))

    # --- full forward (no cache) -------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, num_steps: int | None = None, init_scale: float = 1.0,
                seed: int = 0, exit_threshold: float | None = None, exit_at_step: int | None = None) -> Tensor:
        """Logits [B, T, V] (float32) of a full forward at depth ``num_steps`` (default R), no cache.
        ``exit_threshold`` / ``exit_at_step`` (0-based): Ouro's early-exit targets (``dasspec/model/exit.py``)."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("empty input")
        R = self.depth(num_steps)
        exit = self.exit_rule(exit_threshold, exit_at_step, R)
        h = self.initial_state(torch.arange(T), init_scale, seed).expand(B, T, -1)
        return self.full_depth(input_ids, h, self.span(0, 0, T), None, R, exit=exit)

    def linear_weight_names(self) -> list[str]:
        """State-dict names of the Linear weights (a tied head's shared weight under its embedding name)."""
        linear = {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear)}
        return [n for n, p in self.named_parameters() if id(p) in linear]

    def cpu_weight_layout(self) -> "LoopedLM":
        """Store each Linear weight [out, in] contiguous (rows of ``in`` values), the layout every product reads
        (``linear``); a model whose weights were transposed or strided gets them back here.  Values are unchanged."""
        for m in self.modules():
            if isinstance(m, nn.Linear) and not m.weight.data.is_contiguous():
                m.weight.data = m.weight.data.contiguous()
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
