"""The `autopar` command line: one module per command group under api/cli/, each adding its
parsers; errors name the request field and the flag that sets it."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from typing import NoReturn

import api.cli.catalog as catalog
import api.cli.compare_plans as compare_plans
import api.cli.estimate as estimate
import api.cli.execute as execute
import api.cli.export as export
import api.cli.plan as plan
import api.cli.profile as profile
import api.cli.serve as serve
import api.cli.shard as shard
import api.cli.size as size
import api.cli.trace as trace
from api.cli.common import flag_for
from api.quiet import quiet_third_party_logs
from planner.errors import AutoparError, InputError


def _says_nothing(default) -> bool:
    """None, False (a flag's off) and SUPPRESS are no default worth stating; 0 is."""
    return default is None or default is False or default is argparse.SUPPRESS


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that states each option's default (not None, False or a help-less positional)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = _says_nothing(action.default) or not action.option_strings
        if quiet or "%(default)" in text or "default:" in text:
            return text
        return f"{text} (default: %(default)s)".strip()


class Parser(argparse.ArgumentParser):
    """argparse with defaults in --help, for every sub-command (subparsers take this class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if not kwargs.get("help") and not _says_nothing(kwargs.get("default")):
            kwargs["help"] = "(default: %(default)s)"  # shown even without a help text
        return super().add_argument(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from planner import __version__

    parser = Parser(prog="autopar", description="Auto-parallelism planner for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (catalog, trace, estimate, execute, export, shard, plan, size, compare_plans):
        module.add_parsers(sub)
    profile.add_profile_parsers(sub)
    serve.add_parsers(sub)
    p = sub.add_parser("completion", help="print the shell completion script")
    p.add_argument("--shell", choices=["bash", "zsh"], default="bash")
    p.set_defaults(func=cmd_completion)
    return parser


def cmd_completion(args: argparse.Namespace) -> int:
    """The script that makes the shell complete autopar's commands and flags (argcomplete):
    `eval "$(autopar completion)"` in ~/.bashrc, `--shell zsh` in ~/.zshrc."""
    import argcomplete

    print(argcomplete.shellcode(["autopar"], shell=args.shell))
    return 0


def main(argv: list[str] | None = None) -> int:
    quiet_third_party_logs()
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions: answer and exit
        import argcomplete

        argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except AutoparError as err:
        flag = flag_for(err.field) if isinstance(err, InputError) else None
        where = f" ({flag})" if flag and flag != err.field else ""
        text = f"{err.field}{where}: {str(err).split(': ', 1)[1]}" if where else str(err)
        print(f"error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # an internal error: say so briefly, keep the trace for debugging
        if os.environ.get("AUTOPAR_DEBUG"):
            raise
        print(
            f"internal error: {type(err).__name__}: {err} (set AUTOPAR_DEBUG=1 for details)",
            file=sys.stderr,
        )
        return 1
    return code or 0


def entry() -> NoReturn:
    """The `autopar` command: main(), the exit handlers (logging's flush, multiprocessing's
    and weakref finalizers), then an immediate exit. The interpreter's own teardown, freeing
    a cold plan's traced graphs and tables one object at a time, and torch's, took ~1 s of a
    7 s `autopar plan` and frees nothing the operating system does not (mypy exits so too)."""
    code = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
