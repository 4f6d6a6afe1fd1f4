"""The tensor-parallel executor (vLLM v1's executor shape): the engine's scheduler stays where it is and drives one
runner; this runner is rank 0, in the engine's process, and sends each step's SchedulerOutput to the other ranks
(worker/rank_worker.py), one process each, before running the step itself. The ranks' collectives (gloo) tie the
step together; no sampled token travels, since every rank samples the same ones (rank_worker.py says why).

Rank 0 lives in the engine's process rather than in a worker of its own: one process fewer (on a CPU host every
process competes for the same cores), and the step's inputs and outputs never cross a process boundary for it.

A rank that dies (killed, crashed, out of memory) fails the collective rank 0 waits in at once, or the next send to
it: `execute` then raises RankDiedError naming the rank and its exit code, the engine loop ends, and every request
gets that error; the other ranks are stopped. Never a hang: the collectives also time out
(rank_worker.COLLECTIVE_TIMEOUT_S).

Where the ranks run is the backend's (distributed_executor_backend): "mp" starts them as processes of this host
(ProcessRank, below), "ray" as actors in a Ray placement group (worker/ray_ranks.py). Either is a RankHandle: the
same messages reach the rank, the same failures come back.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from batchserve.config import EngineConfig, ModelConfig
from batchserve.core.outputs import ModelOutput, SchedulerOutput
from batchserve.host.channel import ChildProcess, PeerDeadError, start_child
from batchserve.layers.parallel import PipelineStage, TensorParallel
from batchserve.worker import rank_worker
from batchserve.worker.rank_worker import RankDiedError, RankFailed, RankSpec, Ready, ResizePool, Step

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600  # loading a shard of a large model from a cold disk


class RankHandle(Protocol):
    """Rank 0's hold on another rank, whatever placed it."""

    pid: int | None

    def send(self, message) -> None:
        """Hand the rank a message (PoolSize, Step, ResizePool); PeerDeadError if it is gone."""

    def wait_ready(self, rank: int, timeout: float) -> None:
        """Until the rank is Ready; RankDiedError if it failed or died while starting."""

    def failure(self, rank: int) -> str | None:
        """What happened to a rank that failed or died, naming it; None while it lives."""

    def is_alive(self) -> bool: ...

    def stop(self) -> None: ...


@dataclass
class ProcessRank:
    """A rank of the "mp" backend: a child process of this one, linked by the channel."""

    child: ChildProcess

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def send(self, message) -> None:
        self.child.channel.send(message)

    def wait_ready(self, rank: int, timeout: float) -> None:
        try:
            message = self.child.channel.recv(timeout=timeout)
        except PeerDeadError:
            code = self.child.process.exitcode
            raise RankDiedError(f"rank {rank} died while starting (exit code {code})") from None
        if isinstance(message, RankFailed):
            raise RankDiedError(f"rank {rank} failed to start: {message.error}")
        if not isinstance(message, Ready):
            raise RankDiedError(f"rank {rank}: unexpected message {type(message).__name__}")

    def failure(self, rank: int) -> str | None:
        try:
            while self.child.channel.poll(0):
                message = self.child.channel.recv()
                if isinstance(message, RankFailed):
                    return f"rank {rank} (pid {self.pid}) failed: {message.error.splitlines()[0]}"
        except PeerDeadError:
            pass
        if self.child.is_alive():
            return None
        return f"rank {rank} (pid {self.pid}) died (exit code {self.child.process.exitcode})"

    def is_alive(self) -> bool:
        return self.child.is_alive()

    def kill(self) -> None:
        self.child.kill()

    def stop(self) -> None:
        self.child.stop(timeout=5.0)


class ParallelRunner:
    """Rank 0's ModelRunner, driving the other ranks: what the engine sees as its runner. Attributes not defined
    here (the pool's sizes, the device, the model) are rank 0's runner's."""

    def __init__(
        self,
        runner,
        tp: TensorParallel,
        workers: list[RankHandle],
        stage: PipelineStage | None = None,
        release: Callable[[], None] | None = None,
    ):
        """`release`: what to give back once the ranks are stopped (a Ray placement group)."""
        self.runner = runner
        self.tp = tp
        self.stage = stage
        self.workers = workers
        self._finalizer = weakref.finalize(self, _stop_workers, list(workers), release)
        self._seeds = torch.Generator().manual_seed(runner.engine_config.seed)

    def __getattr__(self, name: str):
        if name == "runner":  # not set yet: construction failed
            raise AttributeError(name)
        return getattr(self.runner, name)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        seed = int(torch.randint(0, 2**62, (), generator=self._seeds))
        step = Step(scheduler_output, seed)
        self._to_workers(step)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return self.runner.execute(scheduler_output)
        except RuntimeError as exc:
            raise self._rank_died(exc) from exc

    def resize_kv_cache(self, num_blocks: int, keep_block_ids: Sequence[int]) -> None:
        self._to_workers(ResizePool(num_blocks, list(keep_block_ids)))
        self.runner.resize_kv_cache(num_blocks, keep_block_ids)

    def close(self) -> None:
        self.runner.close()
        self._finalizer()

    def _to_workers(self, message) -> None:
        for worker in self.workers:
            try:
                worker.send(message)
            except PeerDeadError as exc:
                raise self._rank_died(exc) from exc

    def _rank_died(self, cause: BaseException) -> BaseException:
        """RankDiedError naming the rank that failed (its report, else its exit code), the others stopped; `cause`
        itself when every rank lives (an error of rank 0's own)."""
        deadline = time.monotonic() + 2.0  # a rank that reported or died has its report or exit code in by then
        while time.monotonic() < deadline:
            failed = [worker.failure(rank) for rank, worker in enumerate(self.workers, start=1)]
            failed = [f for f in failed if f is not None]
            if failed:
                self._finalizer()
                return RankDiedError(f"{'; '.join(failed)}: the engine cannot run another step")
            time.sleep(0.05)
        return cause


def _stop_workers(workers: list[RankHandle], release: Callable[[], None] | None = None) -> None:
    for worker in workers:
        worker.stop()
    if release is not None:
        release()


def start_tensor_parallel(config: EngineConfig, model_config: ModelConfig, initial_kv_blocks: int | None = None):
    """Start ranks 1..N-1 (processes of this host, or Ray actors in a placement group), load rank 0's shard here and
    its runner, tell the ranks the pool's size and wait until each is ready -> ParallelRunner."""
    size = config.tensor_parallel_size * config.pipeline_parallel_size
    placement = None
    if config.distributed_executor_backend == "ray":
        from batchserve.worker import ray_ranks

        placement = ray_ranks.place(config, size)  # too few CPUs in the cluster: refused here, nothing started
    host = rank_worker.HOST if placement is None else placement.host
    store = rank_worker.rendezvous(0, size, host=host)
    # ranks Ray places may sit on other hosts: gloo all-reduces for them (modes.py ray_ranks_all_reduce_by_gloo)
    shared = rank_worker.shared_buffers(config, model_config) if placement is None else [None] * size
    tp_size = config.tensor_parallel_size
    specs = [
        RankSpec(config, model_config, rank, size, store.port, shared[rank // tp_size], host) for rank in range(1, size)
    ]
    release = None if placement is None else placement.release
    try:
        workers = [_start_process_rank(spec) if placement is None else placement.start(spec) for spec in specs]
    except BaseException:
        if release is not None:
            release()
        raise
    try:
        tp, stage = rank_worker.init_groups(0, config, model_config, store)
        model, device, dtype = rank_worker.load_shard(config, model_config, tp, stage)
        local = rank_worker.rank_config(config, model_config, stage)
        pool = rank_worker.pool_size(config, local, dtype, device, initial_kv_blocks)
        runner = rank_worker.rank_runner(config, local, model, device, dtype, pool, stage)
        rank_worker.share(tp, shared[0], lambda: all(w.is_alive() for w in workers))
        for worker in workers:
            worker.send(pool)
        for rank, worker in enumerate(workers, start=1):
            worker.wait_ready(rank, READY_TIMEOUT_S)
    except BaseException:
        _stop_workers(workers, release)
        raise
    where = "on this host" if placement is None else f"placed by Ray ({placement.describe()})"
    logger.info(
        "%d ranks %s (tensor parallel %d x pipeline stages %d, gloo), rank 0 in the engine's process",
        size, where, config.tensor_parallel_size, config.pipeline_parallel_size,
    )  # fmt: skip
    return ParallelRunner(runner, tp, workers, stage, release)


def _start_process_rank(spec: RankSpec) -> ProcessRank:
    return ProcessRank(start_child(rank_worker.rank_main, spec, name=f"batchserve-tp-rank{spec.rank}"))
