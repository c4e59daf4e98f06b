"""Observability: Prometheus metrics and per-round timelines."""
