"""``dasspec serve --ray`` (issue 36) on a real local Ray instance started here (127.0.0.1, 3 logical CPUs, torch
at one thread per replica), with two replicas of the bundled model behind the Ray Serve ingress, talked to with the
real ``openai`` client.

Every answer is compared with ``dasspec.generate(model, ids, method="ar", ...)`` run here: every method, greedy and
sampled (a sampled request without a seed gets one from the ingress, returned in ``dasspec.seed``), streamed and
not; requests spread over both replicas; requests sharing a prompt prefix stay on one replica; /health and /metrics
add the replicas up; and a replica killed (SIGKILL) in the middle of streamed answers costs no client a character:
every text equals its AR decode.  The kill test runs last (the replica it kills restarts in the background).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import dasspec  # noqa: E402
from dasspec.methods.auto import ARMS  # noqa: E402
from dasspec.serve.ray_app import build_app, local_ray_env, merge_metrics, start_serve  # noqa: E402
from dasspec.serve.routing import HashRing, prefix_key  # noqa: E402

MODULE_LIMIT_S = 2400          # the whole module, Ray's start included: past it the process dumps its stacks and exits
START_LIMIT_S = 600            # for the Serve proxy, then for both replicas (a loaded CI machine is slow, not broken)
METHODS = ["ar", "das-wave", "self-spec", "mature-spec", "pld", "lookahead", "token-recycling", "sam"]
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "Q: What is 3 + 4?\nA:", "for i in range(",
           "def add(a, b):", "x = [", "The answer is"]
SAMPLE = {"temperature": 0.8, "top_p": 0.9}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def health(self) -> dict:
        return json.loads(self.get("/health")[1])

    def served(self) -> dict[str, int]:
        """Requests each live replica has answered (its own counter)."""
        return {r["replica"]: r["requests"] for r in self.health()["replicas"] if r["status"] == "ok"}

    def metric(self, series: str) -> float:
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="module")
def cluster():
    faulthandler.dump_traceback_later(MODULE_LIMIT_S, exit=True)
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
             configure_logging=False, runtime_env=local_ray_env(), _node_ip_address="127.0.0.1")
    try:
        for attempt in range(3):     # a port found free can be taken (by Ray's own workers) before the proxy binds it
            port = free_port()
            try:
                start_serve(serve, {"host": "127.0.0.1", "port": port}, START_LIMIT_S)   # patient with a loaded host
                break
            except ray.exceptions.RayTaskError as err:
                if "Failed to bind" not in str(err) or attempt == 2:
                    raise
                serve.shutdown()
        serve.run(build_app({"replicas": 2, "num_cpus": 1, "threads": 1, "max_batch": 4, "max_queue": 16,
                             "max_failovers": 3}), name="dasspec", route_prefix="/")
        c = Cluster(port)
        deadline = time.monotonic() + START_LIMIT_S
        while True:                                    # both replicas up and answering
            try:
                if len(c.served()) >= 2:
                    break
                seen = c.health()
            except (OSError, ValueError) as err:       # the proxy not listening yet, or the app not deployed
                seen = err
            assert time.monotonic() < deadline, f"both replicas were not answering after {START_LIMIT_S} s: {seen}"
            time.sleep(0.5)
        yield c
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model():
    return dasspec.load_model()


def ar(model, ids, n: int, seed: int = 0, sampled: bool = False) -> str:
    options = dict(do_sample=True, **SAMPLE) if sampled else {}
    return dasspec.generate(model, ids, method="ar", max_new_tokens=n, seed=seed, **options).text


def stream_text(chunks) -> tuple[str, dict | None, list[float]]:
    """The streamed text, the final chunk's ``dasspec`` object and the arrival time of each text chunk."""
    text, stats, times = [], None, []
    for c in chunks:
        if c.choices and c.choices[0].text:
            text.append(c.choices[0].text)
            times.append(time.monotonic())
        stats = getattr(c, "dasspec", None) or stats
    return "".join(text), stats, times


# --- the pure parts ------------------------------------------------------------------------------------------------

def test_prefix_key_and_bounded_consistent_hashing():
    a, b = list(range(40)) + [1, 2], list(range(40)) + [3]
    assert prefix_key(a, 32) == prefix_key(b, 32) != prefix_key([7] + a[1:], 32)
    assert prefix_key(list(range(32)), 32) is None            # nothing after the prefix
    ring = HashRing(["r1", "r2", "r3"])
    homes = {ring.choose(f"k{i}", {}) for i in range(60)}
    assert homes == {"r1", "r2", "r3"}                        # keys spread over every member
    key = "k0"
    home = ring.choose(key, {})
    assert ring.choose(key, {"r1": 1, "r2": 1, "r3": 1}) == home    # under ceil(1.25 x 4 / 3) = 2: stays home
    assert ring.choose(key, {home: 9}) != home                # over ceil(1.25 x (9 + 1) / 3) = 5: passed over
    assert ring.choose(key, {home: 9}, floor=10) == home      # under the floor (free batch slots): stays home
    assert HashRing(["r1", "r2"]).order(key)[0] in ("r1", "r2")
    # a member leaving moves only its own keys
    smaller = HashRing(["r1", "r2"])
    moved = [k for k in (f"k{i}" for i in range(60)) if ring.choose(k, {}) != "r3" and
             smaller.choose(k, {}) != ring.choose(k, {})]
    assert not moved


def test_metrics_are_added_up_series_by_series():
    one = ("# HELP x_total X\n# TYPE x_total counter\nx_total{a=\"1\"} 2\nx_total{a=\"2\"} 1\n"
           "# HELP q Q\n# TYPE q gauge\nq 3\n")
    two = "# HELP x_total X\n# TYPE x_total counter\nx_total{a=\"1\"} 5\n# HELP q Q\n# TYPE q gauge\nq 0.5\n"
    merged = merge_metrics([one, two])
    assert 'x_total{a="1"} 7' in merged and 'x_total{a="2"} 1' in merged and "q 3.5" in merged
    assert merged.count("# TYPE x_total counter") == 1


def test_the_application_takes_serve_run_arguments():
    """``serve run dasspec.serve.ray_app:build_app replicas=2 ...`` passes strings; a config file passes YAML
    values; both become the deployments' options (nothing is started here)."""
    app = build_app({"replicas": "2", "max_batch": "4", "max_queue": "3", "routing": "least-loaded",
                     "num_gpus": "1", "spill_at": "3", "request_timeout": "30"})
    ingress = app._bound_deployment
    replica = ingress.init_args[0]._bound_deployment
    assert replica.num_replicas == 2 and replica.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert replica.max_ongoing_requests == 4 + 3 + 4                # batch + queue + control slots
    kwargs = replica._deployment_config.request_router_config.request_router_kwargs
    assert kwargs == {"prefix_tokens": 32, "load_factor": 1.25, "policy": "least-loaded", "spill_at": 3}
    assert ingress.init_args[1]["server"] == {"max_batch": 4, "max_queue": 3, "request_timeout": 30.0}
    auto = build_app({"autoscaling": {"min_replicas": 1, "max_replicas": 4}})._bound_deployment.init_args[0]
    assert auto._bound_deployment._deployment_config.autoscaling_config.max_replicas == 4
    for bad in ({"routing": "nope"}, {"replicas": 0}, {"bogus": 1}):
        with pytest.raises(ValueError):
            build_app(bad)


# --- answers through the cluster -----------------------------------------------------------------------------------

def test_every_method_greedy_and_sampled_equals_ar(cluster, client, model):
    tok = model.tokenizer
    cases = [(m, sampled, i) for i, (m, sampled) in enumerate((m, s) for m in METHODS for s in (False, True))]

    def ask(case):
        method, sampled, i = case
        prompt, n = PROMPTS[i % len(PROMPTS)], 12 + i % 5
        extra = {"extra_body": {"dasspec": {"method": method}}}
        seed = None
        if sampled:
            extra.update(SAMPLE)
            if i % 4 != 1:                          # some without a seed: the ingress draws and returns one
                seed = 100 + i
                extra["seed"] = seed
        if i % 3 == 0:
            text, stats, _ = stream_text(client.completions.create(model="dasspec-tiny", prompt=prompt,
                                                                   max_tokens=n, stream=True, **extra))
        else:
            out = client.completions.create(model="dasspec-tiny", prompt=prompt, max_tokens=n, **extra)
            text, stats = out.choices[0].text, out.dasspec
        return case, prompt, n, seed, text, stats

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, cases))
    drawn = set()
    for (method, sampled, i), prompt, n, seed, text, stats in answers:
        assert stats["method"] == method
        if sampled and seed is None:
            drawn.add(stats["seed"])
        used = stats["seed"]
        assert used == (seed if seed is not None else used if sampled else 0)
        assert text == ar(model, tok.encode(prompt), n, used, sampled), (method, sampled, used)
    assert len(drawn) == sum(1 for (m, s, i), *_ in answers if s and i % 4 == 1)   # fresh seeds, all different
    # chat through the same routes (the plain template), against AR on its ids
    messages = [{"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model="dasspec-tiny", messages=messages, max_tokens=10)
    assert out.choices[0].message.content == ar(model, tok.encode(tok.apply_chat_template(messages),
                                                                  add_special_tokens=False), 10)


def test_bad_requests_are_refused_as_the_single_server_refuses(cluster, client):
    with pytest.raises(openai.BadRequestError) as err:                 # checked at the ingress
        client.completions.create(model="dasspec-tiny", prompt="x", max_tokens=10**6)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:                 # checked on a replica, relayed
        client.completions.create(model="dasspec-tiny", prompt="x", extra_body={"dasspec": {"method": "nope"}})
    assert err.value.body["param"] == "dasspec.method"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_load_spreads_over_both_replicas_and_prefixes_stay_together(cluster, client, model):
    before = cluster.served()
    with ThreadPoolExecutor(4) as pool:                  # short prompts: no prefix key, least loaded
        list(pool.map(lambda p: client.completions.create(model="dasspec-tiny", prompt=p, max_tokens=8),
                      PROMPTS * 2))
    after = cluster.served()
    spread = {r: after[r] - before.get(r, 0) for r in after}
    assert len(spread) == 2 and min(spread.values()) >= 4, spread          # 16 requests, at least a quarter each
    # a shared prefix longer than the routing key (32 tokens): every request of it on one replica
    shared = "Here are some worked examples of Python functions that add numbers together carefully.\n" * 2
    assert len(model.tokenizer.encode(shared)) > 32
    local0 = cluster.metric("dasspec_route_prefix_local_total")
    before = cluster.served()
    for p in PROMPTS[:6]:
        client.completions.create(model="dasspec-tiny", prompt=shared + p, max_tokens=4)
    after = cluster.served()
    got = sorted(after[r] - before.get(r, 0) for r in after)
    assert got == [0, 6], got
    assert cluster.metric("dasspec_route_prefix_local_total") - local0 == 5


def test_health_and_metrics_add_up_the_replicas(cluster, client, model):
    h = cluster.health()
    assert h["status"] == "ok" and len(h["replicas"]) == 2 and h["method"] == "auto"
    from dasspec.model import decode_kernel            # the promise the replicas keep, stated by the cluster too
    assert h["exactness"] == decode_kernel.guarantee() and all(r["exactness"] == h["exactness"] for r in h["replicas"])
    ok0 = cluster.metric('dasspec_requests_total{endpoint="completions",outcome="ok"}')
    tokens0 = cluster.metric('dasspec_generated_tokens_total{method="auto"}')        # the default method
    arms = (*ARMS, "ar")                             # auto's drafters, and plain steps

    def chose() -> list[float]:
        return [cluster.metric(f'dasspec_auto_steps_total{{method="auto",drafter="{a}"}}') for a in arms]
    chose0 = chose()
    outs = [client.completions.create(model="dasspec-tiny", prompt=p, max_tokens=6) for p in PROMPTS[:4]]
    assert cluster.metric('dasspec_requests_total{endpoint="completions",outcome="ok"}') - ok0 == 4
    assert cluster.metric('dasspec_generated_tokens_total{method="auto"}') - tokens0 == \
        sum(o.usage.completion_tokens for o in outs)
    assert cluster.metric("dasspec_replicas") == 2
    # requests that name no method decode with the default, auto, and still answer AR's text
    assert [o.dasspec["method"] for o in outs] == ["auto"] * 4
    # what auto chose, per response and in the replicas' summed metrics
    choices = [o.dasspec["choices"] for o in outs]
    assert all(c and set(c) <= set(arms) for c in choices), choices
    assert [b - a for a, b in zip(chose0, chose())] == [sum(c.get(a, 0) for c in choices) for a in arms]
    assert [o.choices[0].text for o in outs] == [ar(model, model.tokenizer.encode(p), 6) for p in PROMPTS[:4]]


def test_a_client_that_goes_away_stops_its_generation_on_the_replica(cluster):
    import http.client

    cancelled = 'dasspec_requests_total{endpoint="completions",outcome="cancelled"}'
    finished = 'dasspec_requests_total{endpoint="completions",outcome="ok"}'
    before, ok0 = cluster.metric(cancelled), cluster.metric(finished)
    conn = http.client.HTTPConnection("127.0.0.1", int(cluster.url.rsplit(":", 1)[1]), timeout=60)
    # a request many times longer than noticing a departure takes (400 tokens were not always enough under a
    # loaded suite): the replica must end it as cancelled - run to its end it counts as ok, and the test says so
    body = {"prompt": "def fibonacci(n):", "max_tokens": 3500, "stream": True, "dasspec": {"method": "ar"}}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    line = b""
    while b'"text": "' not in line:                   # the first chunk with text: it is decoding
        line = r.fp.readline()
        assert line, "the stream ended before its first text"
    assert sum(x["running"] for x in cluster.health()["replicas"] if x["status"] == "ok") == 1
    conn.close()
    deadline = time.monotonic() + 120                 # only a hang's bound
    while sum(x["running"] for x in cluster.health()["replicas"] if x["status"] == "ok") > 0 \
            or cluster.metric(cancelled) == before:
        assert cluster.metric(finished) == ok0, "the request ran to its end: its client's departure was not noticed"
        assert time.monotonic() < deadline, cluster.health()
        time.sleep(0.2)
    assert cluster.metric(cancelled) == before + 1


# --- failover --------------------------------------------------------------------------------------------------------

def test_a_replica_killed_mid_stream_costs_no_client_a_character(cluster, client, model):
    tok = model.tokenizer
    N = 48
    # long answers (AR and the sequential drafters are the slow ones), greedy and sampled, streamed and not
    cases = [("ar", False, None), ("ar", True, 7), ("das-wave", True, None), ("self-spec", False, None),
             ("pld", False, None), ("ar", True, None)]
    results: dict[int, tuple] = {}
    first_text = [threading.Event() for _ in cases]

    def run(i: int):
        method, sampled, seed = cases[i]
        extra = {"extra_body": {"dasspec": {"method": method}}}
        if sampled:
            extra.update(SAMPLE)
            if seed is not None:
                extra["seed"] = seed
        prompt = PROMPTS[i]
        try:
            if i == len(cases) - 1:                      # one non-streamed: re-run whole
                first_text[i].set()
                out = client.completions.create(model="dasspec-tiny", prompt=prompt, max_tokens=N, **extra)
                results[i] = (prompt, out.choices[0].text, out.dasspec, [])
                return
            chunks, text, stats, times = [], [], None, []
            for c in client.completions.create(model="dasspec-tiny", prompt=prompt, max_tokens=N, stream=True,
                                               **extra):
                if c.choices and c.choices[0].text:
                    text.append(c.choices[0].text)
                    times.append(time.monotonic())
                    first_text[i].set()
                stats = getattr(c, "dasspec", None) or stats
            results[i] = (prompt, "".join(text), stats, times)
        except Exception as err:                          # noqa: BLE001 - reported below
            results[i] = (prompt, err, None, [])
            first_text[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(cases))]
    for t in threads:
        t.start()
    for e in first_text:
        assert e.wait(120)
    # the replica holding the most running requests dies now, mid-answer
    busy = max((r for r in cluster.health()["replicas"] if r["status"] == "ok"), key=lambda r: r["running"])
    assert busy["running"] > 0, cluster.health()
    killed = time.monotonic()
    os.kill(busy["pid"], signal.SIGKILL)
    for t in threads:
        t.join(300)
        assert not t.is_alive()
    resumed, gaps = 0, []
    for i, (method, sampled, seed) in enumerate(cases):
        prompt, text, stats, times = results[i]
        assert not isinstance(text, Exception), (cases[i], text)
        assert stats["seed"] == (seed if seed is not None else stats["seed"] if sampled else 0)
        assert text == ar(model, tok.encode(prompt), N, stats["seed"], sampled), (cases[i], stats)
        if stats["failovers"]:
            resumed += 1
            after = [t for t in times if t > killed]
            if after:
                gaps.append(after[0] - killed)
    assert resumed >= 1
    print(f"\nfailover: {resumed} of {len(cases)} requests resumed; death -> next token of each resumed stream: "
          + ", ".join(f"{g:.2f} s" for g in gaps))


def test_requests_sent_while_every_replica_is_dead_wait_for_the_restarted_ones(cluster, client, model):
    """Both replicas killed, and requests sent while no replica is alive: they wait at the ingress until Ray Serve
    has restarted the replicas, and are answered exactly (no error, nothing short)."""
    tok = model.tokenizer
    for r in cluster.health()["replicas"]:
        if r["status"] == "ok":
            os.kill(r["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    deadline = t0 + START_LIMIT_S                     # only a hang's bound: a loaded machine is slow, not broken
    while any(r["status"] == "ok" for r in cluster.health()["replicas"]):   # no replica alive (nor restarted yet)
        assert time.monotonic() < deadline, cluster.health()
        time.sleep(0.1)

    def ask(i: int):
        prompt = PROMPTS[i]
        if i == 0:
            return prompt, stream_text(client.completions.create(model="dasspec-tiny", prompt=prompt, max_tokens=12,
                                                                 stream=True))[0]
        return prompt, client.completions.create(model="dasspec-tiny", prompt=prompt, max_tokens=12).choices[0].text

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, range(3)))
    for prompt, text in answers:
        assert text == ar(model, tok.encode(prompt), 12)
    print(f"\nanswered {time.monotonic() - t0:.1f} s after both replicas were killed")
