"""The scheduler's HTTP side: OpenAI-compatible API, /metrics, /health, /ready, dashboard."""

from scheduler_svc.http.app import create_app
from scheduler_svc.http.context import HttpContext
from scheduler_svc.http.server import HttpServer

__all__ = ["HttpContext", "HttpServer", "create_app"]
