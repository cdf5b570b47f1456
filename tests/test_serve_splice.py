"""Failover splicing (dasspec/serve/splice.py, used by the Ray Serve ingress): a re-run's text continues the stream
only while its token ids are the ones the stream came from.  Unit tests of the splice on real decodes of the bundled
model - a float32 replica's answer, the same answer re-run, and a bfloat16 replica's answer, which leaves the float32
one at token 14 of this prompt (what "another replica's hardware or dtype" looks like) - streamed as a replica
streams them (``IncrementalText``).  Not through Ray: making a live replica decode differently would need a
deployment whose replicas differ, which the application does not offer; test_serve_ray.py covers the real
failover of identical replicas.  The ingress's own failover loop runs here over HTTP: ``ClusterService`` behind the
real app on 127.0.0.1, the real ``openai`` client, and a scripted deployment handle in place of Ray's whose first
replica dies mid-stream and whose second decodes the same answer or the bfloat16 one."""

from __future__ import annotations

import pytest
import torch

import dasspec
from dasspec.serve.splice import Diverged, Splice
from dasspec.serve.textstream import IncrementalText

PROMPT = "def fibonacci(n):"
N = 40


@pytest.fixture(scope="module")
def answers():
    """(float32 ids, text), (bfloat16 ids, text) of PROMPT, and where they first differ."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        model = dasspec.load_model(dtype=dtype)
        r = dasspec.generate(model, model.tokenizer.encode(PROMPT), "ar", max_new_tokens=N, eos=False)
        out.append((r.tokens, r.text))
    (a, _), (b, _) = out
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    assert first is not None and 4 < first < N - 8, first       # the data this test needs: a shared start
    return out[0], out[1], first, model.tokenizer.decode


def _attempt(ids, text, decode, chunk: int, dies_after: int | None = None):
    """A replica's events for one attempt: (text, ids) chunks of ``chunk`` tokens, then (tail, all ids) when it
    finishes; only the first ``dies_after`` chunks when its replica dies."""
    inc = IncrementalText(decode)
    chunks = []
    for i in range(0, len(ids), chunk):
        part = ids[i: i + chunk]
        chunks.append((inc.feed(part), part))
    if dies_after is not None:
        return chunks[:dies_after], None
    return chunks, (inc.finish(text), ids)


def _stream(splice: Splice, attempts) -> str:
    """What the client receives over the attempts (the ingress's loop)."""
    got = []
    for chunks, done in attempts:
        splice.restart()
        for text, ids in chunks:
            got.append(splice.chunk(text, ids))
        if done is not None:
            got.append(splice.done(*done))
    return "".join(got)


def test_a_rerun_that_decodes_the_same_continues_the_stream_exactly(answers):
    (ids, text), _, first, decode = answers
    for dies_after in (1, 3, 7):
        s = Splice(stream=True)
        got = _stream(s, [_attempt(ids, text, decode, 4, dies_after), _attempt(ids, text, decode, 3)])
        assert got == text


def test_a_rerun_that_decodes_differently_ends_the_stream_instead_of_splicing(answers):
    """The float32 replica dies after streaming past token ``first``; the re-run (bfloat16) commits another token
    there: the splice raises before handing the client any of the re-run's text past what it had, and what the
    client has is a prefix of the first attempt's answer - never one answer's prefix and another's suffix."""
    (ids, text), (other, other_text), first, decode = answers
    s = Splice(stream=True)
    got = []
    with pytest.raises(Diverged, match=f"token {first}"):
        for chunks, done in [_attempt(ids, text, decode, 4, first // 4 + 2), _attempt(other, other_text, decode, 3)]:
            s.restart()
            for t, i in chunks:
                got.append(s.chunk(t, i))
            if done is not None:
                got.append(s.done(*done))
    assert text.startswith("".join(got)) and len("".join(got)) == s.sent
    # the same when the re-run's chunks reach the difference only in its final answer (the tail and all ids)
    s = Splice(stream=True)
    with pytest.raises(Diverged):
        _stream(s, [_attempt(ids, text, decode, 4, first // 4 + 2), ([], (other_text[len(text):], other))])


def test_a_rerun_that_differs_only_past_what_was_streamed_is_streamed_whole(answers):
    """The first replica died before the answers part: the client has a prefix both share, so the re-run's answer
    is a consistent whole (no splice of two trajectories) and is streamed to its end."""
    (ids, text), (other, other_text), first, decode = answers
    s = Splice(stream=True)
    assert _stream(s, [_attempt(ids, text, decode, 2, 1), _attempt(other, other_text, decode, 3)]) == other_text


def test_a_non_streamed_answer_is_taken_whole_from_the_attempt_that_finishes(answers):
    (ids, text), (other, other_text), first, decode = answers
    s = Splice(stream=False)
    s.restart()
    for t, i in _attempt(ids, text, decode, 4, first // 4 + 2)[0]:
        s.chunk(t, i)
    s.restart()
    chunks, done = _attempt(other, other_text, decode, 3)
    for t, i in chunks:
        s.chunk(t, i)
    s.done(*done)                                         # no error: nothing was sent to splice onto


def test_a_clusters_health_states_its_replicas_promise_and_names_a_difference():
    """A cluster's /health must not state one replica's promise for all: a node whose kernels did not build (or a
    GPU beside CPUs) keeps a weaker one, and a failover onto it may end a stream in an error event."""
    from dasspec.model import decode_kernel
    from dasspec.serve.ray_app import cluster_promise
    strong, weak = decode_kernel.GUARANTEE_KERNELS, decode_kernel.GUARANTEE_TORCH
    assert cluster_promise([strong, strong]) == strong
    assert cluster_promise([]) is None                                # no replica answering
    unknown = cluster_promise([strong, None])                         # one that states nothing (an older version)
    assert unknown.startswith("replicas differ") and "unknown" in unknown
    mixed = cluster_promise([strong, weak, strong])
    assert mixed.startswith("replicas differ") and strong in mixed and weak in mixed


# --- the ingress's failover over HTTP: a real server on 127.0.0.1, the real openai client, a scripted replica handle


class _Events:
    """One attempt's event stream, as a Ray Serve streaming call yields it (``cancel`` as its response has)."""

    def __init__(self, events, dies: bool):
        self.events, self.dies, self.cancelled = events, dies, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for ev in self.events:
            yield ev
        if self.dies:
            raise RuntimeError("the replica's actor died")      # what the ingress treats as a lost replica

    def cancel(self):
        self.cancelled = True


class _Handle:
    """A deployment handle whose replicas run scripted attempts, in order (one per ``generate`` call)."""

    def __init__(self, attempts):
        self.attempts, self.calls = list(attempts), []

    def options(self, method_name: str, stream: bool = False):
        handle = self

        class _Call:
            def remote(self, *args, **kw):
                handle.calls.append(method_name)
                if method_name != "generate":
                    raise RuntimeError("not scripted")
                events, dies = handle.attempts.pop(0)
                return _Events(events, dies)
        return _Call()


def _replica_events(rid: str, ids, text, decode, chunk: int, dies_after: int | None) -> tuple[list, bool]:
    chunks, done = _attempt(ids, text, decode, chunk, dies_after)
    evs = [{"replica": rid, "pid": 1}, {"started": 0.0}]
    evs += [{"text": t, "tokens": len(part), "ids": part} for t, part in chunks]
    if done is not None:
        evs.append({"done": {"text": text, "tokens": list(ids), "stop_reason": "max_new_tokens", "tail": done[0],
                             "cancelled": False, "stats": {}}})
    return evs, done is None


@pytest.mark.parametrize("rerun", ["same", "other"])
def test_a_failover_over_http_continues_the_stream_or_ends_it_with_an_error(answers, rerun):
    """The ingress (``ClusterService`` behind ``create_app``) streams a replica's answer, the replica dies past
    the point where a bfloat16 replica's decode leaves the float32 one, and the request is re-run: a re-run that
    decodes the same continues the client's stream to the whole answer (failover "resumed"); one that decodes
    otherwise ends it with an error event (failover "diverged") and the client never gets a spliced answer."""
    import socket
    import threading
    import time
    import urllib.request

    import openai
    import uvicorn

    from dasspec.serve.app import create_app
    from dasspec.serve.ray_app import ClusterOptions, ClusterService

    (a_ids, a_text), (b_ids, b_text), first, decode = answers
    cut = first // 2 + 2                     # chunks of 2 tokens: the replica dies having streamed past ``first``
    again = (a_ids, a_text) if rerun == "same" else (b_ids, b_text)
    handle = _Handle([_replica_events("r1", a_ids, a_text, decode, 2, cut),
                      _replica_events("r2", *again, decode, 2, None)])
    model = dasspec.load_model()
    service = ClusterService(handle, model.tokenizer, model.config.block_size, model.config.vocab_size,
                             ClusterOptions(server={"model_name": "tiny"}).check())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))                  # bound here and handed to the server: no other process takes it
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        got, error = [], None
        try:
            for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, stream=True):
                got.append(c.choices[0].text if c.choices else "")
        except openai.APIError as err:
            error = err
        text = "".join(got)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            metrics = r.read().decode()
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        service.close()
    assert handle.calls.count("generate") == 2          # (/metrics asks the replicas too: not scripted here)
    if rerun == "same":
        assert error is None and text == a_text
        assert 'dasspec_failovers_total{outcome="resumed"} 1' in metrics
    else:
        assert error is not None and "decoded differently" in str(error), (error, text)
        assert a_text.startswith(text) and len(text) < len(a_text)     # the first attempt's prefix, never spliced
        assert 'dasspec_failovers_total{outcome="diverged"} 1' in metrics
