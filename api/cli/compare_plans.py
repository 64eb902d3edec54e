"""`autopar compare A.json B.json`: two plans side by side (the figures and their ratios), and
with --html the comparison page the service serves at /v1/plans/compare."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from api.render import table
from planner.errors import InputError


def _read(path: str, field: str):
    from planner.plan import Plan

    try:
        text = Path(path).read_text()
    except OSError as err:
        raise InputError(field, f"cannot read {path}: {err.strerror}") from None
    return Plan.from_json(text, field=field)


def cmd_compare(args: argparse.Namespace) -> int:
    from api.viewer import render_compare_page
    from api.viewer_compare import rows

    a, b = _read(args.a, "A"), _read(args.b, "B")
    print(table(["", "A", "B", "B against A"], rows(a, b)))
    if args.html:
        names = (Path(args.a).stem, Path(args.b).stem)
        Path(args.html).write_text(render_compare_page(a, b, names))
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("compare", help="two plans side by side: figures and their ratios")
    p.add_argument("a", metavar="A.json", help="a Plan JSON (autopar plan / estimate -o)")
    p.add_argument("b", metavar="B.json", help="another Plan JSON")
    p.add_argument("--html", help="also write the comparison page (self-contained HTML) here")
    p.set_defaults(func=cmd_compare)
