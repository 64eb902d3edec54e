"""Errors a user can act on.

Every error raised for bad input names the offending field and says what was expected, so the
CLI and the service can show it as is (never a stack trace).
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base class: the message is meant for the user."""


class InputError(AutoparError, ValueError):
    """Bad user input: `field` names where it is, `expected` says what would be valid."""

    def __init__(self, field: str, problem: str, expected: str | None = None):
        self.field = field
        self.problem = problem
        self.expected = expected
        text = f"{field}: {problem}"
        if expected:
            text += f" (expected {expected})"
        super().__init__(text)

    def __reduce__(self):  # raised in worker processes and sent back whole
        return (type(self), (self.field, self.problem, self.expected))


def input_error_from(err: object, prefix: str = "") -> InputError:
    """An InputError naming the first invalid field's full path (pydantic ValidationError)."""
    items = err.errors()  # type: ignore[attr-defined]
    loc = ".".join(str(p) for p in items[0]["loc"])
    field = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "<root>")
    problem = items[0]["msg"]
    if len(items) > 1:
        problem += f"; also: {format_pydantic_error(err, prefix)}"
    return InputError(field, problem)


def format_pydantic_error(err: object, prefix: str = "") -> str:
    """One line per problem, each naming the field path (pydantic ValidationError → text)."""
    lines = []
    for item in err.errors():  # type: ignore[attr-defined]
        loc = ".".join(str(p) for p in item["loc"])
        where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "<root>")
        lines.append(f"{where}: {item['msg']}")
    return "; ".join(lines)
