"""The RL rollout endpoints (vLLM's names), behind the API key as every route but /health:

    POST /pause?mode=abort|wait|keep   stop generation (`AsyncEngine.pause_generation`); answers once paused
    POST /resume                       go on (`resume_generation`)
    POST /update_weights               {"path": a safetensors file or directory of Hugging Face tensors}:
                                       served from the next round on, no compile; answers the new version
    GET  /weight_version               {"weight_version": n, "paused": bool}

A trainer's loop is pause -> update_weights -> resume (or update_weights alone: it is applied between two
rounds, requests in flight going on with the new weights, each token's version reported in
`RequestOutput.weight_versions`). Every completions and chat answer carries `weight_version`, the newest
weights its tokens were sampled with (in a stream: the usage chunk, with `stream_options.include_usage`). Errors are OpenAI error objects: 400 naming the parameter or the
tensor (the served weights stay as they were), 503 while the model loads or when the engine is down.
"""

import asyncio

from fastapi import FastAPI, Request

from jpa.engine.async_engine import PAUSE_MODES, EngineDead
from jpa.server.protocol import APIError, parse_json


def register(app: FastAPI, api) -> None:
    """Adds the endpoints to `app` (build_app's), serving api.engine (an AsyncEngine) once attached."""

    def engine():
        eng = api.ready().engine
        if not eng.alive:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_down")
        return eng

    async def call(f, *args):
        try:
            return await asyncio.to_thread(f, *args)
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_down") from None

    @app.post("/pause")
    async def pause(mode: str = "abort"):
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}", param="mode")
        await call(engine().pause_generation, mode)
        return {"paused": True, "mode": mode}

    @app.post("/resume")
    async def resume():
        engine().resume_generation()
        return {"paused": False}

    @app.get("/weight_version")
    async def weight_version():
        eng = engine()
        return {"weight_version": eng.engine.weight_version, "paused": eng.paused}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = parse_json(await request.body())
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise APIError(400, "the body must be {\"path\": a safetensors file or directory of Hugging Face "
                                "tensors}", param="path")
        try:
            version = await call(engine().update_weights, path)
        except (ValueError, FileNotFoundError) as e:
            raise APIError(400, f"update_weights: {e}", param="path") from None
        return {"weight_version": version}
