"""/dashboard (the page), /dashboard/api/state (JSON), /dashboard/api/events (SSE, 1 s): the
scheduler's state (scheduler_svc/obs/dashboard_history.py) as its HTTP server shows it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from frontend_svc.http.context import HttpContext

PAGE = Path(__file__).with_name("static") / "index.html"


def dashboard_router(ctx: HttpContext) -> APIRouter:
    router = APIRouter()
    snapshot = ctx.dashboard
    assert snapshot is not None
    page = PAGE.read_text(encoding="utf-8")

    @router.get("/dashboard", response_class=HTMLResponse)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/api/state")
    async def dashboard_state() -> JSONResponse:
        return JSONResponse(snapshot(), headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/api/events")
    async def dashboard_events(request: Request, interval: float = 1.0) -> StreamingResponse:
        interval = min(10.0, max(0.2, interval))

        async def events():
            while not await request.is_disconnected():
                yield f"data: {json.dumps(snapshot(), separators=(',', ':'))}\n\n"
                await asyncio.sleep(interval)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    return router
