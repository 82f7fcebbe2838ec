"""The scheduler's HTTP side: OpenAI-compatible API, /metrics, /health, /ready, dashboard."""

from frontend_svc.http.app import create_app
from frontend_svc.http.context import HttpContext
from frontend_svc.http.server import HttpServer

__all__ = ["HttpContext", "HttpServer", "create_app"]
