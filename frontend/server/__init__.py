"""The OpenAI-compatible HTTP server (`tokenmill serve`)."""

from tokenmill.frontend.server.app import build_app, main, serve

__all__ = ["build_app", "main", "serve"]
