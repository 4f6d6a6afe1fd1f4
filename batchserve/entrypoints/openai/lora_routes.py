"""LoRA adapters over HTTP (vLLM's routes): a request's `model` names its adapter; /v1/models lists each adapter with
its `parent`; POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the served set at run time, only on a
server started with --allow-runtime-lora-updating (docs/lora.md)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.front import OpenAIFrontEnd
from batchserve.entrypoints.openai.protocol import ModelCard
from batchserve.request import LoRARequest
from batchserve.sampling_params import InvalidRequestError


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides


def adapter_cards(client: Any, parent: str, card: dict[str, Any]) -> list[ModelCard]:
    """One card per adapter served now, its base model as `parent` and its folder as `root`."""
    listed = getattr(client, "list_loras", None)
    if listed is None:
        return []
    return [ModelCard(id=lora.lora_name, parent=parent, **{**card, "root": lora.lora_path}) for lora in listed()]


def add_lora_routes(app: FastAPI, front: OpenAIFrontEnd, client: Any) -> None:
    if getattr(client, "lora_names", None) is not None:
        front.adapter_names = client.lora_names

    def runtime_updates() -> None:
        if not getattr(client.config, "allow_runtime_lora_updating", False):
            raise APIError(
                403, "loading and unloading adapters at run time is off: start the server with "
                "--allow-runtime-lora-updating (docs/lora.md)", type_="permission_error", code="lora_updates_off",
            )  # fmt: skip
        if not getattr(client.config, "enable_lora", False):
            raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora", code="lora_off")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        runtime_updates()
        req = await front.parse(request, LoadLoRARequest)
        if req.lora_name in front.served_model_names:
            raise InvalidRequestError(f"adapter name {req.lora_name!r} is the base model's name", "lora_name")
        lora = LoRARequest(req.lora_name, await client.call(lambda e: e.loras.next_id()), req.lora_path)
        try:
            await client.add_lora(lora)
        except ValueError as exc:  # a folder that cannot be served, a name in use: the client's to fix
            raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        runtime_updates()
        req = await front.parse(request, UnloadLoRARequest)
        if req.lora_name not in front.adapter_names():
            raise front.model_not_found(req.lora_name)
        await client.remove_lora(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
