"""`autopar serve`: the REST service under uvicorn; refuses to be open to the network by mistake."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from api.cli.common import (
    count,
)
from planner.errors import InputError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.service.app import create_app
    from api.service.settings import LOOPBACK_HOSTS, Settings

    settings = Settings.from_env()
    if not settings.tokens and not is_loopback(args.host) and not args.insecure:
        raise InputError(
            "--host",
            f"{args.host} is reachable from other machines and AUTOPAR_API_TOKENS is not set",
            "a loopback host, tokens in AUTOPAR_API_TOKENS, or --insecure",
        )
    if not 0 < args.port < 65536:
        raise InputError("--port", f"{args.port} is out of range", "1-65535")
    if not settings.allowed_hosts and not settings.tokens and args.host not in ("0.0.0.0", "::"):
        # The name the service was asked to listen on is one its clients use.
        host = f"[{args.host}]" if ":" in args.host else args.host
        settings = settings.model_copy(update={"allowed_hosts": frozenset({*LOOPBACK_HOSTS, host})})
    print(
        f"autopar service on http://{args.host}:{args.port} (docs: /docs, store: "
        f"{settings.database_url.split('@')[-1]})",
        file=sys.stderr,
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="run the REST service (uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=count(1, 65535), default=8000)
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback host without AUTOPAR_API_TOKENS",
    )
    p.set_defaults(func=cmd_serve)
