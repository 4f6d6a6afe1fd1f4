"""End to end on Ray: one local two-node cluster made with Ray's own test utility (the head, where this process is the
driver, with one CPU; the other node with two), shared by the tensor-parallel ranks, the Ray Serve app and, last,
`batchserve serve --replicas N` joining it as it joins an instance running on a user's machine. Ray runs with the
environment `serve --replicas` gives an instance it starts (conftest.py). One file, so that the test runner's workers
never run two Ray instances side by side (a second would be found by the others' `ray.init()` and joined).

Tensor-parallel ranks placed by Ray (distributed_executor_backend ray, worker/ray_ranks.py): greedy float32 tokens at
TP=2 equal one rank's and transformers', with rank 1 on the other node; a cluster without the CPUs is refused at start
naming the CPUs needed and available, and a group the cluster cannot place is refused after the wait, nothing left
pending; a rank killed mid-run ends the engine with an error naming it within seconds.

Then, on the same cluster once the ranks have given every CPU back: 2 engine replicas of SmolLM2-135M-Instruct (1
thread each) behind the OpenAI ingress and the prefix-aware router; Ray's HTTP proxy (on the head node) on a free
port, and the ingress's own HTTP server on another."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from batchserve.bench.soak import wait_ready
from batchserve.config import ConfigError
from batchserve.entrypoints.llm import LLM
from batchserve.sampling_params import SamplingParams
from batchserve.serving.metrics import parse_metrics
from batchserve.worker import ray_ranks
from batchserve.worker.parallel_executor import RankDiedError
from tests.lazy import LazyModule
from tests.tiny_models import build_hf_model, hf_greedy, save_word_tokenizer

# Ray is imported when a test first uses it (most of a second of CPU that every worker collecting this file paid)
ray = LazyModule("ray")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _ray_installed():
    pytest.importorskip("ray")


def placement_group_table() -> dict:
    from ray.util.placement_group import placement_group_table as table

    return table()


ENGINE = {"num_threads": 1, "dtype": "float32", "num_kv_blocks": 256, "max_batch_size": 16, "seed": 0}
START_TIMEOUT_S = 240.0
PROMPT = "The three primary colors are"


RANK_PROMPTS = [[5, 9, 17, 33, 40, 41, 7, 12, 60, 3, 44], [8, 70], [23, 24, 25, 26, 27, 28]]
RANK_MAX_TOKENS = 8
RANK_OPTIONS = dict(dtype="float32", num_threads=1, max_num_tokens=8, block_size=8, num_kv_blocks=64)
RANK_GREEDY = SamplingParams(temperature=0.0, max_tokens=RANK_MAX_TOKENS, ignore_eos=True)
CPUS = 3.0  # the cluster's: 1 on the head, 2 on the other node


@pytest.fixture(scope="module")
def cluster():
    """The module's one Ray instance (starting one costs ~10 s of a 2-core host): the ranks' tests, then the app's."""
    from ray.cluster_utils import Cluster

    from batchserve.layers import kernels

    kernels.load()  # built (and cached on disk) here once, before rank workers or replicas start and look for them
    store = 200 * 1024**2
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": store},
    )
    nodes.add_node(num_cpus=2, object_store_memory=store)
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        yield nodes
    finally:  # the app's actors go down with the nodes: no serve.shutdown() round of graceful stops first
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture(scope="class")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_head64")
    hf = build_hf_model("llama_head64", directory)  # 2 query heads, 1 KV head: replicated on both ranks
    save_word_tokenizer(directory)
    return hf, directory


def _rank_tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in RANK_PROMPTS], RANK_GREEDY, use_tqdm=False)
    return [out.token_ids for out in outputs]


def _pending_groups() -> list:
    return [g for g in placement_group_table().values() if g["state"] not in ("CREATED", "REMOVED")]


class TestRanksPlacedByRay:
    """Before the Ray app below starts on the same cluster: each test finds all of its CPUs free."""

    def test_ranks_on_two_nodes_give_one_rank_and_transformers_tokens(self, cluster, model):
        hf, directory = model
        want = [hf_greedy(hf, prompt, RANK_MAX_TOKENS) for prompt in RANK_PROMPTS]
        assert _rank_tokens(LLM(str(directory), **RANK_OPTIONS)) == want  # one rank, in this process
        llm = LLM(str(directory), tensor_parallel_size=2, distributed_executor_backend="ray", **RANK_OPTIONS)
        runner = llm.engine.runner
        (rank1,) = runner.workers
        assert rank1.pid != os.getpid() and runner.tp.size == 2
        assert runner.tp.shared is None  # gloo all-reduces for ranks Ray placed (modes.py ray_ranks_all_reduce_by_gloo)
        (group,) = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        here = ray.get_runtime_context().get_node_id()
        assert (
            group["bundles_to_node_id"][0] == here and group["bundles_to_node_id"][1] != here
        )  # rank 1: the other node
        assert _rank_tokens(llm) == want
        assert "ray_ranks_all_reduce_by_gloo" in llm.engine.runner.modes.fallback_names
        llm.engine.close()
        assert placement_group_table()[group["placement_group_id"]]["state"] == "REMOVED"
        _wait_all_cpus_free()

    def test_a_cluster_without_the_cpus_is_refused_at_start(self, cluster, model):
        _, directory = model
        options = {**RANK_OPTIONS, "num_threads": 2}
        needs = "needs 4 CPUs (2 ranks x 2 threads), the Ray cluster has 3 available (3 in all)"
        with pytest.raises(ConfigError, match=re.escape(needs)):
            LLM(str(directory), tensor_parallel_size=2, distributed_executor_backend="ray", **options)
        assert not _pending_groups()  # refused, never left pending
        _wait_all_cpus_free()

    def test_a_group_the_cluster_cannot_place_is_removed_and_refused(self, cluster, model, monkeypatch):
        """The head's one CPU taken: the two CPUs rank 0 and rank 1 need are free, on the other node only, and rank 0's
        bundle must sit on this node."""
        from ray.util.placement_group import placement_group, remove_placement_group

        _, directory = model
        here = ray.get_runtime_context().get_node_id()
        blocker = placement_group([{"CPU": 1}], bundle_label_selector=[{"ray.io/node-id": here}])
        assert blocker.wait(30)
        monkeypatch.setattr(ray_ranks, "PLACE_TIMEOUT_S", 1.0)  # waited in full: the group can never be placed
        try:
            with pytest.raises(ConfigError, match=r"rank 0's on this node \(1 CPUs in all here\), and the Ray cluster "
                                                  r"could not place them within 1 s"):  # fmt: skip
                LLM(str(directory), tensor_parallel_size=2, distributed_executor_backend="ray", **RANK_OPTIONS)
            assert not _pending_groups()  # removed, not left waiting for the CPU
        finally:
            remove_placement_group(blocker)
        _wait_all_cpus_free()

    def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(self, cluster, model):
        _, directory = model
        llm = LLM(str(directory), tensor_parallel_size=2, distributed_executor_backend="ray", **RANK_OPTIONS)
        engine = llm.engine
        for prompt in RANK_PROMPTS:
            engine.add_prompt(None, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=500, ignore_eos=True))
        for _ in range(3):
            engine.step()
        pid = engine.runner.workers[0].pid
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankDiedError, match=rf"rank 1 \(pid {pid}\) died"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 10
        engine.close()
        _wait_all_cpus_free()


def _wait_all_cpus_free() -> None:
    """The engine's placement group removed: every bundle's CPUs free again (Ray frees them within a moment)."""
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != CPUS:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def _quiet_ports(count: int) -> list[int]:
    """Free ports below the kernel's ephemeral range (32768-60999) and above Ray's worker ports (10002-19999): Ray's
    processes, started between a pick and the ingress's bind, take theirs from the ephemeral range."""
    rng, ports = random.Random(), []
    while len(ports) < count:
        port = rng.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


@pytest.fixture(scope="module")
def ray_app(cluster):
    from ray import serve

    from batchserve.distributed.app import build_application
    from batchserve.distributed.options import RayAppOptions

    port, grpc_port, http_port = _quiet_ports(3)
    # one proxy, on the head: the two nodes share this host's loopback address and port
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    options = RayAppOptions(
        engine=ENGINE, replicas=2, health_check_period_s=1.0, grpc_port=grpc_port, http_port=http_port
    )
    started = threading.Thread(
        target=serve.run, args=(build_application(options),), kwargs={"name": "batchserve", "route_prefix": "/"},
        daemon=True,
    )  # fmt: skip
    started.start()
    started.join(START_TIMEOUT_S)
    assert not started.is_alive(), f"the Ray app did not start within {START_TIMEOUT_S:.0f} s"
    return f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def single_engine_text():
    """What one engine in this process answers greedily, the reference for the Ray app."""
    llm = LLM(**ENGINE)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    return out[0].text


@functools.cache
def _polling_client() -> httpx.Client:
    """The client of the waits that poll: httpx.get() builds a client (and its TLS context) per call, ~30 ms of CPU,
    taken from the replicas being waited for."""
    return httpx.Client(timeout=30)


def _replica_metric(base_url: str, name: str) -> dict[str, float]:
    """{replica: value} of one series on the ingress's /metrics."""
    values: dict[str, float] = {}
    for line in _polling_client().get(base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            values[replica] = values.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def base_url(ray_app):
    return ray_app[0]


def test_completions_through_ray_equal_the_single_engine_greedy_output(base_url, single_engine_text):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = httpx.post(base_url + "/v1/completions", json=body, timeout=120).json()
    assert full["choices"][0]["text"] == single_engine_text
    pieces = []
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert len(pieces) > 1 and "".join(pieces) == single_engine_text


def test_the_ingress_own_http_server_streams_the_same_text(ray_app, single_engine_text):
    """The port `batchserve serve --replicas` serves on (Ray's proxy off): the same routes, no proxy hop."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    pieces = []
    with httpx.stream("POST", ray_app[2] + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert len(pieces) > 1 and "".join(pieces) == single_engine_text
    assert httpx.get(ray_app[2] + "/v1/models", timeout=30).json()["data"][0]["id"]


def test_grpc_through_ray_equals_the_single_engine_greedy_output(ray_app, single_engine_text):
    import grpc

    from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
    from batchserve.entrypoints.grpc.pb import generation_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with grpc.insecure_channel(ray_app[1]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text=PROMPT, return_text=True, stream=True, sampling=sampling)
        messages = list(stub.Generate(request, timeout=120))
    assert len(messages) > 1 and "".join(m.text for m in messages) == single_engine_text


def test_bad_requests_get_a_clear_error_through_ray(base_url):
    response = httpx.post(base_url + "/v1/completions", json={"prompt": [10**7], "max_tokens": 2}, timeout=60)
    assert response.status_code == 400 and "prompt token ids" in response.json()["error"]["message"]
    assert httpx.get(base_url + "/health", timeout=30).status_code == 200


def test_requests_sharing_a_prefix_land_on_the_same_replica(base_url):
    system = "You are a careful assistant who answers questions about the geography of Europe. " * 6
    before = _replica_metric(base_url, "batchserve:prefix_cache_hits_total")
    decisions_before = parse_metrics(httpx.get(base_url + "/metrics").text).get("batchserve:router_decisions_total", 0)
    cached = []
    for city in ("Rome", "Paris", "Vienna", "Lisbon", "Oslo"):
        body = {"prompt": f"{system}Where is {city}?", "max_tokens": 2, "temperature": 0}
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200
        cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and min(cached[1:]) >= 64, cached  # each later one reused the system prompt's blocks

    def hits_settled():
        after = _replica_metric(base_url, "batchserve:prefix_cache_hits_total")
        gained = {r: after.get(r, 0) - before.get(r, 0) for r in after}
        return gained if sum(gained.values()) >= 4 * 64 else None  # 4 repeats x >= 4 blocks of the system prompt

    gained = _wait_for(hits_settled, 15, "the replicas' prefix-cache hits")
    assert sorted(gained.values())[0] == 0, gained  # every hit on one replica: the other never saw the prefix
    decisions = parse_metrics(httpx.get(base_url + "/metrics").text)["batchserve:router_decisions_total"]
    assert decisions - decisions_before >= 5


def test_the_ingress_serves_the_dashboard_from_each_replicas_reports(base_url):
    """/dashboard on the Ray ingress: the page, and per replica the steps and finished requests its reports carry."""
    page = httpx.get(base_url + "/dashboard", timeout=30)
    assert page.status_code == 200 and 'id="replica"' in page.text
    body = {"prompt": "Dashboard check:", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    # taken before the request is sent: a request of the test before that finished just earlier is not this one
    started = time.time()
    assert httpx.post(base_url + "/v1/completions", json=body, timeout=120).status_code == 200

    def reported() -> dict | None:  # a replica's next routing-stats report carries the finished request
        data = _polling_client().get(base_url + "/dashboard/data", params={"requests": True}).json()
        finished = []
        for replica in data["replicas"]:
            one = (
                _polling_client()
                .get(base_url + "/dashboard/data", params={"requests": True, "replica": replica})
                .json()
            )
            assert one["replica"] == replica
            finished += [(one, r) for r in one["requests"] if r["finished_time"] > started]
        return finished[0] if finished else None

    data, request = _wait_for(reported, 15, "a replica's dashboard report")
    assert len(data["replicas"]) == 2
    assert request["output_tokens"] == 6 and request["finish_reason"] == "length"
    assert data["steps"] and data["limits"]["num_kv_blocks"] == int(data["config"]["num_kv_blocks"])
    fields = data["step_fields"]
    last = data["steps"][-1][fields.index("index")]
    again = httpx.get(base_url + "/dashboard/data", params={"since": last, "replica": data["replica"]}).json()
    assert all(s[fields.index("index")] > last for s in again["steps"]) and "requests" not in again


def test_clients_leaving_mid_stream_free_their_engine_requests(ray_app):
    """Streams dropped after their first chunk, beside streams read to the end, on the ingress's own port: every
    engine request ends (aborted ones too), so the replicas hold no running request and no KV block afterwards."""
    url = ray_app[2]

    async def one(client: httpx.AsyncClient, i: int, leave: bool) -> str:
        # a stream left behind would run for minutes: only its abort ends it within the wait below
        max_tokens = 2000 if leave else 16
        body = {"prompt": f"Tale {i}: the river", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if leave and line.startswith("data: "):
                    return "left"  # closes the connection mid-stream
            return "read"

    async def load() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i, leave=i % 2 == 0) for i in range(16)))

    outcomes = asyncio.run(load())
    assert outcomes.count("left") == 8 and outcomes.count("read") == 8

    def drained():
        running = _replica_metric(url, "batchserve:num_requests_running")
        usage = _replica_metric(url, "batchserve:kv_cache_usage_perc")
        return running and sum(running.values()) == 0 and sum(usage.values()) == 0

    _wait_for(drained, 20, "the replicas to hold no request and no KV block")


def test_a_killed_replica_loses_no_request_and_the_app_recovers(base_url):
    """16 greedy streams, a replica killed under them: its requests move to the other replica (retried, or continued
    from the tokens already streamed), so all 16 complete with the text of a run without the kill."""

    async def one(client: httpx.AsyncClient, i: int, streaming: set[int]) -> str:
        # long enough that every stream is still running when the replica dies (the kill waits for all 16 to have
        # streamed, a few of the 32 steps in), short enough that the two rounds of 16 are not most of this module's
        # time
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 32, "ignore_eos": True, "stream": True,
                "temperature": 0}  # fmt: skip
        async with client.stream("POST", base_url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"http {response.status_code}"
            text, finish = "", None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error event {event['error']}"
                streaming.add(i)
                text += event["choices"][0]["text"]
                finish = event["choices"][0]["finish_reason"] or finish
            return text if finish == "length" else f"ended without finish ({finish})"

    async def run(kill: bool) -> list[str]:
        async with httpx.AsyncClient(timeout=180) as client:
            streaming: set[int] = set()
            tasks = [asyncio.ensure_future(one(client, i, streaming)) for i in range(16)]
            if kill:  # once every request has streamed tokens (on a loaded host a fixed wait could see none yet)
                deadline = time.monotonic() + 120
                while len(streaming) < 16 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                victim = _engine_replica_names()[0]
                ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)

    def moved(kind: str) -> float:
        series = f'batchserve:requests_moved_total{{kind="{kind}"}} '
        lines = [line for line in httpx.get(base_url + "/metrics").text.splitlines() if line.startswith(series)]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    undisturbed = asyncio.run(run(kill=False))
    assert all(len(t) > 20 for t in undisturbed), undisturbed
    continued = moved("continue")
    assert asyncio.run(run(kill=True)) == undisturbed
    assert moved("continue") > continued  # requests that had streamed tokens went on elsewhere

    _wait_for(lambda: len(_engine_replica_names()) == 2 and _running_replicas() == 2, 180, "the replacement replica")
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    for _ in range(4):  # both replicas serve again
        assert httpx.post(base_url + "/v1/completions", json=body, timeout=120).status_code == 200


def _engine_replica_names() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#EngineReplica#" in a["name"])


def _running_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications["batchserve"].deployments["EngineReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def test_serve_replicas_joins_the_running_instance_serves_http_and_exits_cleanly_on_sigint(cluster, tmp_path):
    """Last (it replaces the app above): `serve --replicas` where Ray is up ($RAY_ADDRESS) joins that instance instead
    of starting its own, serves HTTP from the ingress on --port, exits cleanly on SIGINT and deletes only its app.
    The start of an instance of its own is `launch._connect`'s other branch (tests/distributed/test_options_and_cli.py)."""
    from ray import serve

    port = _quiet_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "batchserve.cli", "serve", "--replicas", "1", "--num-threads", "1", "--port", str(port),
        "--dtype", "float32", "--num-kv-blocks", "64", "--drain-timeout", "5",
    ]  # fmt: skip
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        joining = {**os.environ, "RAY_ADDRESS": cluster.address}
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=joining)
        try:
            wait_ready(server, url, timeout_s=300)
            body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            response = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
            server.send_signal(signal.SIGINT)
            assert server.wait(120) == 0
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    text = log_path.read_text()
    assert "joined the Ray instance running on this machine" in text and "HTTP served by the ingress" in text, text
    assert "replicas run: {" in text and "'num_kv_blocks': '64'" in text, text[-2000:]  # the replicas' config
    assert "ready at" not in text, text[-2000:]  # no address but the one that serves
    assert "failed" not in text and "Traceback" not in text, text[-2000:]
    assert "batchserve" not in serve.status().applications  # its application deleted on the way out
    _wait_all_cpus_free()  # its replica's CPU given back, on a cluster still up
