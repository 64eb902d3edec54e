"""The `autopar` command line (entry point: api.cli.entry, main() with a quick exit)."""

from api.cli.main import entry, main

__all__ = ["entry", "main"]
