"""``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize``: what the served model is, and how it reads text."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from kvpool.serve.server_state import ServerState

__all__ = ["ModelRoutes"]


class ModelRoutes:
    """The model's card for a tenant, and its tokenizer for anyone (vLLM asks no key of ``/tokenize``)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def models(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        state = self.state
        state.tenant(request)
        card = {
            "id": state.config.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "kvpool",
            "max_model_len": state.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        from kvpool.serve.tokenize import tokenize_body

        state = self.state
        tenant = state.tokenizer_turn(request)
        body = await tokenize_body(await state.read_json(request), state.prompts, state.check_model, tenant)
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        from kvpool.serve.tokenize import detokenize_body

        state = self.state
        tenant = state.tokenizer_turn(request)
        body = await detokenize_body(await state.read_json(request), state.prompts, state.check_model, tenant)
        return JSONResponse(body)
