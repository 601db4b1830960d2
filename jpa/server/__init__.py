"""The OpenAI-compatible server over `jpa.engine.AsyncEngine` (needs the `serve` extra)."""

from jpa.server.app import build_app

__all__ = ["build_app"]
