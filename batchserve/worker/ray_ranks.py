"""Ranks placed by Ray (distributed_executor_backend "ray", vLLM's name): ranks 1..N-1 run as Ray actors, one a
bundle of a placement group of N bundles (one a rank, each as many CPUs as the rank's threads). Rank 0 stays in the
engine's process, with the scheduler, as under "mp"; its bundle is pinned to this process's node so that the CPUs
it computes on are reserved too. The other bundles go where the cluster has room (PACK: this node first).

The executor is the same (worker/parallel_executor.py): each step's Step, the pool's PoolSize and ResizePool reach a
rank as the argument of one actor call instead of a channel message, in order (a Ray actor runs one caller's calls in
the order they were made). The ranks' collectives are gloo's over TCP, meeting at rank 0's store on its node's
address: the shared-memory all-reduce needs the ranks on one host, which a placement does not promise.

A cluster without the CPUs for every bundle is refused before anything starts (ConfigError naming the CPUs needed
and free), and a placement group the cluster cannot place within PLACE_TIMEOUT_S is removed and refused the same
way: never left pending. A rank that raises ends its process (so that the collective rank 0 waits in fails at once,
as a dead peer's does), and its error comes back as the result of its call; a rank killed outright comes back as
Ray's actor error. Either becomes the executor's RankDiedError naming the rank.

The model's path must be readable at the same path on every node, and batchserve importable there.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from batchserve.config import ConfigError, EngineConfig
from batchserve.host.channel import PeerDeadError
from batchserve.worker import rank_worker
from batchserve.worker.rank_worker import PoolSize, RankDiedError, RankSpec, Ready

logger = logging.getLogger(__name__)

PLACE_TIMEOUT_S = 10.0  # a group whose CPUs are free is placed in well under this; past it, refused (not pending)
EXIT_AFTER_ERROR_S = 0.5  # a failed rank lives this long after raising: its error reaches rank 0 first


def _ray():
    try:
        import ray
    except ImportError as exc:  # config.validate checks first; this is the message if ray breaks on import
        raise ConfigError(
            "distributed_executor_backend ray needs the ray package: pip install 'batchserve[distributed]'"
        ) from exc
    return ray


@dataclass
class Placement:
    """The placement group of one engine's ranks; rank 0's bundle on this node."""

    group: object
    host: str  # this node's address: rank 0's rendezvous store listens there
    threads: int
    started_ray: bool  # this engine started the local Ray instance (and shuts it down with its ranks)
    actors: list = field(default_factory=list)

    def start(self, spec: RankSpec) -> RayRank:
        """Rank spec.rank as an actor in its bundle, its start (groups joined, shard loaded) under way."""
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=spec.rank)
        actor_class = ray.remote(RankActor)
        actor = actor_class.options(num_cpus=self.threads, scheduling_strategy=strategy, max_restarts=0).remote(spec)
        self.actors.append(actor)
        return RayRank(actor, [actor.load.remote()])

    def describe(self) -> str:
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self.group)["bundles_to_node_id"]
        return f"{len(set(nodes.values()))} node(s), {len(nodes)} bundles of {self.threads} CPU(s)"

    def release(self) -> None:
        """The actors killed, the group removed, and a Ray instance this engine started shut down."""
        ray = _ray()
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.group)
        if self.started_ray:
            ray.shutdown()


def place(config: EngineConfig, size: int) -> Placement:
    """A placement group of `size` bundles of num_threads CPUs (1 when unset), bundle 0 on this node; ConfigError
    when the cluster lacks the CPUs, before any group is made."""
    ray = _ray()
    started = not ray.is_initialized()
    if started:  # RAY_ADDRESS names a cluster to join; else Ray starts a local instance
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    threads = config.num_threads or 1
    needed, free = size * threads, ray.available_resources().get("CPU", 0.0)
    if free < needed:
        _refuse(ray, started, f"needs {needed} CPUs ({size} ranks x {threads} threads), the Ray cluster has "
                              f"{free:g} available ({ray.cluster_resources().get('CPU', 0.0):g} in all)")  # fmt: skip
    from ray.util.placement_group import placement_group, remove_placement_group

    node = ray.get_runtime_context().get_node_id()
    group = placement_group(
        [{"CPU": threads}] * size,
        strategy="PACK",
        bundle_label_selector=[{"ray.io/node-id": node}] + [{}] * (size - 1),
    )
    if not group.wait(PLACE_TIMEOUT_S):
        remove_placement_group(group)
        cpus = _cpus_by_node(ray)
        here = cpus.get(node[:8], 0.0)
        _refuse(ray, started, f"needs {size} bundles of {threads} CPUs, rank 0's on this node ({here:g} CPUs in all "
                              f"here), and the Ray cluster could not place them within {PLACE_TIMEOUT_S:g} s (CPUs by "
                              f"node, in use or not: {cpus})")  # fmt: skip
    return Placement(group, ray.util.get_node_ip_address(), threads, started)


def _refuse(ray, started: bool, what: str) -> None:
    if started:
        ray.shutdown()
    raise ConfigError(
        f"distributed_executor_backend ray: the placement group {what}; add nodes or CPUs, or lower num_threads, "
        "tensor_parallel_size or pipeline_parallel_size"
    )


def _cpus_by_node(ray) -> dict[str, float]:
    return {n["NodeID"][:8]: n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]}


class RankActor:
    """A rank other than 0 as a Ray actor: rank_worker's start and messages, called by rank 0."""

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.shard = None
        self.runner = None

    def load(self) -> int:
        """Join the groups and load the shard (rank 0 does the same at once) -> this process's pid."""
        with _exit_on_error():
            self.shard = rank_worker.join_and_load(self.spec)
        return os.getpid()

    def handle(self, message) -> Ready | None:
        with _exit_on_error():
            if isinstance(message, PoolSize):
                self.runner = rank_worker.shard_runner(self.spec, self.shard, message)
                return Ready(self.spec.rank)
            rank_worker.handle(self.runner, message)
            return None


class _exit_on_error:
    """A rank that raised ends its process shortly after (its error returned first): its gloo peers then fail at
    once, as with a dead rank, instead of waiting in a collective until it times out."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None:
            threading.Timer(EXIT_AFTER_ERROR_S, os._exit, (1,)).start()
        return False


class RayRank:
    """Rank 0's hold on a rank actor (parallel_executor.RankHandle): its calls in flight, reaped each send."""

    def __init__(self, actor, pending: list):
        self.actor = actor
        self.pending = pending
        self.pid: int | None = None
        self.error: str | None = None
        self.rank: int | None = None  # set by wait_ready

    def send(self, message) -> None:
        self._reap(0)
        if self.error is not None:
            raise PeerDeadError(self.error)
        self.pending.append(self.actor.handle.remote(message))

    def wait_ready(self, rank: int, timeout: float) -> None:
        ray = _ray()
        self.rank = rank
        try:
            self.pid, ready = ray.get(self.pending, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RankDiedError(f"rank {rank} did not start within {timeout:g} s") from None
        except ray.exceptions.RayError as exc:
            raise RankDiedError(f"rank {rank} failed to start: {_first_line(exc)}") from None
        self.pending = []
        if not isinstance(ready, Ready):
            raise RankDiedError(f"rank {rank}: unexpected reply {type(ready).__name__}")

    def failure(self, rank: int) -> str | None:
        self._reap(0)
        return self.error

    def _reap(self, timeout: float) -> None:
        """Results of the calls that finished: the first failure kept, described, as `error`."""
        if not self.pending:
            return
        ray = _ray()
        done, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=timeout)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self.error = self.error or f"rank {self.rank} (pid {self.pid}) died: {_first_line(exc)}"
            except ray.exceptions.RayError as exc:
                self.error = self.error or f"rank {self.rank} (pid {self.pid}) failed: {_first_line(exc)}"

    def is_alive(self) -> bool:
        ray = _ray()
        try:
            ray.get(self.actor.__ray_ready__.remote(), timeout=2.0)
        except ray.exceptions.GetTimeoutError:
            return True  # busy with a call of rank 0's
        except ray.exceptions.RayError:
            return False
        return True

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)

    def stop(self) -> None:
        ray = _ray()
        if ray.is_initialized():
            ray.kill(self.actor, no_restart=True)


def _first_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError's: the rank's own exception
    text = repr(cause) if isinstance(cause, BaseException) else str(exc)
    return next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
