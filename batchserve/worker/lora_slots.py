"""The adapters a worker serves: loaded copies in host memory (max_cpu_loras, least recently used dropped beyond,
read again from their folder when asked for) and max_loras device slots in every projection (layers/lora.py),
least recently used reassigned. Each step: the adapters of its requests take slots (the scheduler never puts more
than max_loras in one step), and its tokens are grouped by adapter into the LoRAStep the model reads."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from batchserve.config import ModelConfig
from batchserve.core.outputs import SchedulerOutput
from batchserve.layers.lora import LoRAGroup, LoRASlots, LoRAStep
from batchserve.models.lora_adapters import LoRAAdapter, LoRALoadError, load_peft_adapter, target_shapes
from batchserve.request import LoRARequest

logger = logging.getLogger(__name__)

# a decoder layer's projections that take adapters: (attribute path, the targets of its slices in output order)
PROJECTIONS = (
    (("self_attn", "qkv_proj"), ("q_proj", "k_proj", "v_proj")),
    (("self_attn", "o_proj"), ("o_proj",)),
    (("mlp", "gate_up_proj"), ("gate_proj", "up_proj")),
    (("mlp", "down_proj"), ("down_proj",)),
)


class LoRAPool:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if config.num_experts > 0:
            raise LoRALoadError("LoRA adapters on a mixture-of-experts model are not served")
        self.config, self.dtype, self.device = config, dtype, device
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.known: dict[int, LoRARequest] = {}  # registered adapters, loaded or not
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # host copies, least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> device slot, least recently used first
        self.req_lora: dict[str, int] = {}  # requests the worker holds -> their adapter
        self.free_slots = list(range(max_loras - 1, -1, -1))  # popped from the end: slot 0 first
        self.layers: list[dict[str, LoRASlots]] = [self._attach(layer) for layer in model.layers]
        refresh = getattr(model, "refresh_decoder_loop", None)
        if refresh is not None:  # the native loop takes the slots as its ops' arguments: rebuilt with them
            refresh()
        self.num_loads = 0  # adapters read from their folder, since start
        # one group per adapter (the engine's); "request": one per request, the loop a grouping replaces
        # (benchmarks/lora.py measures the two)
        self.grouping = "adapter"
        # "native": the native kernel adds the deltas where it runs; "torch": the torch code always, a matmul each
        # (with grouping "request": the loop over requests that benchmarks/lora.py compares grouping against)
        self.delta_kernel = "native"

    def _attach(self, layer: nn.Module) -> dict[str, LoRASlots]:
        """Each projection of `layer` gets its slots (an attribute the model's `project` reads)."""
        sizes = target_shapes(self.config)
        slots = {}
        for path, targets in PROJECTIONS:
            linear = getattr(getattr(layer, path[0]), path[1])
            offsets = np.cumsum([0] + [sizes[t][0] for t in targets])
            slices = tuple((int(offsets[i]), sizes[t][0]) for i, t in enumerate(targets))
            in_features = sizes[targets[0]][1]
            pool = LoRASlots.allocate(slices, in_features, self.max_loras, self.max_rank, self.dtype, self.device)
            linear.lora_slots = pool
            slots[path[1]] = pool
        return slots

    # ---- adapters in and out ----------------------------------------------------------------------------------
    def read(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter's folder read and checked against the base, its weights laid out as the slots take them (no
        state of the pool changes: any thread; the server reads on a worker thread, so that taking a slot within a
        step is two copies a projection)."""
        adapter = load_peft_adapter(
            lora.lora_path, lora.lora_name, lora.lora_int_id, self.config, self.max_rank, self.dtype
        )
        for index, layer in enumerate(self.layers):
            for path, targets in PROJECTIONS:
                parts = [adapter.weights.get((index, target)) for target in targets]
                adapter.slot_rows[(index, path[1])] = layer[path[1]].rows_of(parts, adapter.rank)
        return adapter

    def add(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """Register and hold in host memory (`adapter`: read already; else read now)."""
        known = self.known.get(lora.lora_int_id)
        if known is not None and known != lora:
            raise LoRALoadError(f"lora_int_id {lora.lora_int_id} is {known.lora_name!r} already ({known.lora_path})")
        adapter = self._load(lora, adapter)
        self.known[lora.lora_int_id] = lora
        return adapter

    def remove(self, lora_id: int) -> None:
        """Forget an adapter: its host copy goes now unless a request still runs with it (then when the last one
        leaves); its slot is reassigned when needed."""
        self.known.pop(lora_id, None)
        if lora_id not in self.req_lora.values():
            self._drop(lora_id)

    def _drop(self, lora_id: int) -> None:
        self.loaded.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def _load(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        held = self.loaded.get(lora.lora_int_id)
        if held is not None:
            self.loaded.move_to_end(lora.lora_int_id)
            return held
        adapter = adapter if adapter is not None else self.read(lora)
        self.num_loads += 1
        self.loaded[lora.lora_int_id] = adapter
        in_use = set(self.req_lora.values())
        for lora_id in list(self.loaded):  # least recently used first; never one a request runs with
            if len(self.loaded) <= self.max_cpu_loras:
                break
            if lora_id not in in_use and lora_id != lora.lora_int_id:
                self.loaded.pop(lora_id)
        return adapter

    # ---- per step ---------------------------------------------------------------------------------------------
    def follow(self, output: SchedulerOutput) -> None:
        """The requests the worker holds, as the request table follows them."""
        for req_id in output.finished_req_ids:
            lora_id = self.req_lora.pop(req_id, 0)
            if lora_id and lora_id not in self.known and lora_id not in self.req_lora.values():
                self._drop(lora_id)  # removed while it ran: its last request has left
        for new in output.new_requests:
            if new.lora_id:
                self.req_lora[new.req_id] = new.lora_id
            else:
                self.req_lora.pop(new.req_id, None)

    def step(self, req_ids: Sequence[str], query_lens: np.ndarray) -> LoRAStep | None:
        """The step's grouping: the packed tokens of each adapter (requests in batch order, query_lens tokens each)."""
        ids = [self.req_lora.get(req_id, 0) for req_id in req_ids]
        distinct = list(dict.fromkeys(i for i in ids if i))
        if not distinct:
            return None
        if len(distinct) > self.max_loras:
            raise RuntimeError(f"{len(distinct)} adapters in one step; max_loras is {self.max_loras}")
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        groups = []
        members_of: dict = {}  # one pass over the batch: an adapter's requests (or each request alone)
        for i, lora_id in enumerate(ids):
            if lora_id:
                members_of.setdefault((i, lora_id) if self.grouping == "request" else lora_id, []).append(i)
        for key, members in members_of.items():
            lora_id = key if self.grouping != "request" else key[1]
            slot, adapter = self._slot(lora_id, distinct)
            rows = np.concatenate([np.arange(starts[i], ends[i]) for i in members])
            contiguous = int(rows[-1] - rows[0]) + 1 == len(rows)
            tensor = torch.from_numpy(rows.astype(np.int64)).to(self.device, non_blocking=True)
            groups.append(LoRAGroup(slot, adapter.rank, adapter.scale, tensor, int(rows[0]) if contiguous else -1))
        return LoRAStep(tuple(groups), native_kernel=self.delta_kernel == "native")

    def _slot(self, lora_id: int, this_step: list[int]) -> tuple[int, LoRAAdapter]:
        """The adapter's device slot, loading it there when it has none (into a free slot, else the least recently
        used slot of an adapter not in this step)."""
        adapter = self.loaded.get(lora_id)
        if adapter is None:  # dropped from host memory since: read again from its folder
            lora = self.known.get(lora_id)
            if lora is None:
                raise RuntimeError(f"adapter {lora_id} is neither loaded nor registered")
            adapter = self._load(lora)
        else:
            self.loaded.move_to_end(lora_id)
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot, adapter
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next(i for i in self.slot_of if i not in this_step)
            slot = self.slot_of.pop(victim)
        self._fill(slot, adapter)
        self.slot_of[lora_id] = slot
        return slot, adapter

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for index, layer in enumerate(self.layers):
            for path, _ in PROJECTIONS:
                layer[path[1]].load_rows(slot, adapter.slot_rows[(index, path[1])])
