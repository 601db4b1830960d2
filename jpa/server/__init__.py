"""The OpenAI-compatible server over `jpa.engine.AsyncEngine` (needs the `serve` extra)."""

from jpa.server.app import attach, build_app
from jpa.server.transport import server_config

__all__ = ["attach", "build_app", "server_config"]
