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
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence

import torch

from batchserve.config import EngineConfig, ModelConfig
from batchserve.core.outputs import ModelOutput, SchedulerOutput
from batchserve.host.channel import ChildProcess, PeerDeadError, start_child
from batchserve.layers.parallel import PipelineStage, TensorParallel
from batchserve.worker import rank_worker
from batchserve.worker.rank_worker import RankFailed, RankSpec, Ready, ResizePool, Step

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600  # loading a shard of a large model from a cold disk


class RankDiedError(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot run another step."""


class ParallelRunner:
    """Rank 0's ModelRunner, driving the other ranks: what the engine sees as its runner. Attributes not defined
    here (the pool's sizes, the device, the model) are rank 0's runner's."""

    def __init__(self, runner, tp: TensorParallel, workers: list[ChildProcess], stage: PipelineStage | None = None):
        self.runner = runner
        self.tp = tp
        self.stage = stage
        self.workers = workers
        self._finalizer = weakref.finalize(self, _stop_workers, list(workers))
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
                worker.channel.send(message)
            except PeerDeadError as exc:
                raise self._rank_died(exc) from exc

    def _rank_died(self, cause: BaseException) -> BaseException:
        """RankDiedError naming the rank that failed (its report, else its exit code), the others stopped; `cause`
        itself when every rank lives (an error of rank 0's own)."""
        deadline = time.monotonic() + 2.0  # a rank that reported or died has its report or exit code in by then
        while time.monotonic() < deadline:
            failed = [_failure(rank, worker) for rank, worker in enumerate(self.workers, start=1)]
            failed = [f for f in failed if f is not None]
            if failed:
                self._finalizer()
                return RankDiedError(f"{'; '.join(failed)}: the engine cannot run another step")
            time.sleep(0.05)
        return cause


def _failure(rank: int, worker: ChildProcess) -> str | None:
    try:
        while worker.channel.poll(0):
            message = worker.channel.recv()
            if isinstance(message, RankFailed):
                return f"rank {rank} (pid {worker.pid}) failed: {message.error.splitlines()[0]}"
    except PeerDeadError:
        pass
    if worker.is_alive():
        return None
    return f"rank {rank} (pid {worker.pid}) died (exit code {worker.process.exitcode})"


def _stop_workers(workers: list[ChildProcess]) -> None:
    for worker in workers:
        worker.stop(timeout=5.0)


def start_tensor_parallel(config: EngineConfig, model_config: ModelConfig, initial_kv_blocks: int | None = None):
    """Start ranks 1..N-1 (one process each, on this host), load rank 0's shard here and its runner, tell the ranks
    the pool's size and wait until each is ready -> ParallelRunner."""
    size = config.tensor_parallel_size * config.pipeline_parallel_size
    store = rank_worker.rendezvous(0, size)
    shared = rank_worker.shared_buffers(config, model_config)
    tp_size = config.tensor_parallel_size
    workers = [
        start_child(rank_worker.rank_main, RankSpec(config, model_config, rank, size, store.port, shared[rank // tp_size]),
                    name=f"batchserve-tp-rank{rank}")
        for rank in range(1, size)
    ]  # fmt: skip
    try:
        tp, stage = rank_worker.init_groups(0, config, model_config, store)
        model, device, dtype = rank_worker.load_shard(config, model_config, tp, stage)
        local = rank_worker.rank_config(config, model_config, stage)
        pool = rank_worker.pool_size(config, local, dtype, device, initial_kv_blocks)
        runner = rank_worker.rank_runner(config, local, model, device, dtype, pool, stage)
        rank_worker.share(tp, shared[0], lambda: all(w.is_alive() for w in workers))
        for worker in workers:
            worker.channel.send(pool)
        for rank, worker in enumerate(workers, start=1):
            _wait_ready(rank, worker)
    except BaseException:
        _stop_workers(workers)
        raise
    logger.info(
        "%d ranks on this host (tensor parallel %d x pipeline stages %d, gloo), rank 0 in the engine's process",
        size, config.tensor_parallel_size, config.pipeline_parallel_size,
    )  # fmt: skip
    return ParallelRunner(runner, tp, workers, stage)


def _wait_ready(rank: int, worker: ChildProcess) -> None:
    try:
        message = worker.channel.recv(timeout=READY_TIMEOUT_S)
    except PeerDeadError:
        code = worker.process.exitcode
        raise RankDiedError(f"rank {rank} died while starting (exit code {code})") from None
    if isinstance(message, RankFailed):
        raise RankDiedError(f"rank {rank} failed to start: {message.error}")
    if not isinstance(message, Ready):
        raise RankDiedError(f"rank {rank}: unexpected message {type(message).__name__}")
