"""One module per parallelism technique. Each gives its search dimension (the values the
search may choose, with the executor path and equivalence test of each: `CHOICES`), its
time and memory terms for the evaluator, and the plan fields it sets."""

from __future__ import annotations
