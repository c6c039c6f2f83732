"""The command line (app.py holds the typer app; one module per command group)."""

from elastictrain.cli.app import app, main

__all__ = ["app", "main"]
