"""Issue 29 against the real server (uvicorn in a subprocess, a tiny random checkpoint whose chat template spins,
floods or hogs memory on some messages): no client input is a 500 - a fuzz of malformed bodies, wrong types in
every field, deep nesting, huge numbers, lone surrogates; bodies past the limit are 413 before they are read; a
hostile template is that request's 400 while /health keeps answering; and under a bounded load of hostile
requests mixed with normal ones (the real ``openai`` client), every normal answer equals AR's."""

from __future__ import annotations

import copy
import http.client
import json
import threading
import time

import openai
import pytest

import dasspec
from reference_impl import write_checkpoint, write_tokenizer
from test_serve import ar, chat_ids, start_server

# Normal conversations render as in test_serve; "spin" loops 10^10 times, "flood" prints 6.4 million characters,
# "hog" builds a 1 GB string, "boom" raises.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['content'] == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
            "{% endfor %}{% endif %}"
            "{% if m['content'] == 'flood' %}{% for i in range(100000) %}{{ 'x' * 64 }}{% endfor %}{% endif %}"
            "{% if m['content'] == 'hog' %}{{ ('y' * 1000000000)[:1] }}{% endif %}"
            "{% if m['content'] == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
            "<|begin_header|>{{ m['role'] }}<|end_header|>\n\n{{ m['content'] }}<|end_turn|>{% endfor %}"
            "{% if add_generation_prompt %}<|begin_header|>assistant<|end_header|>\n\n{% endif %}")
CONTEXT = 256
TIMEOUT = 0.5               # the server's --template-timeout
C, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = write_tokenizer("huginn")
    tok["tokenizer_config.json"] = json.dumps({**json.loads(tok["tokenizer_config.json"]), "chat_template": TEMPLATE})
    return write_checkpoint(tmp_path_factory.mktemp("hostile") / "tiny", "huginn", vocab_size=320, tokenizer=tok,
                            mean_recurrence=4, config_edits={"block_size": CONTEXT}, drop=("freqs_cis",))


@pytest.fixture(scope="module")
def model(checkpoint):
    return dasspec.load_model(checkpoint, device="cpu")


@pytest.fixture(scope="module", params=["single", "ray"])
def server(request, checkpoint, tmp_path_factory):
    """The single server, and the same flags as a Ray Serve application (``--ray``: a local Ray instance on
    127.0.0.1 in the server's process, one replica behind the ingress): the cluster path has the same limits,
    timeouts and hostile-input behaviour (issue 36)."""
    flags = ["--method", "das-wave", "--set", "gamma=6", "--set", "rounds=3", "--max-queue", "16",
             "--template-timeout", str(TIMEOUT), "--served-model-name", "tiny", "--no-warmup"]
    if request.param == "ray":
        pytest.importorskip("ray.serve")
        flags += ["--ray", "--replicas", "1"]
    srv = start_server(checkpoint, tmp_path_factory.mktemp("hostile-log") / "server.log", *flags,
                       wait=120 if request.param == "single" else 300)
    yield srv
    srv.stop(15 if request.param == "single" else 90)    # --ray: the application and the Ray instance go down


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def errors(server) -> float:
    return sum(server.metric(f'dasspec_requests_total{{endpoint="{e}",outcome="error"}}') for e in ("completions",
                                                                                                    "chat"))


def post_raw(server, path: str, data: bytes, headers: dict | None = None, chunked: bool = False):
    conn = server.connection()
    try:
        if chunked:
            conn.request("POST", path, body=iter([data[i: i + 65536] for i in range(0, len(data), 65536)]),
                         headers={"Content-Type": "application/json", **(headers or {})}, encode_chunked=True)
        else:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    except (ConnectionResetError, BrokenPipeError):       # the server answered and closed while we still sent
        return 413, b""
    finally:
        conn.close()


# --- the chat template sandbox ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, words", [("spin", f"did not finish within {TIMEOUT:g} s"),
                                            ("flood", "output passed"), ("hog", "memory"),
                                            ("boom", "no boom here")])
def test_a_hostile_template_is_that_requests_400_and_health_keeps_answering(server, client, model, content, words):
    result = {}

    def send():
        result["answer"] = server.post(CHAT, {"messages": [{"role": "user", "content": content}], "max_tokens": 2})

    sender = threading.Thread(target=send)
    sender.start()
    rendering = []
    while sender.is_alive():                    # the event loop is free: /health answers while the template renders
        health = server.health()
        assert health["status"] == "ok"
        rendering.append(health["templates_rendering"])
        time.sleep(0.05)
    if content == "spin":      # it renders until the limit stops it: some /health must have been answered meanwhile
        assert max(rendering, default=0) >= 1, rendering
    status, answer, _ = result["answer"]
    assert status == 400 and answer["error"]["param"] == "messages", answer
    assert words in answer["error"]["message"], answer
    messages = [{"role": "user", "content": "hello there"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    assert out.choices[0].message.content == ar(model, chat_ids(model, messages), 6).text


def test_a_template_that_exceeds_its_bounds_at_start_stops_the_server_from_starting(checkpoint):
    from dasspec.serve.service import ServeOptions, Service

    model = dasspec.load_model(checkpoint, device="cpu")
    model.tokenizer = copy.copy(model.tokenizer)
    model.tokenizer.chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ValueError, match=r"the checkpoint's chat template, on a one-message conversation: the chat "
                                         r"template did not finish within 0.3 s"):
        Service(model, ServeOptions(template_timeout=0.3))


def test_a_knob_above_its_ceiling_is_a_400_naming_it(server):
    status, answer, _ = server.post(C, {"prompt": "x", "dasspec": {"method": "das-wave", "knobs": {"rounds": 10**6}}})
    assert status == 400 and answer["error"]["param"] == "dasspec.knobs"
    assert answer["error"]["message"].startswith("'dasspec.knobs': rounds=1000000 is above its ceiling of "), answer


# --- bodies --------------------------------------------------------------------------------------------------------------

def test_a_body_past_the_limit_is_413_before_it_is_read(server, model):
    from dasspec.serve.service import _BODY_SLACK

    longest = max(map(len, model.tokenizer.backend.get_vocab()))
    limit = 6 * CONTEXT * longest + _BODY_SLACK                  # the documented default
    big = json.dumps({"prompt": "x" * limit, "max_tokens": 1}).encode()
    for chunked in (False, True):                                # with a Content-Length, and streamed without one
        status, body = post_raw(server, C, big, chunked=chunked)
        assert status == 413, body
        if body:
            assert json.loads(body)["error"]["code"] == "request_too_large"
    assert post_raw(server, C, b"{}", headers={"Content-Length": "99999999999"})[0] == 413
    fits = json.dumps({"prompt": "x " * (CONTEXT + 10), "max_tokens": 1}).encode()    # under the limit: read, 400
    status, body = post_raw(server, C, fits)
    assert len(fits) < limit and status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"
    assert server.health()["status"] == "ok"


GOOD = {C: {"prompt": "The quick brown fox", "max_tokens": 1},
        CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}
WRONG = [None, True, -1, 1e308, 10**30, "\ud800", [], {"a": "\udfff"}, [[[[[[]]]]]]]


def hostile_bodies() -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = [
        (C, b""), (C, b"null"), (C, b"[]"), (C, b"3"), (C, b'"x"'), (C, b"\xff\xfe"), (C, b"{" * 200_000),
        (C, b"[" * 60_000 + b"]" * 60_000), (C, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"),
        (C, b'{"prompt": "x", "max_tokens": 1e400}'), (C, b'{"prompt": "x", "temperature": NaN}'),
        (C, b'{"prompt": "x", "temperature": Infinity}'), (C, b'{"prompt": "\\ud800"}'),
        (C, b'{"prompt": "x", "\\udc00": 1}'), (C, b'{"prompt": ["\\ud83d"]}'),
        (CHAT, b'{"messages": [{"role": "\\ud800", "content": "hi"}]}'),
        (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
        (C, json.dumps({"prompt": "x", "dasspec": {"knobs": {"a": json.loads("[" * 40 + "]" * 40)}}}).encode()),
    ]
    for knobs in ({"rounds": 10**6}, {"gamma": 10**30}, {"rounds": 2**70}, {"policy": 5}, {"policy": {}},
                  {"tree": {"a": 1}}, {"tree": [[0] * 5000]}, {"tree": [[-1]]}, {"guesses": []}, {"alpha": "nan"},
                  {"topk": 10**9}, {"static_corpus": "/etc/passwd"}, {"window": 10**9, "ngram": 10**9},
                  {"arms": "das-wave," * 10**4}, {"arms": ["sam", {}]}, {"explore": 1e400}, {"calibrate": "yes"}):
        method = "token-recycling" if "tree" in knobs or "topk" in knobs else "lookahead" if "window" in knobs \
            else "sam" if "alpha" in knobs or "static_corpus" in knobs \
            else "auto" if {"arms", "explore", "calibrate"} & set(knobs) else "das-wave"
        out.append((C, json.dumps({**GOOD[C], "dasspec": {"method": method, "knobs": knobs}}).encode()))
    for path, good in GOOD.items():             # a wrong value in every field, one at a time
        fields = ["model", "max_tokens", "stop", "stream", "stream_options", "temperature", "top_p", "seed", "user",
                  "dasspec", "n", "presence_penalty", "frequency_penalty", "logit_bias"]
        fields += ["prompt", "echo", "suffix", "best_of", "logprobs"] if path == C else \
            ["messages", "max_completion_tokens", "logprobs", "top_logprobs"]
        for name in fields:
            for value in WRONG:
                if value is None and name in ("max_tokens", "max_completion_tokens"):
                    continue                  # valid: the default length, a long generation for nothing
                out.append((path, json.dumps({**good, name: value}).encode()))
        for value in WRONG:                       # and inside a message
            for key in ("role", "content", "name"):
                msg = {"role": "user", "content": "hi", key: value}
                out.append((CHAT, json.dumps({**good, "messages": [msg]}).encode()))
            out.append((C, json.dumps({**good, "dasspec": {"method": value}}).encode()))
            out.append((C, json.dumps({**good, "dasspec": {"method": "das-wave", "knobs": {"gamma": value}}}).encode()))
    return out


class KeepAlive:
    """One HTTP/1.1 connection for many requests (reopened when the server closes it): the fuzz pays for
    requests, not for connections."""

    def __init__(self, server):
        self.server, self.conn = server, server.connection()

    def post(self, path: str, data: bytes) -> tuple[int, bytes]:
        for attempt in range(2):
            try:
                self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                body = r.read()
                if r.getheader("connection", "").lower() == "close":
                    self.conn.close()
                return r.status, body
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = self.server.connection()
                if attempt:
                    raise
        raise AssertionError("unreachable")


def test_nothing_a_client_sends_is_a_500(server):
    before = errors(server)
    bad = []
    link = KeepAlive(server)
    for path, data in hostile_bodies():
        status, body = link.post(path, data)
        if not (200 <= status < 500):
            bad.append((status, data[:120], body[:200]))
        elif status >= 400 and body:
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) < 2000, err
    assert bad == []
    assert errors(server) == before
    for path in ("/v1/models/%ED%A0%80", "/v1/models/" + "x" * 5000, "/nope"):
        conn = server.connection()
        conn.request("GET", path)
        assert 400 <= conn.getresponse().status < 500
        conn.close()
    assert server.health()["status"] == "ok"


# --- a bounded load of hostile requests mixed with normal ones ---------------------------------------------------------

def test_normal_requests_stay_equal_to_ar_under_a_hostile_load(server, client, model):
    hostile = [(CHAT, json.dumps({"messages": [{"role": "user", "content": c}], "max_tokens": 2}).encode())
               for c in ("spin", "flood", "hog")]
    hostile += [(C, b"[" * 100_000), (C, json.dumps({"prompt": "x" * 2_000_000}).encode()),
                (C, json.dumps({"prompt": "x", "dasspec": {"knobs": {"rounds": 10**9}}}).encode()),
                (C, b'{"prompt": "\\udead"}')]
    specs = [(f"Request {i}: a fox", i % 2 == 1, i % 3 == 0) for i in range(6)]
    expected = []
    for text, chat, streamed in specs:
        ids = chat_ids(model, [{"role": "user", "content": text}]) if chat else model.tokenizer.encode(text)
        expected.append(ar(model, ids, 4).text)
    got: dict[int, str] = {}
    statuses: list[int] = []
    stop = threading.Event()

    def attacker(k: int) -> None:
        while not stop.is_set():
            path, data = hostile[k % len(hostile)]
            statuses.append(post_raw(server, path, data)[0])
            k += 2

    def normal(w: int) -> None:
        for i in range(w, len(specs), 3):
            text, chat, streamed = specs[i]
            if chat:
                out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                                     max_tokens=4, stream=streamed)
                got[i] = "".join(c.choices[0].delta.content or "" for c in out if c.choices) if streamed else \
                    out.choices[0].message.content
            else:
                out = client.completions.create(model="tiny", prompt=text, max_tokens=4, stream=streamed)
                got[i] = "".join(c.choices[0].text for c in out if c.choices) if streamed else out.choices[0].text

    before = errors(server)
    attackers = [threading.Thread(target=attacker, args=(k,)) for k in range(2)]
    users = [threading.Thread(target=normal, args=(w,)) for w in range(3)]
    for t in attackers + users:
        t.start()
    for t in users:
        t.join(120)
    stop.set()
    for t in attackers:
        t.join(60)
    assert not any(t.is_alive() for t in attackers + users)
    assert [got.get(i) for i in range(len(specs))] == expected
    assert statuses and all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert errors(server) == before and server.health()["status"] == "ok"


def test_long_stop_strings_cost_a_scan_per_streamed_chunk_not_a_slice_per_length():
    """A client's 16 stop strings of 60,000 characters made every streamed chunk slice each of them once per
    length (quadratic in the text); the held-back length is the same, found with a few string scans per stop string
    (counted, not timed: a bound on work holds on a loaded machine)."""
    import random

    from dasspec.serve.textstream import _stop_prefix_len

    def reference(text, stops):                 # the definition: longest suffix of text that is a proper prefix
        return max([n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])],
                   default=0)

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3))]
        assert _stop_prefix_len(text, stops) == reference(text, stops), (text, stops)

    scans = [0]                                 # str method calls that scan or compare text (each O(length) in C)

    class Counted(str):
        def endswith(self, *a):
            scans[0] += 1
            return str.endswith(self, *a)

        def rfind(self, *a):
            scans[0] += 1
            return str.rfind(self, *a)

    text = Counted("hello world " * 1500)
    stops = [Counted("q" * 60_000) for _ in range(16)]
    assert _stop_prefix_len(text, stops) == 0
    assert scans[0] <= 2 * len(stops), scans     # the slice-per-length loop made len(text) = 18,000 per stop
