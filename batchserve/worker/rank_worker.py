"""A tensor-parallel rank other than 0, in a process of its own: it holds its shard of the model and its KV pool
(its heads only), and runs every step the engine's scheduler hands to rank 0, which sends it over the channel
(host/channel.py). Nothing comes back per step: every rank gathers the same logits and samples the same tokens
(the step's seed travels with it), so each rank's request table follows rank 0's without a token crossing.

The messages of the link are the dataclasses below; a rank that fails sends RankFailed, then exits, which ends the
collective rank 0 waits in (gloo raises at once when a peer's connection closes).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import traceback
from dataclasses import dataclass

import torch

from batchserve.config import EngineConfig, ModelConfig
from batchserve.core.outputs import SchedulerOutput
from batchserve.host.channel import Channel, PeerDeadError
from batchserve.host.shared_allreduce import SharedAllReduce, SharedBuffers
from batchserve.layers.parallel import PipelineStage, TensorParallel, split_layers

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120  # a peer alive but silent this long in a collective (a dead one fails it at once)
HOST = "127.0.0.1"  # the ranks of the "mp" backend share this host


class RankDiedError(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot run another step."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank worker is started with."""

    config: EngineConfig
    model_config: ModelConfig
    rank: int
    size: int
    store_port: int  # rank 0's rendezvous store
    shared: SharedBuffers | None = None  # the shared all-reduce memory of the rank's stage (None: gloo's)
    store_host: str = HOST  # where rank 0's store listens: this host for "mp", rank 0's node for "ray"


@dataclass(frozen=True)
class PoolSize:
    """Rank 0's KV pool: every rank allocates as many blocks (the scheduler's block ids index all of them)."""

    num_blocks: int
    max_blocks: int


@dataclass(frozen=True)
class Ready:
    rank: int


@dataclass(frozen=True)
class Step:
    """One engine step: the scheduler's output and the seed the ranks' unseeded sampling draws from."""

    scheduler_output: SchedulerOutput
    seed: int


@dataclass(frozen=True)
class ResizePool:
    num_blocks: int
    keep_block_ids: list[int]


@dataclass(frozen=True)
class RankFailed:
    rank: int
    error: str


def rendezvous(rank: int, size: int, port: int = 0, host: str = HOST):
    """The store the ranks meet at: rank 0 serves it (port 0: one the OS picks), the others connect to it at
    `host`."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if rank == 0:
        return dist.TCPStore(host, port, size, True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(host, port, size, False, timeout=timeout)


def init_groups(world_rank: int, config: EngineConfig, model_config: ModelConfig, store):
    """Join the ranks' gloo groups (every rank calls it at once) -> (TensorParallel, PipelineStage): world rank
    s * tp_size + t is tensor-parallel rank t of pipeline stage s. Process groups of their own, never torch's default
    one, so that an engine stays an object (several may share a process)."""
    import torch.distributed as dist

    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    index, tp_rank = divmod(world_rank, tp_size)
    world = None
    if pp_size > 1:
        world = dist.ProcessGroupGloo(dist.PrefixStore("world", store), world_rank, tp_size * pp_size, timeout)
    group = None
    if tp_size > 1:
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"tp{index}", store), tp_rank, tp_size, timeout)
    layers = split_layers(model_config.num_layers, pp_size)[index]
    stage = PipelineStage(index, pp_size, layers.start, layers.stop, world, world_rank, tp_size,
                          micro_batches=config.pipeline_micro_batches)  # fmt: skip
    return TensorParallel(tp_rank, tp_size, group), stage


def rank_config(config: EngineConfig, model_config: ModelConfig, stage: PipelineStage) -> ModelConfig:
    """The shapes this rank's runner holds: its heads (models/sharding.py local_config) of its stage's layers."""
    from batchserve.models.sharding import local_config

    local = local_config(model_config, config.tensor_parallel_size)
    return dataclasses.replace(local, num_layers=len(stage.layers))


def load_shard(config: EngineConfig, model_config: ModelConfig, tp: TensorParallel, stage: PipelineStage):
    """This rank's shard of config.model -> (model, device, dtype)."""
    from batchserve.layers.linear import engine_layouts
    from batchserve.models.loader import resolve_model_path
    from batchserve.models.sharding import load_sharded_model
    from batchserve.worker.device import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    with engine_layouts(config.deterministic, config.scheduler.max_num_tokens):
        model = load_sharded_model(resolve_model_path(config.model), model_config, dtype, device, tp, stage)
    return model, device, dtype


def pool_size(config: EngineConfig, local: ModelConfig, dtype, device, initial_kv_blocks: int | None) -> PoolSize:
    """Rank 0's decision of the pool every rank allocates: the budget (num_kv_blocks, else the memory fraction) for
    a block of this rank's heads and layers (`local`, rank_config); `initial_kv_blocks` of it now when given (a pool
    that grows)."""
    from batchserve.worker.kv_cache import num_blocks_for_budget, pool_dtype

    budget = num_blocks_for_budget(config.cache, local, pool_dtype(config.cache, dtype), device)
    now = budget if initial_kv_blocks is None else max(1, min(initial_kv_blocks, budget))
    return PoolSize(now, budget)


def rank_runner(config: EngineConfig, local: ModelConfig, model, device, dtype, pool: PoolSize, stage: PipelineStage):
    """A ModelRunner over a shard: its KV pool of `pool`'s blocks (the same on every rank) for the rank's heads and
    layers (`local`, rank_config), the vocabulary whole."""
    from batchserve.worker.model_runner import ModelRunner

    own = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_kv_blocks=pool.max_blocks))
    runner = ModelRunner(own, local, model, device, dtype, initial_kv_blocks=pool.num_blocks)
    runner.pipeline = stage if stage.count > 1 else None
    return runner


def shared_buffers(config: EngineConfig, model_config: ModelConfig) -> list[SharedBuffers | None]:
    """Rank 0's allocation of each pipeline stage's shared all-reduce memory, before the ranks start (their
    semaphores go with a child's arguments only): a step's activations in float32 (max_num_tokens x hidden_size) per
    rank, twice; None where gloo all-reduces (one rank a stage, or BATCHSERVE_SHARED_ALLREDUCE off)."""
    from batchserve import env

    tp = config.tensor_parallel_size
    if tp == 1 or not env.shared_allreduce():
        return [None] * config.pipeline_parallel_size
    capacity = config.scheduler.max_num_tokens * model_config.hidden_size
    return [SharedBuffers.allocate(tp, capacity) for _ in range(config.pipeline_parallel_size)]


def share(tp: TensorParallel, shared: SharedBuffers | None, peers_alive) -> None:
    if shared is not None:
        tp.shared = SharedAllReduce(shared, tp.rank, peers_alive)


def join_and_load(spec: RankSpec):
    """A rank's start before rank 0 sizes the pool: its threads, its groups (every rank joins at once), its shard
    -> (TensorParallel, PipelineStage, model, device, dtype)."""
    from batchserve.host.process import configure_torch

    config = spec.config
    configure_torch(config.num_threads, config.seed)
    store = rendezvous(spec.rank, spec.size, spec.store_port, spec.store_host)
    tp, stage = init_groups(spec.rank, config, spec.model_config, store)
    return (tp, stage, *load_shard(config, spec.model_config, tp, stage))


def shard_runner(spec: RankSpec, shard, pool: PoolSize):
    """The rank's runner over its loaded shard (join_and_load's), its pool as rank 0 sized it."""
    from batchserve.models.loader import load_tokenizer, resolve_model_path

    _, stage, model, device, dtype = shard
    local = rank_config(spec.config, spec.model_config, stage)
    runner = rank_runner(spec.config, local, model, device, dtype, pool, stage)
    runner.structured_outputs.tokenizer = load_tokenizer(resolve_model_path(spec.config.model), spec.config.tokenizer)
    return runner


def rank_main(channel: Channel, spec: RankSpec) -> None:
    """A rank worker's life: join the group, load the shard, size the pool as rank 0 says, then run each step it is
    sent until the channel closes (rank 0 gone or stopping)."""
    try:
        shard = join_and_load(spec)
        pool = channel.recv()
        share(shard[0], spec.shared, channel.peer_alive)
        runner = shard_runner(spec, shard, pool)
        channel.send(Ready(spec.rank))
        _serve(channel, runner)
    except PeerDeadError:
        return  # rank 0 is gone or closed the link: nothing to report to
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then the process ends
        try:
            channel.send(RankFailed(spec.rank, f"{exc!r}\n{traceback.format_exc()}"))
        except PeerDeadError:
            pass
        raise


def _serve(channel: Channel, runner) -> None:
    while True:
        handle(runner, channel.recv())


def handle(runner, message: Step | ResizePool) -> None:
    """One message of rank 0's, whatever carried it (a channel, a Ray actor call)."""
    if isinstance(message, Step):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(message.seed)
            runner.execute(message.scheduler_output)
    elif isinstance(message, ResizePool):
        runner.resize_kv_cache(message.num_blocks, message.keep_block_ids)
    else:
        raise TypeError(f"rank worker: unexpected message {type(message).__name__}")
