"""The pooled gloo ranks (executor.local_ranks) of one test module are stopped after it: a
worker that goes on to other modules keeps no idle ranks (nor their gloo threads)."""

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="module")
def _rank_pool_per_module() -> Iterator[None]:
    yield
    from executor.local_ranks import close_pool

    close_pool()
