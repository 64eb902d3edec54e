"""The `autopar` command line (entry point: api.cli.main)."""

from api.cli.main import main

__all__ = ["main"]
