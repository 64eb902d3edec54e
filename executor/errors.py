"""Errors of the executor that a user can act on."""

from planner.errors import AutoparError


class ExecutionError(AutoparError):
    """The plan cannot be run as given (names the stage, node or setting)."""
