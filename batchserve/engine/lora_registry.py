"""The adapters an engine serves, by name: what a request's `model` (or LoRARequest) resolves to.

Loading goes through the worker's pool (worker/lora_slots.py), which reads and checks the folder; an adapter loaded
at run time gets the next free lora_int_id. Removing one refuses new requests for it at once; the requests already
running with it finish with it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from batchserve.config import parse_lora_modules
from batchserve.request import LoRARequest
from batchserve.sampling_params import InvalidRequestError

if TYPE_CHECKING:
    from batchserve.models.lora_adapters import LoRAAdapter
    from batchserve.worker.lora_slots import LoRAPool

logger = logging.getLogger(__name__)


class UnknownAdapterError(InvalidRequestError):
    """A request names an adapter this engine does not serve (HTTP 404 model_not_found)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the model '{name}' does not exist: no base model or LoRA adapter of that name", "model")
        self.name = name


class LoRARegistry:
    def __init__(self, pool: LoRAPool, base_names: tuple[str, ...] = ()) -> None:
        self.pool = pool
        self.by_name: dict[str, LoRARequest] = {}
        self.base_names = base_names  # names of the base model: never an adapter's
        self.served: tuple[LoRARequest, ...] = ()  # replaced whole on each change: other threads read it

    def add_modules(self, text: str | None) -> None:
        """--lora-modules "name=path ...": ids 1, 2, ... in the order given."""
        for name, path in parse_lora_modules(text).items():
            self.add(LoRARequest(name, self.next_id(), path))

    def next_id(self) -> int:
        return max([0, *self.pool.known]) + 1

    def add(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRARequest:
        """Serve `lora` (`adapter`: its folder already read; else read and checked now); the same request again is a
        no-op."""
        if self.check_name(lora):
            return lora
        adapter = self.pool.add(lora, adapter)
        self.by_name[lora.lora_name] = lora
        self.served = tuple(self.by_name.values())
        logger.info(
            "LoRA adapter %r (id %d) from %s: rank %d, scale %.4g, %s",
            lora.lora_name, lora.lora_int_id, lora.lora_path, adapter.rank, adapter.scale, ", ".join(sorted(adapter.targets)),
        )  # fmt: skip
        return lora

    def check_name(self, lora: LoRARequest) -> bool:
        """True if `lora` is served already; InvalidRequestError if its name is taken by another."""
        if lora.lora_name in self.base_names:
            raise InvalidRequestError(f"adapter name {lora.lora_name!r} is the base model's name", "lora_name")
        known = self.by_name.get(lora.lora_name)
        if known is not None and known != lora:
            raise InvalidRequestError(
                f"adapter {lora.lora_name!r} is already served (from {known.lora_path}); unload it first", "lora_name"
            )
        return known is not None

    def loaded_names(self) -> tuple[str, ...]:
        """The adapters held in host memory now, least recently used first (any thread: best effort, the engine
        thread may change the pool while this reads it)."""
        for _ in range(3):
            try:
                return tuple(self.pool.known[i].lora_name for i in list(self.pool.loaded) if i in self.pool.known)
            except RuntimeError:  # changed size while read: read again
                continue
        return ()

    def remove(self, name: str) -> LoRARequest:
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise UnknownAdapterError(name)
        self.served = tuple(self.by_name.values())
        self.pool.remove(lora.lora_int_id)
        logger.info("LoRA adapter %r (id %d) unloaded", name, lora.lora_int_id)
        return lora

    def resolve(self, name: str) -> LoRARequest:
        lora = self.by_name.get(name)
        if lora is None:
            raise UnknownAdapterError(name)
        return lora

    def names(self) -> list[str]:
        return list(self.by_name)

    def name_of(self, lora_id: int) -> str | None:
        return next((n for n, lora in self.by_name.items() if lora.lora_int_id == lora_id), None)
