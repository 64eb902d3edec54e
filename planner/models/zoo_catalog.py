"""The zoo's names, families, parameter counts and configs without importing torch, so that
`autopar models` answers at once: zoo_catalog.json, written from the model families by
`python -m planner.models.zoo_catalog` and checked against them by
tests/planner/test_models.py::test_the_zoo_catalog_is_the_zoos."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PATH = Path(__file__).with_name("zoo_catalog.json")


def catalog() -> list[dict[str, Any]]:
    return json.loads(PATH.read_text())


def main() -> None:
    from planner.models import list_models

    PATH.write_text(json.dumps(list_models(), indent=1) + "\n")


if __name__ == "__main__":
    main()
