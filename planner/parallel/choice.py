"""A value one parallelism dimension can take, and where the executor runs it and a test
checks it against the single-process reference (or why it is not executable yet).

tests/test_invariants.py fails when a dimension value the search can pick has neither."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    dimension: str  # the plan field it sets, e.g. "stages[].zero"
    value: object
    executor: str | None = None  # "module:function" that applies it
    test: str | None = None  # pytest node id of its equivalence test
    not_executable: str | None = None  # why not, when executor/test are None

    def __post_init__(self) -> None:
        if (self.executor is None or self.test is None) and not self.not_executable:
            raise ValueError(
                f"{self.dimension}={self.value!r}: needs executor and test, or a reason"
            )
