"""``dasspec serve``'s echo / logprobs / max_tokens 0 / lists of prompts / chat logprobs and the tokenizer routes,
end to end: the real server on 127.0.0.1, the real ``openai`` client (raw HTTP for refusals), answers compared with
what this process computes on the same checkpoint - the text with ``dasspec.generate(method="ar")``, every
log-probability with a plain full-depth forward ``model(ids)`` (float32 precision)."""

from __future__ import annotations

import openai
import pytest
import torch

import dasspec
from test_serve import PROMPT, ar, chat_ids, checkpoint, model, start_server  # noqa: F401  (fixtures)

C, CHAT = "/v1/completions", "/v1/chat/completions"
QUEUE, BATCH = 3, 2
# float32: the server's log-softmax against torch's over a plain forward (test_scoring.py: batching moves no bit)
TOL = dict(rel=1e-5, abs=2e-5)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):  # noqa: F811
    srv = start_server(checkpoint, tmp_path_factory.mktemp("serve-lp") / "server.log", "--method", "das-wave",
                       "--set", "gamma=8", "--set", "rounds=4", "--max-queue", str(QUEUE), "--max-batch",
                       str(BATCH), "--served-model-name", "tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def target(model, ids: list[int], seed: int = 0) -> torch.Tensor:  # noqa: F811
    """The full-depth target's log-softmax at every position of ``ids`` (a plain forward, no cache)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]), seed=seed)[0].float(), -1)


def scored(lp: torch.Tensor, ids: list[int], start: int = 1) -> list[float]:
    return [lp[t - 1, ids[t]].item() for t in range(start, len(ids))]


def test_echo_with_max_tokens_0_scores_the_prompt(server, model):  # noqa: F811
    tok = model.tokenizer
    ids = tok.encode(PROMPT)
    status, body, _ = server.post(C, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 3})
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    ref = target(model, ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(scored(ref, ids), **TOL)
    # the top 3 at each position: the target's three largest, most likely first
    # (as token strings: two ids that decode alike, such as two halves of characters, keep the likelier)
    for t, top in enumerate(lp["top_logprobs"][1:]):
        v, k = ref[t].topk(3)
        want: dict[str, float] = {}
        for i, x in zip(k.tolist(), v.tolist()):
            want.setdefault(tok.decode([i]), x)
        assert list(top) == list(want) and list(top.values()) == pytest.approx(list(want.values()), **TOL)
        assert lp["token_logprobs"][t + 1] <= max(top.values()) + 1e-6
    # tokens and offsets index the returned text
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == len(ids)
    for s, off in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][off: off + len(s)] == s
    # token ids as the prompt: the same numbers
    status, body2, _ = server.post(C, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200 and body2["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    assert body2["choices"][0]["logprobs"]["top_logprobs"] == [None] * len(ids)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}], ids=["greedy", "sampled"])
def test_generated_logprobs_are_the_targets_whatever_the_method(client, model, sampling):  # noqa: F811
    ids = model.tokenizer.encode(PROMPT)
    seed = 0                                  # the server's initial states: a request's seed only samples
    ref = ar(model, ids, 12, **({"do_sample": True, "temperature": 0.8, "top_p": 0.9, "seed": 5} if sampling else {}))
    lp = target(model, ids + ref.tokens, seed)
    want = scored(lp, ids + ref.tokens, len(ids))
    got = {}
    for method in ("ar", "das-wave", "self-spec"):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, logprobs=1,
                                        extra_body={"dasspec": {"method": method}}, **sampling)
        choice = out.choices[0]
        assert choice.text == ref.text and out.usage.completion_tokens == len(ref.tokens)
        assert choice.logprobs.token_logprobs == pytest.approx(want, **TOL)
        got[method] = choice.logprobs.token_logprobs
    assert got["ar"] == got["das-wave"] == got["self-spec"]     # one forward over the same tokens: same numbers
    # echo with a generation: the prompt's tokens, then the generated ones, in one object
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, logprobs=1, echo=True, **sampling)
    lps = out.choices[0].logprobs
    assert out.choices[0].text == model.tokenizer.decode(ids) + ref.text
    assert lps.token_logprobs[0] is None and len(lps.tokens) == len(ids) + len(ref.tokens)
    assert lps.token_logprobs[1:] == pytest.approx(scored(lp, ids + ref.tokens), **TOL)


def test_a_list_of_prompts_gets_one_choice_per_prompt_in_order(client, model):  # noqa: F811
    tok = model.tokenizer
    prompts = ["The quick brown fox", "A looped transformer", "def f(x):", "Once upon a time"]
    refs = [ar(model, tok.encode(p), 6 + i) for i, p in enumerate(prompts)]
    assert len({r.text for r in refs}) == len(prompts)               # distinct, so a mix-up shows
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [ar(model, tok.encode(p), 8).text for p in prompts]
    ids = [tok.encode(p) for p in prompts]
    assert out.usage.prompt_tokens == sum(map(len, ids))
    out = client.completions.create(model="tiny", prompt=ids[:2], max_tokens=0, echo=True, logprobs=1)
    for c, p in zip(out.choices, ids[:2]):
        assert c.logprobs.token_logprobs[1:] == pytest.approx(scored(target(model, p), p), **TOL)


def test_chat_logprobs_and_top_logprobs(client, model):  # noqa: F811
    messages = [{"role": "user", "content": "Two plus two"}]
    ids = chat_ids(model, messages)
    ref = ar(model, ids, 10)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == ref.text and len(content) == len(ref.tokens)
    lp = target(model, ids + ref.tokens)
    assert [c.logprob for c in content] == pytest.approx(scored(lp, ids + ref.tokens, len(ids)), **TOL)
    for c, t in zip(content, range(len(ids), len(ids) + len(ref.tokens))):
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(lp[t - 1].topk(2).values.tolist(), **TOL)
        assert c.bytes == list(c.token.encode())
    assert "".join(c.token for c in content).startswith(ref.text)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10)
    assert plain.choices[0].logprobs is None                  # not asked: not computed


def test_tokenizer_routes(server, model):  # noqa: F811
    tok = model.tokenizer
    status, text = server.get("/tokenizer_info")
    import json
    info = json.loads(text)
    assert status == 200 and info["eos_token"] == tok.special_tokens.get("eos_token")
    assert info["model_max_length"] == model.config.block_size
    status, body, _ = server.post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and body["tokens"] == tok.encode(PROMPT, add_special_tokens=False)
    status, body, _ = server.post("/detokenize", {"tokens": tok.encode(PROMPT)})
    assert status == 200 and body["prompt"] == tok.decode(tok.encode(PROMPT))


MSG = [{"role": "user", "content": "hi"}]
BAD = [   # (path, body, param, words the message must contain)
    (C, {"prompt": "x", "max_tokens": 0}, "max_tokens", "only with echo"),
    (C, {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens", "greater than or equal to 0"),
    (C, {"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    (C, {"prompt": "x", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
    (C, {"prompt": "x", "logprobs": True}, "logprobs", "integer"),
    (C, {"prompt": "x", "echo": "yes"}, "echo", "boolean"),
    (C, {"prompt": "x", "echo": True, "stream": True}, "echo", "stream"),
    (C, {"prompt": "x", "logprobs": 1, "stream": True}, "logprobs", "stream"),
    (C, {"prompt": ["a", "b"], "stream": True}, "prompt", "several prompts"),
    (C, {"prompt": ["a"] * (BATCH + QUEUE + 1)}, "prompt", f"at most {BATCH + QUEUE}"),
    (C, {"prompt": [[5, 6], [99999]], "max_tokens": 2}, "prompt[1]", "vocabulary"),
    (C, {"prompt": [[5, 6], []], "max_tokens": 2}, "prompt[1]", "empty"),
    (C, {"prompt": [[5] * 600], "max_tokens": 0, "echo": True}, "prompt", "context"),
    (C, {"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 1, "dasspec": {"exit_threshold": 0.5}},
     "dasspec.exit_threshold", "early-exit gate"),
    (C, {"prompt": "x", "max_tokens": 0, "echo": True, "dasspec": {"exit_at_step": 1}}, "dasspec.exit_at_step",
     "early-exit gate"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs", "only with logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    (CHAT, {"messages": MSG, "logprobs": True, "stream": True}, "logprobs", "stream"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("/tokenize", {"prompt": 5}, "prompt", "string"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown field"),
    ("/detokenize", {"tokens": [99999]}, "tokens", "vocabulary"),
    ("/detokenize", {"tokens": [5] * 513}, "tokens", "context"),
]


@pytest.mark.parametrize("path, body, param, words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_new_fields_are_bounded_and_refused_with_the_field(server, path, body, param, words):
    status, answer, _ = server.post(path, body)
    assert status == 400, answer
    err = answer["error"]
    assert err["param"] == param and words in err["message"], err
    assert "\n" not in err["message"]


def test_still_serving_after_the_refusals(client, model):  # noqa: F811
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert out.choices[0].text == ar(model, model.tokenizer.encode(PROMPT), 6).text
    assert out.choices[0].logprobs is None and isinstance(out.dasspec, dict)     # as before: nothing new asked
