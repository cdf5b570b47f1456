"""``dasspec serve`` end to end: the real server (uvicorn in a subprocess on a free port, a tiny random Huginn-layout
checkpoint with a BPE tokenizer and a chat template) talked to with the real ``openai`` client and, for malformed
requests and disconnects, raw HTTP.

Every answer is compared with ``dasspec.generate(..., method="ar")`` run here on the same checkpoint: completion,
chat (the checkpoint's template), streaming (the concatenated stream equals the non-streamed text), stop strings,
sampling, the ``dasspec`` extension; bad input answered with OpenAI-shaped 4xx errors naming the field; 16
concurrent clients x 4 requests all answered losslessly; the queue bound answering 429; clients that disconnect -
waiting or mid-stream - freeing their slot and stopping their generation, the server answering the next request
correctly.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

import dasspec
from dasspec.methods.auto import ARMS
from dasspec.serve.textstream import IncrementalText
from reference_impl import write_checkpoint, write_tokenizer

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|begin_header|>{{ m['role'] }}<|end_header|>\n\n"
                 "{{ m['content'] }}<|end_turn|>{% endfor %}"
                 "{% if add_generation_prompt %}<|begin_header|>assistant<|end_header|>\n\n{% endif %}")
CONTEXT = 512
LONG = 400                  # tokens of the request kept running while the queue is probed (stopped by a disconnect)
QUEUE = 8                   # the server's --max-queue
BATCH = 4                   # the server's --max-batch
PROMPT = "The quick brown fox"


# --- the server -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tok = write_tokenizer("huginn")
    config = json.loads(tok["tokenizer_config.json"])
    tok["tokenizer_config.json"] = json.dumps({**config, "chat_template": CHAT_TEMPLATE})
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny-huginn", "huginn", vocab_size=320, tokenizer=tok,
                            mean_recurrence=8, config_edits={"block_size": CONTEXT}, drop=("freqs_cis",))


@pytest.fixture(scope="module")
def model(checkpoint):
    return dasspec.load_model(checkpoint, device="cpu")


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def stop(self, timeout: float = 15) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def send(self, path: str, body) -> http.client.HTTPConnection:
        """POST without reading the answer (the caller reads or abandons it)."""
        conn = self.connection()
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        return conn

    def post(self, path: str, body) -> tuple[int, dict, http.client.HTTPMessage]:
        conn = self.send(path, body)
        try:
            r = conn.getresponse()
            return r.status, json.loads(r.read()), r.headers
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, str]:
        conn = self.connection()
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read().decode()
        finally:
            conn.close()

    def health(self) -> dict:
        status, text = self.get("/health")
        assert status == 200, text
        return json.loads(text)

    def metric(self, name: str) -> float:
        """One series of /metrics (name with its labels, as printed), 0 when absent."""
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def log_tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, log: Path, *args: str, wait: float = 120) -> Server:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for _ in range(3):                      # a port taken between free_port() and the bind: try another
        port = free_port()
        out = open(log, "w")
        proc = subprocess.Popen([sys.executable, "-m", "dasspec.cli", "serve", "--model", str(folder), "--port",
                                 str(port), "--threads", "1", "--log-level", "warning", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
        out.close()
        server = Server(proc, port, log)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if server.get("/health")[0] == 200:
                    return server
            except OSError:
                time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            raise AssertionError(f"the server did not come up in {wait:g} s:\n{server.log_tail()}")
        if "address already in use" not in server.log_tail().lower():
            raise AssertionError(f"the server exited with {proc.returncode}:\n{server.log_tail()}")
    raise AssertionError("no free port after 3 tries")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    # A short DAS-Wave schedule (the paper's gamma 32 x 24 rounds costs seconds per request on a random model)
    srv = start_server(checkpoint, tmp_path_factory.mktemp("serve-log") / "server.log", "--method", "das-wave",
                       "--set", "gamma=8", "--set", "rounds=4", "--max-queue", str(QUEUE), "--max-batch", str(BATCH),
                       "--served-model-name", "tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# --- references -------------------------------------------------------------------------------------------------

def chat_ids(model, messages: list[dict]) -> list[int]:
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def ar(model, ids, max_tokens: int, **options) -> dasspec.GenerationResult:
    return dasspec.generate(model, ids, method="ar", max_new_tokens=max_tokens, **options)


def stream_text(chunks, chat: bool = False) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return "".join(c.choices[0].text for c in chunks if c.choices)


# --- answers ------------------------------------------------------------------------------------------------------

def test_models_health_and_completion(server, client, model):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = server.health()
    assert health["method"] == "das-wave"
    from dasspec.model import decode_kernel          # the promise users read: float32 on a CPU is exact
    assert health["exactness"] == decode_kernel.guarantee()
    ids = model.tokenizer.encode(PROMPT)
    ref = ar(model, ids, 12)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12)
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(ref.tokens)
    assert out.choices[0].finish_reason == ("length" if ref.stop_reason == "max_new_tokens" else "stop")
    stats = out.dasspec
    assert stats["method"] == "das-wave" and stats["verifications"] >= 1 and stats["G"] >= 1
    assert stats["sequential_passes"] == stats["prefill_passes"] + stats["draft_passes"] + stats["verify_passes"]
    assert stats["ar_sequential_passes"] == 8 + 8 * (len(ref.tokens) - 1)          # R = 8, prefill + R per token
    # token ids as the prompt, and the OpenAI default of 16 tokens
    assert client.completions.create(model="tiny", prompt=ids).choices[0].text == ar(model, ids, 16).text


def test_a_server_that_names_no_method_decodes_with_auto(checkpoint, model, tmp_path):
    # the default (issue 37): a checkpoint nobody tuned DAS-Wave for is not served at a fraction of AR's speed;
    # every answer is still AR's, and what auto chose is in each response and in /metrics
    srv = start_server(checkpoint, tmp_path / "server.log", "--served-model-name", "tiny")
    try:
        assert srv.health()["method"] == "auto"
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ids = model.tokenizer.encode(PROMPT)
        outs = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12)]
        assert outs[0].choices[0].text == ar(model, ids, 12).text
        sampled = dict(temperature=0.8, top_p=0.9, seed=5)
        outs.append(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, **sampled))
        assert outs[1].choices[0].text == ar(model, ids, 12, do_sample=True, **sampled).text
        messages = [{"role": "user", "content": "Two plus two"}]
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, stream=True))
        assert stream_text(chunks, chat=True) == ar(model, chat_ids(model, messages), 10).text
        arms = (*ARMS, "ar")                             # auto's drafters, and plain steps
        choices = [o.dasspec["choices"] for o in outs]
        assert all(o.dasspec["method"] == "auto" for o in outs) and all(c and set(c) <= set(arms) for c in choices)
        counted = [srv.metric(f'dasspec_auto_steps_total{{method="auto",drafter="{a}"}}') for a in arms]
        assert sum(counted) >= sum(sum(c.values()) for c in choices) + 1        # the chat's steps too
    finally:
        srv.stop()


def test_a_server_with_overlap_answers_with_ar_tokens(checkpoint, model, tmp_path):
    # --overlap: each step planned while the one before runs; four concurrent requests (greedy, sampled, streamed
    # chat, a stop string) get AR's text all the same
    srv = start_server(checkpoint, tmp_path / "server.log", "--served-model-name", "tiny", "--overlap")
    try:
        assert srv.health()["overlap"] is True
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ids = model.tokenizer.encode(PROMPT)
        sampled = dict(temperature=0.8, top_p=0.9, seed=5)
        messages = [{"role": "user", "content": "Two plus two"}]
        with ThreadPoolExecutor(4) as pool:
            greedy = pool.submit(client.completions.create, model="tiny", prompt=PROMPT, max_tokens=14)
            sample = pool.submit(client.completions.create, model="tiny", prompt=PROMPT, max_tokens=14, **sampled)
            chat = pool.submit(lambda: list(client.chat.completions.create(model="tiny", messages=messages,
                                                                           max_tokens=10, stream=True)))
            plain = ar(model, ids, 14).text
            stop = plain[3:6]
            cut = pool.submit(client.completions.create, model="tiny", prompt=PROMPT, max_tokens=14, stop=[stop])
        assert greedy.result().choices[0].text == plain
        assert sample.result().choices[0].text == ar(model, ids, 14, do_sample=True, **sampled).text
        assert stream_text(chat.result(), chat=True) == ar(model, chat_ids(model, messages), 10).text
        assert cut.result().choices[0].text == plain[:plain.index(stop)]
    finally:
        srv.stop()


def test_the_warm_up_leaves_the_servers_auto_drafter_unmeasured(model):
    from dasspec.serve.service import ServeOptions, Service
    service = Service(model, ServeOptions(model_name="tiny"))
    try:
        service.warmup()
        d = service.drafter("auto", {})
        assert d.budget.elapsed == 0.0 and d.last is None and not d.priors.table
    finally:
        service.close()


def test_health_states_the_promise_of_the_servers_runtime(model):
    """--static-shapes and --compile leave dasspec's kernels (fixed-shape attention, compiled products): /health
    must not promise their bits then."""
    from dasspec.model import decode_kernel
    from dasspec.serve.service import ServeOptions, Service
    if not decode_kernel.available():
        pytest.skip("without the kernels every runtime states torch's promise")
    for runtime, want in ((None, decode_kernel.GUARANTEE_KERNELS),
                          (dasspec.Runtime(static_shapes=True), decode_kernel.GUARANTEE_STATIC),
                          (dasspec.Runtime(compile=True), decode_kernel.GUARANTEE_STATIC)):
        service = Service(model, ServeOptions(model_name="tiny", runtime=runtime))
        try:
            body, _ = asyncio.run(service.health())             # what GET /health answers
            assert body["exactness"] == want
        finally:
            service.close()


def test_chat_uses_the_checkpoint_template(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two"}]
    ids = chat_ids(model, messages)
    assert model.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|begin_text|><|begin_header|>system")
    ref = ar(model, ids, 10)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ids)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Two plus "}, {"type": "text", "text": "two"}]}]
    out = client.chat.completions.create(model="tiny", messages=parts, max_completion_tokens=10)
    assert out.choices[0].message.content == ar(model, chat_ids(model, [messages[1]]), 10).text


def test_streams_equal_the_non_streamed_text(server, client, model):
    ids = model.tokenizer.encode(PROMPT)
    ref = ar(model, ids, 24)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}))
    assert stream_text(chunks) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == len(ref.tokens) and not chunks[-1].choices
    messages = [{"role": "user", "content": "A looped transformer"}]
    ref = ar(model, chat_ids(model, messages), 24)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert stream_text(chunks, chat=True) == ref.text
    # the wire format: server-sent events, OpenAI's chunk objects, a final [DONE]
    conn = server.send("/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "stream": True})
    r = conn.getresponse()
    body = r.read().decode()
    conn.close()
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_stop_strings(client, model):
    ids = model.tokenizer.encode(PROMPT)
    free = ar(model, ids, 30).text
    # a piece of the text that first occurs after a few characters (not U+FFFD: that is an undecodable byte)
    k, n = next((k, n) for n in (2, 1) for k in range(3, len(free) - n)
                if "\ufffd" not in free[k: k + n] and free.find(free[k: k + n]) == k)
    stop = free[k: k + n]
    ref = ar(model, ids, 30, stop=[stop])
    assert ref.text == free[:k] and ref.stop_reason == "stop_string"
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, stop=stop)
    assert out.choices[0].text == free[:k] and out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, stop=["\x00never", stop],
                                       stream=True)
    assert stream_text(chunks) == free[:k]
    # a text that ends with the start of a stop string never completed: held back while streaming, sent at the end
    tokens = ar(model, ids, 30).tokens
    m = next(m for m in range(30, 0, -1) if model.tokenizer.decode(tokens[:m])[-1:] not in ("", "\ufffd"))
    text = model.tokenizer.decode(tokens[:m])
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=m, stop=text[-1] + "\x00", stream=True)
    assert stream_text(chunks) == text


def test_sampling_and_method_options(client, model):
    ids = model.tokenizer.encode(PROMPT)
    ref = ar(model, ids, 12, do_sample=True, temperature=0.8, top_p=0.9, seed=5)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, seed=5)
    assert out.choices[0].text == ref.text
    assert ref.text != ar(model, ids, 12, do_sample=True, temperature=0.8, top_p=0.9, seed=6).text
    only_top_p = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, top_p=0.95, seed=2)
    assert only_top_p.choices[0].text == ar(model, ids, 12, do_sample=True, temperature=1.0, top_p=0.95, seed=2).text
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, top_p=0.5)
    assert greedy.choices[0].text == ar(model, ids, 12).text
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                    extra_body={"dasspec": {"method": "pld", "knobs": {"num_pred": 3}}})
    assert out.choices[0].text == ar(model, ids, 12).text
    assert out.dasspec["method"] == "pld" and out.dasspec["knobs"]["num_pred"] == 3


def test_metrics(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8)
    text = server.get("/metrics")[1]
    for name in ("dasspec_requests_total", "dasspec_prompt_tokens_total", "dasspec_generated_tokens_total",
                 "dasspec_queue_length", "dasspec_running_requests", "dasspec_batch_size", "dasspec_step_seconds",
                 "dasspec_generation_tokens_per_second", "dasspec_accepted_tokens_per_verification",
                 "dasspec_committed_tokens_per_verification", "dasspec_time_to_first_token_seconds",
                 "dasspec_time_per_token_seconds"):
        assert f"# TYPE {name} " in text
    assert server.metric('dasspec_requests_total{endpoint="completions",outcome="ok"}') >= 1
    assert server.metric('dasspec_committed_tokens_per_verification_count{method="das-wave"}') >= 1
    assert server.metric("dasspec_queue_length") == 0
    assert server.metric("dasspec_batch_size_count") >= 1 and server.metric("dasspec_generation_tokens_per_second") > 0


# --- bad input ----------------------------------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [   # (path, body, status, param, words the message must contain)
    (C, b'{"prompt": "x",', 400, None, "not valid JSON"),
    (C, b'["x"]', 400, None, "JSON object"),
    (C, {"max_tokens": 4}, 400, "prompt", "required"),
    (C, {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown field"),
    (C, {"prompt": "x", "n": 2}, 400, "n", "n = 1"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "only with logprobs"),
    (C, {"prompt": "x", "max_tokens": CONTEXT}, 400, "max_tokens", "context"),
    (C, {"prompt": "x", "dasspec": {"method": "nope"}}, 400, "dasspec.method", "unknown method 'nope'"),
    (C, {"prompt": "x", "dasspec": {"knobs": {"gamam": 3}}}, 400, "dasspec.knobs", "gamam"),
    (C, {"prompt": "x", "dasspec": {"method": "das-wave", "knobs": {"gamma": -1}}}, 400, "dasspec.knobs", "gamma"),
    (C, {"prompt": "x", "dasspec": {"method": "sam", "knobs": {"static_corpus": "/etc/passwd"}}}, 400,
     "dasspec.knobs.static_corpus", "--set"),
    (C, {"prompt": "x", "dasspec": {"exit_threshold": 0.5}}, 400, "dasspec.exit_threshold", "early-exit gate"),
    (C, {"prompt": "x", "dasspec": {"exit_at_step": 1}}, 400, "dasspec.exit_at_step", "early-exit gate"),
    (C, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", "integer"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature", "greater than"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p", "greater than"),
    (C, {"prompt": "x", "stop": 5}, 400, "stop", "string"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    (C, {"prompt": "x", "seed": 1.5}, 400, "seed", "integer"),
    (C, {"prompt": ["a", "b"], "stream": True}, 400, "prompt", "several prompts"),
    (C, {"prompt": [99999]}, 400, "prompt", "vocabulary"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    (CHAT, {"messages": "hi"}, 400, "messages", "list"),
    (CHAT, {"messages": []}, 400, "messages", "at least 1"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400,
     "messages[0].content", "text"),
    (CHAT, {"messages": MSG, "tools": []}, 400, "tools", "unknown field"),
]


@pytest.mark.parametrize("path, body, status, param, words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_refused_with_the_field(server, path, body, status, param, words):
    got, answer, _ = server.post(path, body)
    assert got == status, answer
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert words in err["message"], err["message"]
    if param:
        assert param.split(".")[-1].split("[")[0] in err["message"]


def test_bad_input_through_the_client_then_still_serving(server, client, model):
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=4)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    assert out.choices[0].text == ar(model, model.tokenizer.encode(PROMPT), 6).text
    assert server.health()["status"] == "ok"


# --- load, the queue bound, disconnects ----------------------------------------------------------------------------

def test_lossless_under_load(server, client, model):
    """16 concurrent clients x 4 requests (completions and chat, streamed or not, greedy or sampled): every answer
    equals AR's for its own prompt; a 429 (queue full: 8 slots) is retried; none is lost."""
    specs = []
    for i in range(64):
        chat, streamed, sampled = i % 2 == 1, i % 4 >= 2, i % 8 >= 6
        options = {"temperature": 0.7, "seed": i} if sampled else {}
        specs.append((f"Request {i}: the quick brown fox", chat, streamed, options))
    expected = []
    for text, chat, _, options in specs:
        ids = chat_ids(model, [{"role": "user", "content": text}]) if chat else model.tokenizer.encode(text)
        sampling = {"do_sample": True, "temperature": 0.7, "seed": options["seed"]} if options else {}
        expected.append(ar(model, ids, 4, **sampling).text)
    assert len(set(expected)) >= 32                       # mostly distinct answers, so a mix-up shows

    got: dict[int, str] = {}
    rejected = [0]
    lock = threading.Lock()
    start = threading.Barrier(16)

    def one(i: int) -> str:
        text, chat, streamed, options = specs[i]
        for attempt in itertools.count():
            try:
                if chat:
                    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                                         max_tokens=4, stream=streamed, **options)
                    return stream_text(out, chat=True) if streamed else out.choices[0].message.content
                out = client.completions.create(model="tiny", prompt=text, max_tokens=4, stream=streamed, **options)
                return stream_text(out) if streamed else out.choices[0].text
            except openai.RateLimitError:
                with lock:
                    rejected[0] += 1
                time.sleep(min(0.4, 0.05 * 2 ** attempt) * random.uniform(0.5, 1))   # back off, not hammer

    def worker(w: int) -> None:
        start.wait()
        for i in range(w, 64, 16):
            text = one(i)
            with lock:
                got[i] = text

    before = server.metric('dasspec_requests_total{endpoint="completions",outcome="rejected"}') + \
        server.metric('dasspec_requests_total{endpoint="chat",outcome="rejected"}')
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads)
    assert [got.get(i) for i in range(64)] == expected
    after = server.metric('dasspec_requests_total{endpoint="completions",outcome="rejected"}') + \
        server.metric('dasspec_requests_total{endpoint="chat",outcome="rejected"}')
    assert after - before == rejected[0]                   # every 429 the clients saw is one the server counted
    assert server.health()["status"] == "ok"


def read_first_event(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
    r = conn.getresponse()
    assert r.status == 200
    while not r.fp.readline().startswith(b"data: "):
        pass
    return r


def hang_up(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)      # the FIN goes out now, whatever else still holds the socket
    sock.close()


def wait_for(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_queue_bound_and_disconnects(server, client, model):
    """Long streams fill the batch (decoded together); waiting requests fill the queue's slots; the next is refused
    with 429 at once.  The waiting clients hang up: their slots free while the streams still decode.  The streaming
    clients hang up: their generations stop early.  The request queued behind them is answered correctly."""
    cancelled = 'dasspec_requests_total{endpoint="completions",outcome="cancelled"}'
    ar_tokens = 'dasspec_generated_tokens_total{method="ar"}'
    before_cancelled, before_ar = server.metric(cancelled), server.metric(ar_tokens)
    long = {"prompt": PROMPT, "max_tokens": LONG, "dasspec": {"method": "ar"}}
    streams = [server.send(C, {**long, "stream": True}) for _ in range(BATCH)]
    stream_socks = [conn.sock for conn in streams]
    for conn in streams:
        read_first_event(conn)                           # every stream is decoding
    assert server.health()["running"] == BATCH
    waiting = [server.send(C, long).sock for _ in range(QUEUE)]
    wait_for(lambda: server.health()["queue_length"] == QUEUE, "a full queue")
    status, answer, headers = server.post(C, {"prompt": PROMPT, "max_tokens": 4})
    assert status == 429 and answer["error"]["type"] == "rate_limit_error" and headers["Retry-After"]
    for sock in waiting:
        hang_up(sock)
    wait_for(lambda: server.health()["queue_length"] == 0, "the hung-up requests to leave the queue")
    assert server.health()["running"] == BATCH, f"a {LONG}-token stream ended before the test could hang up"
    assert server.metric("dasspec_batch_size_count") > server.metric('dasspec_batch_size_bucket{le="2"}')

    ids = model.tokenizer.encode("Two plus two")
    result = {}
    behind = threading.Thread(target=lambda: result.update(
        out=client.completions.create(model="tiny", prompt="Two plus two", max_tokens=8)))
    behind.start()
    wait_for(lambda: server.health()["queue_length"] == 1, "the next request to queue")
    for sock in stream_socks:
        hang_up(sock)
    behind.join(60)
    assert result["out"].choices[0].text == ar(model, ids, 8).text
    wait_for(lambda: server.metric(cancelled) == before_cancelled + QUEUE + BATCH, "the cancelled requests in /metrics")
    generated = server.metric(ar_tokens) - before_ar
    assert BATCH <= generated < BATCH * LONG, generated   # the hung-up streams stopped early
    wait_for(lambda: server.health()["running"] == 0, "the worker to go idle")
    assert server.health()["status"] == "ok" and server.health()["queue_length"] == 0


# --- streamed text, unit -------------------------------------------------------------------------------------------

def test_incremental_text_holds_back_split_characters_and_stop_prefixes(model):
    tok = model.tokenizer
    c3, a9 = tok.token_to_id("Ã"), tok.token_to_id("©")      # byte-level tokens of the two bytes of "é"
    inc = IncrementalText(tok.decode)
    assert tok.decode([c3, a9]) == "é" and inc.feed([c3]) == "" and inc.feed([a9]) == "é"
    chars = IncrementalText(lambda ids: "".join(map(chr, ids)), ["abc"])
    feed = lambda s: chars.feed([ord(ch) for ch in s])        # noqa: E731
    assert feed("xa") == "x"            # "a" may begin "abc"
    assert feed("bd") == "abd"          # it did not
    assert feed("ab") == ""
    assert feed("cz") == ""             # "abc" arrived: nothing from it on is text
    assert chars.finish("xabd") == ""
    assert IncrementalText(lambda ids: "x\ufffd\ufffd" if ids else "").feed([1]) == "x"


def test_a_request_without_max_tokens_gets_openais_default():
    """Without max_tokens a chat may run to the end of the context (OpenAI's rule: the paged cache holds only what
    is written), a completion gets OpenAI's 16; both within the room left and the server's cap."""
    from types import SimpleNamespace

    from dasspec.serve.schema import ChatRequest, CompletionRequest
    from dasspec.serve.service import Service

    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    completion = CompletionRequest.model_validate({"prompt": "hi"})

    def limit(req, P, endpoint, context=4096, cap=None):
        service = SimpleNamespace(context=context, options=SimpleNamespace(max_tokens_cap=cap))
        return Service._max_tokens(service, req, P, endpoint)

    assert limit(chat, 10, "chat") == 4096 - 10
    assert limit(completion, 10, "completions") == 16
    assert limit(chat, 4090, "chat") == 6                       # the room left
    assert limit(chat, 10, "chat", cap=100) == 100              # the server's cap


def test_unseeded_sampled_requests_draw_their_own_seed(client, model):
    """Two users sending the same prompt at temperature 0.8 without a seed get independent draws; each response
    names its seed, and sending it back reproduces the answer (= AR sampling at that seed).  Greedy requests decode
    with seed 0 (the seed cannot matter)."""
    ids = model.tokenizer.encode(PROMPT)
    outs = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.8) for _ in range(3)]
    seeds = [o.dasspec["seed"] for o in outs]
    assert len(set(seeds)) == 3 and all(isinstance(s, int) and s >= 0 for s in seeds)
    for out, seed in zip(outs, seeds):
        assert out.choices[0].text == ar(model, ids, 12, do_sample=True, temperature=0.8, seed=seed).text
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.8, seed=seeds[0])
    assert again.choices[0].text == outs[0].choices[0].text and again.dasspec["seed"] == seeds[0]
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4).dasspec["seed"] == 0


def test_requests_that_start_alike_share_prompt_blocks(client, model):
    """Automatic prefix sharing through the server: a second request with the same long prefix takes its prompt
    blocks from the first (dasspec.cached_tokens) and still answers exactly AR."""
    head = (PROMPT + " ") * 8
    first = client.completions.create(model="tiny", prompt=head + "A", max_tokens=6)
    second = client.completions.create(model="tiny", prompt=head + "B", max_tokens=6)
    ids = model.tokenizer.encode(head + "B")
    assert second.choices[0].text == ar(model, ids, 6).text
    assert second.dasspec["cached_tokens"] >= 16 and first.choices[0].text == ar(
        model, model.tokenizer.encode(head + "A"), 6).text


def test_an_ouro_checkpoint_is_served_with_its_chat_template(tmp_path):
    """Issue 30: `dasspec serve --model OURO` answers chats in the checkpoint's ChatML template, each reply ending
    at <|im_end|> and equal to Ouro's own AR decode - for the default target and an exit_threshold target, streamed
    and not - with the family's default method (DAS-Wave and Ouro's knobs) decoding the batch."""
    from reference_impl import write_ouro_checkpoint, write_tokenizer

    folder = write_ouro_checkpoint(tmp_path / "ouro", vocab_size=320, seed=3, tokenizer=write_tokenizer("ouro"))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    model = dasspec.load_model(folder, device="cpu")
    assert model.tokenizer.token_to_id("<|im_end|>") in model.tokenizer.eos_ids
    srv = start_server(folder, tmp_path / "server.log", "--max-batch", "4")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [[{"role": "user", "content": text}] for text in ("Hi there", "The loop reads twice", "ok")]
        targets = ({}, {"exit_threshold": 0.6})
        jobs = [(m, t, stream) for m in messages for t in targets for stream in (False, True)]
        got = [None] * len(jobs)

        def ask(i):
            m, target, stream = jobs[i]
            extra = {"extra_body": {"dasspec": target}} if target else {}
            out = client.chat.completions.create(model=folder.name, messages=m, max_tokens=12, stream=stream,
                                                 **extra)
            got[i] = stream_text(out, chat=True) if stream else out.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (m, target, _), text in zip(jobs, got):
            assert text == ar(model, chat_ids(model, m), 12, **target).text, (m, target)
    finally:
        srv.stop()


def test_a_failed_step_still_answers_every_request_it_touched(monkeypatch):
    """The decode worker, in process: a step that raises after it had finished a request (one cancelled while it
    waited for a batch slot) fails the running ones and still delivers the finished one's end - nobody waits
    forever, the worker's counts come back to zero and no request is left in the engine's table."""
    import asyncio

    import dasspec.engine.core.executor as engine_mod
    from dasspec.engine.api.engine import Engine
    from dasspec.serve.worker import Cancelled, Done, DecodeWorker, Failed, Job
    from dasspec.testing import random_model

    model = random_model("huginn", seed=4, mean_recurrence=3, n_prelude=1, n_core=1, n_coda=1)
    engine = Engine(model, "pld", max_batch=2)
    real, calls = engine_mod.loop_step, []
    jobs = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            engine.cancel(jobs[2].rid)          # waiting: it ends at the start of the next step, which then fails
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "loop_step", flaky)

    async def main():
        loop = asyncio.get_running_loop()
        worker = DecodeWorker(engine, max_queue=2)
        drafter = engine.drafter("pld")
        for prompt in ([5, 6, 7, 8], [9, 10, 11], [12, 13]):
            jobs.append(Job(loop, prompt, drafter, {"max_new_tokens": 40, "eos": False}, "completions",
                            stream=False))
        for job in jobs:
            worker.submit(job)

        async def last(job):
            while True:
                ev = await job.events.get()
                if isinstance(ev, (Done, Failed, Cancelled)):
                    return ev

        ends = await asyncio.wait_for(asyncio.gather(*(last(j) for j in jobs)), 60)
        counts = worker.queue_length, worker.running
        worker.close()
        return ends, counts

    (a, b, c), counts = asyncio.run(main())
    assert isinstance(a, Failed) and isinstance(b, Failed) and "boom" in str(a.error)
    assert isinstance(c, Cancelled)
    assert counts == (0, 0)
    assert not engine._table and not engine._results
