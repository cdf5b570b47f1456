"""``dasspec.generate``: one entry point for every decoding method, Hugging Face ``generate``-style.

    out = dasspec.generate(model, ids, method="das-wave", max_new_tokens=256, gamma=32, rounds=24, k=2)
    out.tokens, out.text, out.stats.A, out.stats.G, out.stats.tokens_per_second

Knobs are named after the paper (gamma, rounds=J, w_init, k, draft_depth=d, block=b, policy, carry); defaults
follow the paper's Table 5 per model family, overridable per model in ``generation_config.json``.  A drafter built
once (``dasspec.build_drafter``) can be passed as ``drafter=`` to keep its state across requests.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

from ..model.looped import LoopedLM
from .draft import Drafter
from .loop import decode
from .request import Request, greedy
from .sampling import Sampling
from .runtime import DEFAULT, Runtime
from .stats import GenerationStats
from .stopping import Criterion, StopRule

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache


@dataclass
class GenerationResult:
    tokens: list[int]              # the new tokens (prompt excluded), cut at the stop token
    stats: GenerationStats
    text: str | None = None        # decoded new tokens, cut before a stop string (when a tokenizer is known)
    trace: list | None = None      # with trace=True: (Draft, Verdict) per verification block

    @property
    def stop_reason(self) -> str:
        return self.stats.stop_reason


def as_token_list(model: LoopedLM, input_ids, tokenizer=None) -> list[int]:
    """The prompt as token ids, from any of the forms ``generate`` accepts; anything else - bytes, float ids, a
    batch - is refused with a message that names it (never truncated or reinterpreted)."""
    if isinstance(input_ids, (bytes, bytearray, memoryview)):
        raise ValueError("input_ids is bytes: give text (decode it first, e.g. prompt.decode('utf-8')) or a list "
                         "of token ids")
    if isinstance(input_ids, str):
        tok = tokenizer or model.tokenizer
        if tok is None:
            raise ValueError("a text prompt needs a tokenizer; load the model from a folder with tokenizer.json "
                             "or pass tokenizer=")
        return tok.encode(input_ids)
    if isinstance(input_ids, Mapping):          # a Hugging Face tokenizer's output (BatchEncoding) or a dict
        if "input_ids" not in input_ids:
            raise ValueError(f"a mapping prompt needs an 'input_ids' entry, got keys {sorted(input_ids)}")
        mask = input_ids.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError("the attention_mask hides some prompt tokens (padding); give the unpadded prompt")
        input_ids = input_ids["input_ids"]
    if hasattr(input_ids, "__array__") and not isinstance(input_ids, torch.Tensor):
        try:                                    # a numpy array: checked by dtype below, like a tensor
            input_ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"input_ids: cannot read {type(input_ids).__name__} of {getattr(input_ids, 'dtype', '?')} "
                             "as token ids") from None
    if isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple, torch.Tensor)):
        input_ids = torch.as_tensor(input_ids)  # [[...]]: a batch as nested lists
    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"generate decodes one sequence at a time (batch 1); got batch {input_ids.shape[0]}")
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D or [1, T], got shape {tuple(input_ids.shape)}")
        ids = input_ids.tolist()
    else:
        ids = list(input_ids)
        for i, t in enumerate(ids):
            if not is_token_id(t):
                raise ValueError(f"input_ids must hold integer token ids, got {t!r} ({type(t).__name__}) at "
                                 f"position {i}")
        ids = [int(t) for t in ids]
    V = model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {V})")
    return ids


def is_token_id(t) -> bool:
    """An integer (Python or numpy), not a bool, a float or text: what may stand for a token."""
    if isinstance(t, torch.Tensor):
        return t.dim() == 0 and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def split_stop(stop, vocab_size: int) -> tuple[list[int], list[str]]:
    """``stop`` (one item or an iterable of them) as extra stop token ids and stop strings; anything else is
    refused with a message, never truncated (a float id would otherwise never match and silently never stop)."""
    ids: list[int] = []
    strings: list[str] = []
    if stop is None:
        items = []
    elif isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable) or is_token_id(stop):
        items = [stop]                          # one stop string or id
    else:
        items = list(stop)
    for s in items:
        if isinstance(s, str):
            if not s:       # the server's rule too: it would match before any text, so it can only be a mistake
                raise ValueError("stop strings must not be empty")
            strings.append(s)
        elif is_token_id(s):
            if not 0 <= int(s) < vocab_size:
                raise ValueError(f"stop token id {int(s)} is outside the vocabulary [0, {vocab_size})")
            ids.append(int(s))
        else:
            raise ValueError(f"stop items must be token ids (integers) or strings, got {s!r} ({type(s).__name__})")
    return ids, strings


def default_stop_ids(model: LoopedLM, tokenizer=None) -> list[int]:
    tok = tokenizer or model.tokenizer
    if tok is not None and tok.eos_ids:
        return list(tok.eos_ids)
    return [i for i in model.config.eos_token_id if 0 <= i < model.config.vocab_size]


# Hugging Face generate options a user may pass out of habit: no-op values are accepted, the rest named.
_HF_NOOP = {"num_beams": 1, "num_return_sequences": 1, "use_cache": True}
_HF_UNSUPPORTED = ("typical_p", "num_beams", "num_return_sequences", "repetition_penalty", "no_repeat_ngram_size",
                   "penalty_alpha", "epsilon_cutoff", "eta_cutoff")


def _drop_hf_options(knobs: dict) -> None:
    for name, value in list(knobs.items()):
        if name in _HF_NOOP and value == _HF_NOOP[name]:
            del knobs[name]
        elif name in _HF_UNSUPPORTED:
            raise ValueError(f"{name}={value!r} is not supported: every method is verified to reproduce full-depth "
                             "AR token for token, greedy or sampled (do_sample with temperature, top_k, top_p, "
                             "min_p); beams, other warpers and logit penalties are not")
        elif name in ("max_length", "min_length", "min_new_tokens"):
            raise ValueError(f"{name} is not supported: give max_new_tokens (new tokens, prompt excluded)")


def sampling_options(do_sample: bool, temperature: float | None, top_k: int | None, top_p: float | None,
                     min_p: float | None, seed: int) -> Sampling | None:
    """Hugging Face's conventions: ``do_sample=True`` samples (temperature 1.0 unless given); sampling options
    without it are ignored with a warning (greedy decoding); ``temperature=0`` with ``do_sample=True`` is an
    error.  Every value is checked (``Sampling``)."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be true or false, got {do_sample!r}")
    if not do_sample:
        given = [f"{n}={v!r}" for n, v, default in (("temperature", temperature, 1.0), ("top_k", top_k, None),
                                                     ("top_p", top_p, 1.0), ("min_p", min_p, None))
                 if v is not None and v != default]
        if given:
            warnings.warn(f"do_sample is off, so {', '.join(given)} {'is' if len(given) == 1 else 'are'} ignored "
                          "and decoding is greedy; pass do_sample=True to sample", UserWarning, stacklevel=3)
        return None
    if temperature == 0:
        raise ValueError("temperature=0 with do_sample=True: a zero temperature is greedy decoding - leave "
                         "do_sample off for it, or give a temperature > 0")
    return Sampling(1.0 if temperature is None else temperature, top_k, top_p, min_p, seed)


def generate(model: LoopedLM, input_ids, method: str = "ar", max_new_tokens: int = 256,
             num_steps: int | None = None, init_scale: float = 1.0, stop: Iterable[int | str] | None = None,
             *, seed: int = 0, do_sample: bool = False, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None, streamer=None, tokenizer=None, eos: bool = True,
             prefix_cache: "PrefixCache | None" = None, stopping_criteria: Iterable[Criterion] | None = None,
             drafter: Drafter | None = None, runtime: Runtime | None = None, trace: bool = False,
             **knobs) -> GenerationResult:
    """Decoding with ``method``, greedy or (``do_sample=True``) sampled; every speculative method is verified by
    the same full-depth target, so its tokens equal ``method="ar"``'s - for sampling, AR's at the same ``seed``
    (``dasspec.engine.sampling``).  ``seed``: the per-position initial states and the sampling noise.  ``input_ids``: text (with the model's tokenizer), a list / tuple / [T] or
    [1, T] tensor of ids, or a Hugging Face tokenizer's output (a mapping with input_ids).  ``stop``: extra stop
    token ids and/or stop strings (EOS always stops unless ``eos=False``).  ``stopping_criteria``: Hugging
    Face-style callables ``(input_ids, scores) -> bool``, asked after every committed token with input_ids
    [1, prompt + output so far] and scores None; generation ends after the first token one of them accepts (at the
    same token for every method).
    ``streamer``: an object with ``put(LongTensor[1, k])`` and ``end()``, given the prompt first and then every
    committed chunk, as Hugging Face generate does (so ``transformers.TextStreamer(tok, skip_prompt=True)`` works).
    ``prefix_cache``: a ``dasspec.PrefixCache`` whose rows the prompt's common prefix with it reuses.
    ``drafter``: a drafter from ``dasspec.build_drafter`` (instead of ``method`` and knobs), kept by the caller
    across requests.  ``runtime``: execution options (``dasspec.Runtime``).  ``trace``: record every block."""
    from ..methods import build_drafter

    _drop_hf_options(knobs)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    sampling = sampling_options(do_sample, temperature, top_k, top_p, min_p, seed)
    prompt = as_token_list(model, input_ids, tokenizer)
    R = model.depth(num_steps)
    if drafter is None:
        drafter = build_drafter(model, method, knobs, R, sampled=sampling is not None)
    elif knobs or method not in ("ar", drafter.name):
        raise ValueError(f"give either a drafter or a method and its knobs, not both (drafter {drafter.name!r}, "
                         f"method {method!r}, knobs {sorted(knobs)})")
    else:
        kept = getattr(drafter, "knobs", None)      # a kept drafter's knobs must also fit this call's depth
        if hasattr(kept, "validate"):
            kept = kept.validate(R)
        if hasattr(kept, "check_ceilings"):
            from ..methods.knobs import Scope
            kept.check_ceilings(Scope.of(model, R))
    tok = tokenizer or model.tokenizer
    extra_ids, stop_strings = split_stop(stop, model.config.vocab_size)
    stop_ids = (default_stop_ids(model, tok) if eos else []) + extra_ids
    rule = StopRule(max_new_tokens, stop_ids, stop_strings, tok.decode if tok is not None else None,
                    criteria=stopping_criteria or (), prompt=prompt)
    blocks: list | None = [] if trace else None
    with torch.inference_mode():
        req = Request(model, prompt, rule, R, init_scale, seed, width=drafter.width, method=drafter.name,
                      streamer=streamer, prefix_cache=prefix_cache, runtime=runtime or DEFAULT,
                      choose=sampling or greedy)
        if streamer is not None:      # as in Hugging Face generate: the prompt first, then each committed chunk
            streamer.put(torch.tensor([prompt]))
        decode(req, drafter, blocks)
        stats = req.finish()
    text = None
    if tok is not None:
        text = rule.trim_text(tok.decode(req.generated)) if stop_strings else tok.decode(req.generated)
    return GenerationResult(tokens=list(req.generated), stats=stats, text=text, trace=blocks)
