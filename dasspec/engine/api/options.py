"""What a request may ask for, checked once for ``generate``, ``generate_batch`` and ``Engine.add``: the prompt in
any form a user passes (text, ids, tensors, a Hugging Face tokenizer's output), stop items, sampling options, and
Hugging Face ``generate`` options passed out of habit; and the result handed back."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterable

import torch

from ...model.fields import eos_list
from ...model.looped import LoopedLM
from ..base.sampling import Sampling
from .stats import GenerationStats


@dataclass
class GenerationResult:
    tokens: list[int]              # the new tokens (prompt excluded), cut at the stop token
    stats: GenerationStats
    text: str | None = None        # decoded new tokens, cut before a stop string (when a tokenizer is known)
    trace: list | None = None      # with trace=True: (Draft, Verdict) per verification block
    error: Exception | None = None  # what ended it, when its stop reason is "error"

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
                raise ValueError(f"generate takes one prompt ([1, T]); got a batch of {input_ids.shape[0]}: use "
                                 "generate_batch for several")
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
    """The ids a request ends at unless ``eos=False``: the tokenizer's end-of-text ids, then the ids config.json's
    and generation_config.json's ``eos_token_id`` name that the tokenizer marks special (Hugging Face's generate and
    vLLM stop at those: a chat model may list its end-of-turn id there alone; an id the tokenizer holds as a word - a
    Raven config's stale Huginn ids - is not a stop), each once, inside the vocabulary.  Without a tokenizer (or
    one that names no EOS) config.json's ids as its family keeps them (generation_config.json's are not checked
    by anything then: not stops)."""
    tok = tokenizer or model.tokenizer
    gen = model.generation_defaults if isinstance(model.generation_defaults, dict) else {}
    named = list(model.config.eos_token_id)         # (a family drops ids it knows to be stale: Raven's)
    if tok is not None and tok.eos_ids:
        special = getattr(tok, "is_special", None)      # (a tokenizer of the caller's may not tell)
        named = list(tok.eos_ids) + [i for i in named + eos_list(gen.get("eos_token_id"))
                                     if special is not None and special(i)]
    return [i for i in dict.fromkeys(named) if 0 <= i < model.config.vocab_size]


# Hugging Face generate options a user may pass out of habit: no-op values are accepted, the rest named.
_HF_NOOP = {"num_beams": 1, "num_return_sequences": 1, "use_cache": True}
_HF_UNSUPPORTED = ("typical_p", "num_beams", "num_return_sequences", "repetition_penalty", "no_repeat_ngram_size",
                   "penalty_alpha", "epsilon_cutoff", "eta_cutoff")


def drop_hf_options(knobs: dict) -> None:
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
