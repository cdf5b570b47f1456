"""``dasspec.generate`` and ``dasspec.generate_batch``: every decoding method, Hugging Face ``generate``-style.

    out = dasspec.generate(model, ids, method="das-wave", max_new_tokens=256, gamma=32, rounds=24, k=2)
    out.tokens, out.text, out.stats.A, out.stats.G, out.stats.tokens_per_second
    outs = dasspec.generate_batch(model, [ids_a, "text b", ids_c], method="das-wave", max_new_tokens=[64, 32, 8])

Knobs are named after the paper (gamma, rounds=J, w_init, k, draft_depth=d, block=b, policy, carry); defaults
follow the paper's Table 5 per model family, overridable per model in ``generation_config.json``.  A drafter built
once (``dasspec.build_drafter``) can be passed as ``drafter=`` to keep its state across requests.  Both are
wrappers of the batched ``Engine``: ``generate`` is a table of one request, ``generate_batch`` decodes its prompts
together, each result equal to that prompt's own ``generate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from ...methods import build_drafter
from ...methods.knobs import Scope
from ...model.looped import LoopedLM
from ..base.request import pool_share, rows_needed
from ..base.runtime import Runtime
from ..core.blocks import BLOCK_SIZE
from ..core.policy import SpeculationPolicy
from ..core.stopping import Criterion, check_max_new_tokens
from ..drafting.draft import Drafter
from .engine import CLOSED_STEP_TOKENS, Engine
from .options import (GenerationResult, as_token_list, default_stop_ids, drop_hf_options, is_token_id,  # noqa: F401
                      sampling_options, split_stop)

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache

def generate(model: LoopedLM, input_ids, method: str = "ar", max_new_tokens: int = 256,
             num_steps: int | None = None, init_scale: float = 1.0, stop: Iterable[int | str] | None = None,
             *, seed: int = 0, state_seed: int = 0, do_sample: bool = False, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, streamer=None, tokenizer=None, eos: bool = True,
             prefix_cache: "PrefixCache | None" = None, stopping_criteria: Iterable[Criterion] | None = None,
             drafter: Drafter | None = None, runtime: Runtime | None = None, trace: bool = False,
             exit_threshold: float | None = None, exit_at_step: int | None = None, **knobs) -> GenerationResult:
    """Decoding with ``method``, greedy or (``do_sample=True``) sampled; every speculative method is verified by
    the same full-depth target, so its tokens equal ``method="ar"``'s - for sampling, AR's at the same ``seed``
    (``dasspec.engine.base.sampling``).  ``seed``: the sampling noise; ``state_seed`` (with ``init_scale``): the latent
    per-position initial states (Huginn, Raven).  ``input_ids``: text (with the model's tokenizer), a list / tuple / [T] or
    [1, T] tensor of ids, or a Hugging Face tokenizer's output (a mapping with input_ids).  ``stop``: extra stop
    token ids and/or stop strings (EOS always stops unless ``eos=False``).  ``stopping_criteria``: Hugging
    Face-style callables ``(input_ids, scores) -> bool``, asked after every committed token with input_ids
    [1, prompt + output so far] and scores None; generation ends after the first token one of them accepts (at the
    same token for every method).
    ``streamer``: an object with ``put(LongTensor[1, k])`` and ``end()``, given the prompt first and then every
    committed chunk, as Hugging Face generate does (so ``transformers.TextStreamer(tok, skip_prompt=True)`` works).
    ``prefix_cache``: a ``dasspec.PrefixCache`` whose full blocks the prompt's common prefix with it reuses.
    ``drafter``: a drafter from ``dasspec.build_drafter`` (instead of ``method`` and knobs), kept by the caller
    across requests.  ``runtime``: execution options (``dasspec.Runtime``).  ``trace``: record every block.
    ``exit_threshold`` / ``exit_at_step`` (0-based): the target's early exit, for models with an exit gate (Ouro);
    every method is lossless with respect to it."""
    drop_hf_options(knobs)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    prompt = as_token_list(model, input_ids, tokenizer)
    R = model.depth(num_steps)
    call = _call_key(runtime, exit_threshold, exit_at_step, do_sample, (temperature, top_k, top_p, min_p),
                     prefix_cache is None, None)
    drafter, built = _call_drafter(model, method, knobs, R, do_sample is True, drafter, call)
    rows = rows_needed(model.config.block_size, len(prompt), max_new_tokens, drafter.width)
    engine = Engine(model, num_steps=R, runtime=runtime, max_batch=1, kv_budget=max(rows, 1), tokenizer=tokenizer,
                    drafter=drafter, window_kv=prefix_cache is None)
    with torch.inference_mode():
        rid = engine.add(prompt, max_new_tokens=max_new_tokens, stop=stop, eos=eos, seed=seed, state_seed=state_seed,
                         init_scale=init_scale,
                         do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         stopping_criteria=stopping_criteria, streamer=streamer, prefix_cache=prefix_cache,
                         drafter=drafter, trace=trace, tokenizer=tokenizer, exit_threshold=exit_threshold,
                         exit_at_step=exit_at_step)
        while engine.has_work:
            engine.step()
    if built:
        drafter.remember()
    return _raised(engine.result(rid))


def _call_drafter(model: LoopedLM, method: str, knobs: dict, R: int, sampled: bool, drafter: Drafter | None,
                  call: tuple) -> tuple[Drafter, bool]:
    """The call's drafter, and whether it was built here: the caller's kept one (its knobs checked at this depth),
    or one built for this call and started from what the last such call measured (``Drafter.recall``)."""
    if drafter is None:
        drafter = build_drafter(model, method, knobs, R, sampled=sampled)
        drafter.recall(model, R, call)
        return drafter, True
    if knobs or method not in ("ar", drafter.name):
        raise ValueError(f"give either a drafter or a method and its knobs, not both (drafter {drafter.name!r}, "
                         f"method {method!r}, knobs {sorted(knobs)})")
    check_kept(model, drafter, R)
    return drafter, False


def _call_key(runtime: Runtime | None, exit_threshold: float | None, exit_at_step: int | None, do_sample: bool,
              sampling: tuple, window_kv: bool, policy) -> tuple:
    """What a call decides besides its drafter that moves a drafter's prices or earnings (part of a kept state's
    key, ``Drafter.recall``): the runtime, the exit rule, greedy or the sampling options, the pool's layout and the
    speculation policy."""
    rt = runtime or Runtime()
    return ((rt.static_shapes, rt.compile, rt.cuda_graphs, rt.track_memory), exit_threshold, exit_at_step,
            sampling if do_sample is True else None, window_kv, repr(policy))


def _raised(result: GenerationResult) -> GenerationResult:
    """A request that failed (its streamer raised, its set-up failed) raises its error to the caller."""
    if result.error is not None:
        raise result.error
    return result


def check_kept(model: LoopedLM, drafter: Drafter, R: int) -> None:
    """A kept drafter's knobs must also fit this call's depth and their ceilings at it."""
    kept = getattr(drafter, "knobs", None)
    if hasattr(kept, "validate"):
        kept = kept.validate(R)
    if hasattr(kept, "check_ceilings"):
        kept.check_ceilings(Scope.of(model, R))


def _per_prompt(name: str, value, count: int, is_one) -> list:
    """``value`` for every prompt: one value shared, or a list/tuple of ``count`` values (one per prompt)."""
    if isinstance(value, (list, tuple)) and not is_one(value):
        if len(value) != count:
            raise ValueError(f"{name}: {len(value)} values for {count} prompts (give one value, or one per prompt)")
        return list(value)
    return [value] * count


def _stop_is_one(value) -> bool:
    # a stop list is per prompt when every item is itself a list / tuple / None; otherwise it is one prompt's items
    return not all(v is None or isinstance(v, (list, tuple)) for v in value) or not value


def batch_prompts(model: LoopedLM, prompts, tokenizer=None) -> list[list[int]]:
    """The prompts of ``generate_batch`` as token lists: a list of prompts (each in any form ``generate`` takes),
    a [B, T] tensor, or a Hugging Face tokenizer's batch output (padding, where its attention_mask shows it, is
    dropped from each row)."""
    if isinstance(prompts, Mapping):
        if "input_ids" not in prompts:
            raise ValueError(f"a mapping of prompts needs an 'input_ids' entry, got keys {sorted(prompts)}")
        ids = torch.as_tensor(prompts["input_ids"])
        mask = prompts.get("attention_mask")
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, T], got shape {tuple(ids.shape)}")
        if mask is None:
            return [as_token_list(model, row, tokenizer) for row in ids]
        mask = torch.as_tensor(mask).bool()
        out = []
        for i, (row, keep) in enumerate(zip(ids, mask)):
            where = keep.nonzero().flatten()
            if len(where) and int(where[-1] - where[0]) + 1 != len(where):
                raise ValueError(f"prompt {i}: its attention_mask has holes; give unpadded prompts")
            out.append(as_token_list(model, row[keep], tokenizer))
        return out
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"a tensor of prompts must be [batch, T], got shape {tuple(prompts.shape)}")
        return [as_token_list(model, row, tokenizer) for row in prompts]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("generate_batch takes a list of prompts (for one prompt use generate)")
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise ValueError("generate_batch takes a list of prompts, and this is one prompt's token ids: wrap it in a "
                         "list ([ids]) or use generate")
    return [as_token_list(model, p, tokenizer) for p in prompts]


def generate_batch(model: LoopedLM, prompts, method: str = "ar", max_new_tokens: int | Sequence[int] = 256,
                   num_steps: int | None = None, init_scale: float = 1.0, stop=None, *,
                   seed: int | Sequence[int] = 0, state_seed: int = 0, do_sample: bool = False, temperature: float | None = None,
                   top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                   tokenizer=None, eos: bool = True, prefix_cache: "PrefixCache | None" = None,
                   stopping_criteria: Iterable[Criterion] | None = None, drafter: Drafter | None = None,
                   runtime: Runtime | None = None, trace: bool = False, max_batch: int = 8,
                   kv_budget: int | None = None, policy=None, exit_threshold: float | None = None,
                   exit_at_step: int | None = None, window_kv: bool | None = None,
                   max_step_tokens: int = CLOSED_STEP_TOKENS, **knobs) -> list[GenerationResult]:
    """Decode ``prompts`` together (up to ``max_batch`` at a time) with ``method``; one result per prompt, in input
    order, each equal to ``generate(model, prompt, method, ...)`` of that prompt alone (greedy, or sampled with the
    same seed).  Every option of ``generate``; ``max_new_tokens``, ``seed`` and ``prefix_cache`` may be one value
    or one per prompt, and ``stop`` one prompt's stop items or a list of them per prompt (``[["\n"], None, [7]]``).
    ``kv_budget``: depth-cache positions for the running requests (default: room for the ``max_batch`` largest
    at once; prompt blocks are shared between prompts that start alike, so few-shot prompts prefill their
    exemplars once; on a model whose loops >= 2 are windowed, IQuest-Loop, the pool by default keeps only the
    window's rows of those loops, and shares prompt blocks with those rows: ``Engine``'s ``window_kv``).
    ``policy``: a ``SpeculationPolicy`` (how much to speculate as the batch grows; never changes a token), or, as
    ``generate`` takes it, a drafter's prefix-read policy ("deep-v", "k=2,v=32", a (kappa, nu) pair).
    ``max_step_tokens``: rows one step verifies and prefills together (``Engine``'s; larger than a server's default,
    as nobody waits on a first token here; never changes a token)."""
    drop_hf_options(knobs)
    if policy is not None and not isinstance(policy, SpeculationPolicy):     # generate's knob of the same name
        knobs["policy"], policy = policy, None
    ids = batch_prompts(model, prompts, tokenizer)
    if not ids:
        return []
    count = len(ids)
    caps = [check_max_new_tokens(c) for c in _per_prompt("max_new_tokens", max_new_tokens, count, lambda v: False)]
    seeds = _per_prompt("seed", seed, count, lambda v: False)
    prefixes = _per_prompt("prefix_cache", prefix_cache, count, lambda v: False)
    stops = _per_prompt("stop", stop, count, _stop_is_one)
    R = model.depth(num_steps)
    window_kv = all(pc is None for pc in prefixes) if window_kv is None else window_kv
    call = _call_key(runtime, exit_threshold, exit_at_step, do_sample, (temperature, top_k, top_p, min_p), window_kv,
                     policy)
    drafter, built = _call_drafter(model, method, knobs, R, do_sample is True, drafter, call)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a whole number >= 1, got {max_batch!r}")
    if kv_budget is None:
        ctx = model.config.block_size
        need = sorted((pool_share(ctx, len(p), c, drafter.width, BLOCK_SIZE) for p, c in zip(ids, caps)),
                      reverse=True)
        kv_budget = sum(need[:max_batch])
    engine = Engine(model, num_steps=R, runtime=runtime, max_batch=max_batch, kv_budget=kv_budget,
                    max_step_tokens=max_step_tokens,
                    tokenizer=tokenizer, policy=policy, drafter=drafter, closed=True,
                    window_kv=window_kv)
    with torch.inference_mode():
        rids = [engine.add(p, max_new_tokens=c, stop=s, eos=eos, seed=sd, state_seed=state_seed, init_scale=init_scale,
                           do_sample=do_sample,
                           temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           stopping_criteria=stopping_criteria, prefix_cache=pc, drafter=drafter,
                           trace=trace, tokenizer=tokenizer, exit_threshold=exit_threshold, exit_at_step=exit_at_step)
                for p, c, s, sd, pc in zip(ids, caps, stops, seeds, prefixes)]
        while engine.has_work:
            engine.step()
    if built:
        drafter.remember()
    return [_raised(engine.result(r)) for r in rids]
