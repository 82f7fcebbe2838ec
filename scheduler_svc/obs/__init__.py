"""Observability: the engine's observer hooks, Prometheus metrics under vLLM's names and the
dashboard's history."""
