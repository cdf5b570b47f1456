"""dasspec as an lm-evaluation-harness model (lm-eval's ``LM`` interface), in process.

    import lm_eval
    from dasspec.eval.lm_eval_model import DasspecLM, task_manager
    lm = DasspecLM(pretrained=None)                             # None: the bundled model; method "auto"
    lm_eval.simple_evaluate(model=lm, tasks=["dasspec_gsm8k_cot"], task_manager=task_manager(), limit=20)

or ``dasspec eval --model dasspec --model_args pretrained=PATH,method=das-wave --tasks ...`` (lm-eval's own run
arguments; ``dasspec/eval/lm_eval_cli.py``).  ``register()`` puts the class in lm-eval's model registry as
``dasspec``.

* ``generate_until``: the requests of one set of generation options decode together through
  ``dasspec.generate_batch`` (continuous batching, ``batch_size`` at a time) with the request's ``until`` strings
  as stop strings and ``max_gen_toks`` as the cap, greedy or - ``do_sample`` / ``temperature`` > 0 - sampled
  (lossless: the tokens AR sampling at the same seed gives).  Every method emits the tokens full-depth AR emits, so
  the outputs and scores do not depend on ``method``; only the time does.
* ``loglikelihood`` / ``loglikelihood_rolling``: no decoding - a full-depth forward (``model(ids)``) scores each
  batch of requests (``dasspec/eval/logprobs.py``); ``is_greedy`` is whether every continuation token is the
  target's argmax.

Model arguments (``--model_args`` / keyword arguments): ``pretrained`` (a folder, an HF-cache repo id, or none:
the bundled model), ``method`` (default ``auto``: DAS-Wave, SAM, PLD or plain steps per request and step, as the
server's default), ``num_steps`` (the recurrence depth R; default the model's),
``init_scale``, ``seed`` (initial states and sampling noise; default 0, as ``dasspec.generate``),
``exit_threshold`` / ``exit_at_step`` (Ouro's early-exit targets), ``device``, ``dtype``, ``batch_size`` (requests
decoded together, and sequences per scoring forward; default 8), ``max_length`` (default the model's context),
``max_gen_toks`` (default cap when a task gives none: 256), ``threads`` (CPU threads), ``add_bos_token`` (encode
prompts with the tokenizer's BOS; default false, as lm-eval's HF and API models), ``prefix_cache`` (prefill the
shared token prefix of a task's prompts - its few-shot exemplars - once for all of them with
``dasspec.PrefixCache``; every method's tokens still equal AR's under it, but against a run without it they may
differ where float rounding flips a near-tie, so it is off by default); any other ``name=value`` is a knob of the
method (``method=das-wave,gamma=32,rounds=24``: DAS-Wave's knobs need its name, the default auto takes ``arms``,
``explore`` and ``calibrate``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry

import dasspec

from ..engine.api.generate import generate_batch
from ..engine.api.prefix_cache import PrefixCache
from ..host import set_threads
from ..methods import build_drafter, get_method
from .logprobs import score

log = logging.getLogger("dasspec.eval")
TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
MODEL_NAME = "dasspec"
DEFAULT_MAX_GEN_TOKS = 256
# generation options a task may give (lm-eval's gen_kwargs); any other is refused rather than ignored
GEN_KWARGS = frozenset({"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "min_p"})


def task_manager(include_path: str | os.PathLike | list | None = None, **kwargs):
    """An lm-eval ``TaskManager`` that knows the offline tasks shipped with dasspec (``lm_eval_tasks/``) besides
    ``include_path``."""
    from lm_eval.tasks import TaskManager     # lazy: lm-eval's task index (heavy), for the callers that need it

    paths = [str(TASKS_DIR)]
    if include_path is not None:
        paths += [str(p) for p in (include_path if isinstance(include_path, list) else [include_path])]
    return TaskManager(include_path=paths, **kwargs)


def _none(value):
    return None if value in (None, "", "none", "None") else value


class DasspecLM(TemplateLM):
    """lm-eval's ``LM`` over a dasspec looped model (see the module docstring)."""

    def __init__(self, pretrained: str | None = None, method: str = "auto", num_steps: int | None = None,
                 init_scale: float = 1.0, seed: int = 0, exit_threshold: float | None = None,
                 exit_at_step: int | None = None, device: str | None = None, dtype: str | None = None,
                 batch_size: int | str = 8, max_batch_size: int | None = None, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, threads: int | None = None, prefix_cache: bool = False,
                 add_bos_token: bool = False, model=None, **knobs):
        super().__init__()
        if threads is not None:
            set_threads(int(threads))
        device = _none(device)
        if device is not None and str(device).startswith("cuda"):
            if not torch.cuda.is_available():     # lm-eval's command line passes cuda:0 unless told otherwise
                log.warning("device %s is not available; dasspec picks the device (CPU here)", device)
                device = None
        if model is None:
            model = dasspec.load_model(_none(pretrained), device=device, dtype=_none(dtype))
        if model.tokenizer is None:
            raise ValueError("dasspec's lm-eval model needs the checkpoint's tokenizer.json")
        self.model, self.tok = model, model.tokenizer
        self.method = get_method(method).name
        self.num_steps = model.depth(_none(num_steps))
        self.init_scale, self.seed = float(init_scale), int(seed)
        self.exit = dict(exit_threshold=_none(exit_threshold), exit_at_step=_none(exit_at_step))
        model.exit_rule(num_steps=self.num_steps, **self.exit)            # refused here for a model without a gate
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            batch_size = max_batch_size or 8
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.context = model.config.block_size
        self.max_length = int(max_length) if _none(max_length) is not None else self.context
        if not 2 <= self.max_length <= self.context:
            raise ValueError(f"max_length must be in [2, {self.context}] (the model's context), got {max_length!r}")
        self.max_gen_toks = int(max_gen_toks)
        self.prefix_cache, self.add_bos_token = bool(prefix_cache), bool(add_bos_token)
        self.knobs = {k: v for k, v in knobs.items()}
        # one kept drafter per (greedy, sampled): checks the knobs now, and keeps Token Recycling's table / SAM's
        # corpus across requests, as the server and the benchmark do (outputs never depend on it)
        self._drafters = {s: build_drafter(model, self.method, dict(self.knobs), self.num_steps, sampled=s)
                          for s in (False, True)}

    # --- lm-eval's TemplateLM hooks ---------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        ids = self.tok.eos_ids
        return ids[0] if ids else (self.tok.bos_id or 0)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS when the tokenizer has one, else EOS."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.model.config.name_or_path if hasattr(self.model.config, "name_or_path") else MODEL_NAME)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        return self.tok.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tok.chat_template

    # --- scoring ------------------------------------------------------------------------------------------------
    def _score(self, seqs: list[list[int]]):
        return score(self.model, seqs, num_steps=self.num_steps, init_scale=self.init_scale, seed=self.seed,
                     max_batch=self.batch_size, **self.exit)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum of the continuation's log-probabilities, all of it greedy).
        A sequence longer than ``max_length`` keeps its last ``max_length`` tokens (the context is cut)."""
        seqs, conts = [], []
        for _key, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval sent an empty continuation to score")
            whole = (list(context) + list(continuation))[-self.max_length:]
            seqs.append(whole)
            conts.append(min(len(continuation), len(whole) - 1))
        out = []
        for (key, _c, _t), scored, n in zip(requests, self._score(seqs), conts):
            lp = scored.logprobs[-n:]
            answer = (float(sum(lp)), bool(all(scored.greedy[-n:])))
            out.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's whole log-likelihood (conditioned on ``prefix_token_id``), in disjoint windows of at most
        ``max_length`` tokens that each keep the most context they can (lm-eval's rolling windows)."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _greedy) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ---------------------------------------------------------------------------------------------
    def _options(self, gen_kwargs: dict[str, Any]) -> tuple[list[str], int, dict[str, Any]]:
        kwargs = dict(gen_kwargs)
        unknown = sorted(set(kwargs) - GEN_KWARGS)
        if unknown:
            raise ValueError(f"generation option(s) {unknown} are not supported by dasspec's lm-eval model "
                             f"(supported: {sorted(GEN_KWARGS)})")
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        cap = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        t = kwargs.pop("temperature", None)
        do_sample = bool(kwargs.pop("do_sample", False))
        filters = {k: v for k, v in kwargs.items() if v is not None}
        if t is not None and float(t) == 0.0:
            do_sample = False
        elif t is not None:
            do_sample = True
        sampling = {}
        if do_sample:
            sampling = {"do_sample": True, "temperature": 1.0 if t is None else float(t), **filters}
        return [u for u in until if u], cap, sampling

    def _shared_prefix(self, prompts: list[list[int]]):
        """With ``prefix_cache``: a ``dasspec.PrefixCache`` of the prompts' shared token prefix (a task's few-shot
        exemplars), prefilled once for all of them; else None."""
        if not self.prefix_cache or len(prompts) < 2:
            return None
        n = common_prefix(prompts)
        if n < 2:
            return None
        return PrefixCache(self.model, prompts[0][:n], num_steps=self.num_steps, init_scale=self.init_scale,
                           state_seed=self.seed)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=repr), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for members in groups.values():
            until, cap, sampling = self._options(requests[members[0]].args[1])
            cap = min(cap, self.max_length - 1)
            prompts = []
            for i in members:
                ids = self.tok_encode(requests[i].args[0])
                prompts.append(ids[-(self.max_length - cap):] if ids else [self.prefix_token_id])
            results = generate_batch(
                self.model, prompts, drafter=self._drafters["do_sample" in sampling], max_new_tokens=cap,
                num_steps=self.num_steps, init_scale=self.init_scale, stop=until or None, seed=self.seed,
                state_seed=self.seed,
                tokenizer=self.tok, max_batch=self.batch_size, prefix_cache=self._shared_prefix(prompts),
                **self.exit, **sampling)
            for i, result in zip(members, results):
                text = result.text or ""
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]


def common_prefix(seqs: list[list[int]]) -> int:
    """Length of the longest token prefix every sequence shares."""
    first, n = seqs[0], min(len(s) for s in seqs)
    return next((i for i in range(n) if any(s[i] != first[i] for s in seqs[1:])), n)


def register() -> None:
    """Put ``DasspecLM`` in lm-eval's model registry as ``dasspec`` (``--model dasspec``); idempotent."""
    # lazy: lm-eval's own models first (it loads them only into an empty registry), at registration only
    import lm_eval.models  # noqa: F401

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=DasspecLM)


register()
