"""Requests at the engine's edges (issue 51): a request running to the end of the model context beside others, a
wide drafter preempted in a small pool, a prompt larger than the free blocks beside short requests.  Each finishes
with its own AR tokens, and nothing beside it is lost.  Small models with a short context keep them cheap."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.engine.engine import Engine
from dasspec.testing import random_model

CONTEXT = 96


@pytest.fixture(scope="module")
def model():
    return random_model("huginn", seed=11, mean_recurrence=4, n_prelude=1, n_core=1, n_coda=1, block_size=CONTEXT)


def _repeating(vocab: int, length: int, period: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (period,), generator=g).repeat(-(-length // period))[:length].tolist()


# --- 1. DAS-Wave (and auto) to the end of the context -------------------------------------------------------------

WAVES = [("das-wave", {}),                                      # gamma 32 > the room left near the end
         ("das-wave", {"gamma": 24, "w_init": 8, "rounds": 6, "guesses": "copy", "seed_branch": 8, "trim": True,
                       "copy_run": True, "early_stop": True}),
         ("auto", {"arms": "das-wave", "explore": 1.0, "calibrate": False})]


@pytest.mark.parametrize("method,knobs", WAVES, ids=["wave", "wave-tuned", "auto"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_window_near_the_end_of_the_context_is_capped(model, method, knobs, sampled):
    """prompt + max_new_tokens = the context: DAS-Wave's window (gamma 32 by default) would run rows past the last
    position in the request's last blocks.  Alone and in a batch beside a short request, every answer is AR's."""
    long = _repeating(model.config.vocab_size, CONTEXT - 16, 9, seed=0)
    short = _repeating(model.config.vocab_size, 12, 5, seed=1)
    opts = dict(do_sample=True, temperature=0.8, top_p=0.95) if sampled else {}
    refs = [dasspec.generate(model, p, "ar", max_new_tokens=16, eos=False, seed=3, **opts).tokens
            for p in (short, long)]
    alone = dasspec.generate(model, long, method, max_new_tokens=16, eos=False, seed=3, **opts, **knobs)
    assert alone.tokens == refs[1]
    both = dasspec.generate_batch(model, [short, long], method, max_new_tokens=16, eos=False, seed=3, **opts, **knobs)
    assert [o.tokens for o in both] == refs
