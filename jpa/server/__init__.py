"""The OpenAI-compatible server over `jpa.engine.AsyncEngine` (needs the `serve` extra)."""

from jpa.server.app import attach, build_app
from jpa.server.limits import ConstraintLimits
from jpa.server.run import build_server, run_server
from jpa.server.transport import server_config

__all__ = ["ConstraintLimits", "attach", "build_app", "build_server", "run_server", "server_config"]
