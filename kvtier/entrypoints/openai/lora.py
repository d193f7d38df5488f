"""LoRA adapters on the server. `--lora-modules NAME=PATH ...` loads adapters at start-up
(kvtier/entrypoints/serve.py); a request's `model` picks one by name. With
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (vLLM's switch for the same endpoints) adapters are also
loaded and unloaded at run time: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}; both answer plain text, as vLLM does.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import BadRequestError, NotFoundError
from kvtier.entrypoints.openai.generation import to_api_error
from kvtier.lora import LoRAError, LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

router = APIRouter()


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name says which adapter


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    ctx: ServerContext = raw.app.state.ctx
    name = body.lora_name
    if name in ctx.lora_modules or name in ctx.served_model_names:
        raise BadRequestError(f"the model name {name!r} is already served; unload it first",
                              param="lora_name", code="lora_already_loaded")
    loras = ctx.engine.loras
    if loras is not None:
        # Not served, yet loaded: an unload raced a request that loaded it again.
        loras.remove(name)
    try:
        request = ctx.new_lora_request(name, body.lora_path)
        # Shielded: a load that outlives the client's wait still ends served, not loaded in
        # the engine under a name the server does not know (which could then not be unloaded).
        await asyncio.shield(_load(ctx, request))
    except LoRAError as exc:
        raise BadRequestError(str(exc), param="lora_name" if not name else "lora_path") \
            from exc
    except Exception as exc:
        raise to_api_error(exc) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def _load(ctx: ServerContext, request: LoRARequest) -> None:
    await ctx.async_llm.load_lora(request)
    ctx.lora_modules[request.lora_name] = request


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest,
                              raw: Request) -> PlainTextResponse:
    ctx: ServerContext = raw.app.state.ctx
    name = body.lora_name
    served = ctx.lora_modules.pop(name, None) is not None
    loras = ctx.engine.loras
    # Requests running with it keep it until they end; new ones cannot name it.
    if not (loras is not None and loras.remove(name)) and not served:
        raise NotFoundError(f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                            code="lora_not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
