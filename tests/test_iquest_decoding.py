"""IQuest-Coder-V1-Loop decoded by every method: each emits AR's tokens - greedy and sampled (same seed), alone and
through ``generate_batch`` with a kept drafter - on prompts and outputs that run several windows past loop 2's
sliding window; with prompt blocks shared between requests; with requests preempted and swapped back; and served
(``dasspec serve``) in its chat template.  AR itself is the remote code's forward (tests/test_iquest.py)."""

from __future__ import annotations

import threading

import openai
import pytest
import torch

import dasspec
from dasspec.engine.api.engine import Engine
from iquest_reference import IQuestReference, write_iquest_checkpoint
from reference_impl import write_tokenizer

SAMPLED = {"do_sample": True, "temperature": 0.8, "seed": 5}
CAP = 20            # with prompts of 15-24 tokens and a window of 8: decode rows 4-6 windows past the prompt start
METHODS = [("self-spec", {}), ("mature-spec", {})] + [
    ("mature-spec", {"policy": p}) for p in ("aligned", "deep-v", "deep-k")] + [
    ("das-wave", {}),
    ("das-wave", {"carry": False, "policy": "deep-kv", "guesses": "lookup", "trim": False, "seed_branch": 4}),
    ("das-wave", {"k": 2, "rounds": 4}),
    ("pld", {}), ("lookahead", {"window": 3, "ngram": 3, "guess_set": 3}), ("token-recycling", {}), ("sam", {}),
    ("auto", {})]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_iquest_checkpoint(tmp_path_factory.mktemp("iquest") / "m", vocab_size=320, seed=3, window=8,
                                   n_shards=2, tokenizer=write_tokenizer("ouro"))


@pytest.fixture(scope="module")
def model(folder):
    return dasspec.load_model(folder, device="cpu", dtype=torch.float32)


def prompts(vocab: int) -> list[list[int]]:
    """A repetitive prompt (the lookup drafters find copies in it), a random one and a short one."""
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, vocab, (6,), generator=g).tolist()
    return [base * 4, torch.randint(3, vocab, (15,), generator=g).tolist(), base[:3]]


def test_ar_is_the_remote_codes_decode(model, folder):
    ref = IQuestReference(folder)
    for p in prompts(model.config.vocab_size):
        assert dasspec.generate(model, p, "ar", max_new_tokens=CAP, eos=False).tokens == ref.greedy(p, CAP)


def test_every_method_equals_ar_greedy_and_sampled_alone_and_batched(model):
    ps = prompts(model.config.vocab_size)
    accepted = {}
    for sampling in ({}, SAMPLED):
        opts = dict(max_new_tokens=CAP, eos=False, **sampling)
        ref = [dasspec.generate(model, p, "ar", **opts).tokens for p in ps]
        for method, knobs in METHODS:
            name = f"{method} {knobs} {sampling or 'greedy'}"
            alone = dasspec.generate(model, ps[0], method, **opts, **knobs)
            assert alone.tokens == ref[0], name
            drafter = dasspec.build_drafter(model, method, knobs, sampled=bool(sampling))
            batched = dasspec.generate_batch(model, ps, max_batch=3, drafter=drafter, **opts)
            assert [b.tokens for b in batched] == ref, name
            accepted[name] = sum(alone.stats.accepted) + sum(sum(b.stats.accepted) for b in batched)
    greedy = [n for n in accepted if n.endswith("greedy")]
    assert sum(accepted[n] > 0 for n in greedy) >= len(greedy) // 2, f"too little is accepted to test: {accepted}"


@pytest.mark.parametrize("window_kv", [True, False], ids=["rings", "full"])
def test_every_method_equals_ar_with_shared_prompt_blocks(model, window_kv):
    """Six requests behind a 32-token prefix (2 blocks of 16, 4 windows), in an engine that keeps loop 2's rows in
    rings (the default: shared prompt blocks bring their window's loop-2 rows, tests/test_window_kv.py) or every
    loop's rows (``window_kv=False``): later ones share the first's blocks and every answer is still its own AR
    decode."""
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, model.config.vocab_size, (8,), generator=g).repeat(4).tolist()
    ps = [prefix + torch.randint(2, model.config.vocab_size, (int(n),), generator=g).tolist()
          for n in torch.randint(1, 9, (6,), generator=g)]
    refs = [dasspec.generate(model, p, "ar", max_new_tokens=12, eos=False).tokens for p in ps]
    for method in ("ar", "self-spec", "das-wave", "pld", "auto"):
        engine = Engine(model, method, max_batch=3, window_kv=window_kv)
        ids = [engine.add(p, max_new_tokens=12, eos=False) for p in ps]
        while engine.has_work:
            engine.step()
        outs = [engine.result(i) for i in ids]
        assert [o.tokens for o in outs] == refs, method
        assert sum(o.stats.cached_tokens for o in outs) >= 3 * 32, method


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_preempted_requests_resume_with_their_own_tokens(model, sampled):
    """A pool far too small for every request at once: requests are swapped out and back in, and every answer is
    still its own batch-1 AR decode (both loops' rows come back bit for bit)."""
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(2, model.config.vocab_size, (int(n),), generator=g).tolist()
          for n in torch.randint(10, 30, (6,), generator=g)]
    kw = dict(max_new_tokens=30, eos=False)
    if sampled:
        kw.update(do_sample=True, temperature=0.8)
    refs = [dasspec.generate(model, p, "ar", seed=i, **kw).tokens for i, p in enumerate(ps)]
    preempted = 0
    for method in ("ar", "self-spec", "das-wave", "auto"):
        engine = Engine(model, method, max_batch=6, block_size=8, kv_budget=160, max_step_tokens=32,
                        window_kv=False)             # (the windowed pool's swaps: tests/test_window_kv.py)
        ids = [engine.add(p, seed=i, **kw) for i, p in enumerate(ps)]
        while engine.has_work:
            engine.step()
        assert [engine.result(i).tokens for i in ids] == refs, method
        preempted += engine.scheduler.preemptions
    assert preempted >= 4, "the pool never ran out: preemption went untested"


def test_served_in_its_chat_template(folder, model, tmp_path):
    """`dasspec serve` answers chats in the checkpoint's template (ChatML turns, a reply ending at <|im_end|>),
    streamed and not, each reply equal to AR's, with the default method (auto) decoding the batch."""
    from test_serve import chat_ids, start_server, stream_text

    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    served = dasspec.load_model(folder, device="cpu")
    assert served.tokenizer.token_to_id("<|im_end|>") in served.tokenizer.eos_ids
    srv = start_server(folder, tmp_path / "server.log", "--max-batch", "4")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [[{"role": "user", "content": text}] for text in ("def add(a, b):", "The loop reads twice")]
        jobs = [(m, stream) for m in messages for stream in (False, True)]
        got = [None] * len(jobs)

        def ask(i):
            m, stream = jobs[i]
            out = client.chat.completions.create(model=folder.name, messages=m, max_tokens=16, stream=stream)
            got[i] = stream_text(out, chat=True) if stream else out.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (m, _), text in zip(jobs, got):
            ids = chat_ids(served, m)
            assert text == dasspec.generate(served, ids, "ar", max_new_tokens=16).text, m
        assert srv.health()["kv_window"] == served.config.loop_window     # loop 2 kept to its window
        # users of one system prompt: the second shares its blocks (loop 2's window rows with them), answers AR's
        system = {"role": "system", "content": "You write careful, short Python. " * 4}
        asked = [[system, {"role": "user", "content": text}] for text in ("def add(a, b):", "def sub(a, b):")]
        outs = [client.chat.completions.create(model=folder.name, messages=m, max_tokens=8) for m in asked]
        assert outs[1].dasspec["cached_tokens"] >= 32
        for m, out in zip(asked, outs):
            assert out.choices[0].message.content == dasspec.generate(served, chat_ids(served, m), "ar",
                                                                      max_new_tokens=8).text
    finally:
        srv.stop()
        (folder / "chat_template.jinja").unlink()

