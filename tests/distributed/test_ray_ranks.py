"""Tensor-parallel ranks placed by Ray (distributed_executor_backend ray, worker/ray_ranks.py) on a local two-node
cluster made with Ray's own test utility (two nodes on this host: the head, where this process is the driver, with one
CPU; the other with two): greedy float32 tokens at TP=2 equal one rank's and transformers', with rank 1 on the other
node; a cluster without the CPUs is refused at start naming the CPUs needed and available, and a group the cluster
cannot place (rank 0's node full) is refused after the wait, nothing left pending; a rank killed mid-run ends the
engine with an error naming it within seconds. One cluster for the module (Ray's start-up is slow on a small
host)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from batchserve.config import ConfigError  # noqa: E402
from batchserve.entrypoints.llm import LLM  # noqa: E402
from batchserve.sampling_params import SamplingParams  # noqa: E402
from batchserve.worker import ray_ranks  # noqa: E402
from batchserve.worker.parallel_executor import RankDiedError  # noqa: E402
from tests.tiny_models import build_hf_model, hf_greedy, save_word_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 17, 33, 40, 41, 7, 12, 60, 3, 44], [8, 70], [23, 24, 25, 26, 27, 28]]
MAX_TOKENS = 8
OPTIONS = dict(dtype="float32", num_threads=1, max_num_tokens=8, block_size=8, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CPUS = 3.0  # the cluster's: 1 on the head, 2 on the other node


@pytest.fixture(scope="module")
def cluster():
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes.add_node(num_cpus=2)
    ray.init(address=nodes.address)
    try:
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_head64")
    hf = build_hf_model("llama_head64", directory)  # 2 query heads, 1 KV head: replicated on both ranks
    save_word_tokenizer(directory)
    return hf, directory


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [out.token_ids for out in outputs]


def _pending_groups() -> list:
    return [g for g in placement_group_table().values() if g["state"] not in ("CREATED", "REMOVED")]


def test_ranks_on_two_nodes_give_one_rank_and_transformers_tokens(cluster, model):
    hf, directory = model
    want = [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in PROMPTS]
    assert _generate(LLM(str(directory), **OPTIONS)) == want  # one rank, in this process
    llm = LLM(str(directory), tensor_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
    runner = llm.engine.runner
    (rank1,) = runner.workers
    assert rank1.pid != os.getpid() and runner.tp.size == 2
    assert runner.tp.shared is None  # gloo all-reduces for ranks Ray placed (modes.py ray_ranks_all_reduce_by_gloo)
    (group,) = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    here = ray.get_runtime_context().get_node_id()
    assert group["bundles_to_node_id"][0] == here and group["bundles_to_node_id"][1] != here  # rank 1: the other node
    assert _generate(llm) == want
    assert "ray_ranks_all_reduce_by_gloo" in llm.engine.runner.modes.fallback_names
    llm.engine.close()
    assert placement_group_table()[group["placement_group_id"]]["state"] == "REMOVED"
    _wait_all_cpus_free()


def test_a_cluster_without_the_cpus_is_refused_at_start(cluster, model):
    _, directory = model
    options = {**OPTIONS, "num_threads": 2}
    needs = "needs 4 CPUs (2 ranks x 2 threads), the Ray cluster has 3 available (3 in all)"
    with pytest.raises(ConfigError, match=re.escape(needs)):
        LLM(str(directory), tensor_parallel_size=2, distributed_executor_backend="ray", **options)
    assert not _pending_groups()  # refused, never left pending
    _wait_all_cpus_free()


def test_a_group_the_cluster_cannot_place_is_removed_and_refused(cluster, model, monkeypatch):
    """The head's one CPU taken: the two CPUs rank 0 and rank 1 need are free, on the other node only, and rank 0's
    bundle must sit on this node."""
    from ray.util.placement_group import placement_group, remove_placement_group

    _, directory = model
    here = ray.get_runtime_context().get_node_id()
    blocker = placement_group([{"CPU": 1}], bundle_label_selector=[{"ray.io/node-id": here}])
    assert blocker.wait(30)
    monkeypatch.setattr(ray_ranks, "PLACE_TIMEOUT_S", 2.0)
    try:
        with pytest.raises(ConfigError, match=r"rank 0's on this node \(1 CPUs in all here\), and the Ray cluster "
                                              r"could not place them within 2 s"):  # fmt: skip
            LLM(str(directory), tensor_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
        assert not _pending_groups()  # removed, not left waiting for the CPU
    finally:
        remove_placement_group(blocker)
    _wait_all_cpus_free()


def test_a_killed_rank_ends_the_engine_with_an_error_naming_it(cluster, model):
    _, directory = model
    llm = LLM(str(directory), tensor_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
    engine = llm.engine
    for prompt in PROMPTS:
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
