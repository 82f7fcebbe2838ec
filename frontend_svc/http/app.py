"""The FastAPI application: OpenAI routes, health, readiness, metrics, dashboard, API key."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend_svc.auth import check_key
from frontend_svc.http.context import HttpContext
from frontend_svc.http.errors import error_response, install_error_handlers
from frontend_svc.http.lora_routes import lora_router
from frontend_svc.http.openai_routes import openai_router
from frontend_svc.http.openapi import install_openapi
from frontend_svc.http.priority_routes import priority_router
from frontend_svc.http.responses_routes import responses_router
from frontend_svc.http.tokenize_routes import tokenize_router

# paths that never need the API key: probes and read-only operational pages (counts only).
# Not /cluster: it names hosts, pids and the addresses of workers and front-ends.
OPEN_PATHS = ("/health", "/ready", "/metrics", "/dashboard", "/")


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith("/dashboard/")


class ApiKeyMiddleware:
    """Pure ASGI (no response buffering, so streams and disconnects pass untouched)."""

    def __init__(self, app: ASGIApp, ctx: HttpContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.ctx.api_key or is_open_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        problem = check_key(header, self.ctx.api_key)
        if problem is None:
            await self.app(scope, receive, send)
            return
        self.ctx.rejected("unauthenticated")
        response = error_response(401, problem, None, "invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def create_app(ctx: HttpContext) -> FastAPI:
    app = FastAPI(
        title="splitserve",
        docs_url=None,  # the Swagger page loads scripts from a CDN
        redoc_url=None,
        openapi_url="/openapi.json",  # needs the key: http/openapi.py
    )
    install_openapi(app, bool(ctx.api_key), is_open_path)
    install_error_handlers(app, lambda: ctx.rejected("invalid"))
    if ctx.intake is not None:  # not on a scheduler whose front-ends run apart
        app.include_router(openai_router(ctx))
        app.include_router(responses_router(ctx))
        app.include_router(tokenize_router(ctx))
    if ctx.scheduler is not None:
        app.include_router(priority_router(ctx))
        app.include_router(lora_router(ctx))

    @app.get("/health")
    async def health() -> dict:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: at least one worker can take requests."""
        workers = ctx.live_workers()
        if ctx.shutting_down:
            return JSONResponse({"status": "shutting down", "workers": workers}, 503)
        if not workers:
            return JSONResponse({"status": "no worker attached", "workers": []}, 503)
        return JSONResponse({"status": "ready", "workers": workers})

    @app.get("/metrics")
    async def metrics() -> Response:
        # async on purpose: collectors read the scheduler's state, which lives on this loop
        if ctx.metrics is None:
            return error_response(404, "metrics are not enabled on this server")
        return Response(generate_latest(ctx.metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/cluster")
    async def cluster() -> JSONResponse:
        """Schedulers (role, epoch), front-ends and workers, as the leader sees them."""
        body = ctx.cluster() if ctx.cluster is not None else None
        if body is None:
            return error_response(503, "no scheduler leader is connected; retry later")
        return JSONResponse(body)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    if ctx.dashboard is not None:
        from frontend_svc.http.dashboard_routes import dashboard_router

        app.include_router(dashboard_router(ctx))

    app.add_middleware(ApiKeyMiddleware, ctx=ctx)
    return app
