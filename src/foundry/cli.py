"""`foundry`: one command, many subcommands.

Subcommands live in ``foundry.commands.<name>``; each such module has ``register(subparsers)``
and is found by itself: adding a command means adding its module.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any

from foundry import __version__

# Every module of foundry.commands with a ``register`` function is a subcommand, in this order
# in ``--help`` (the workflow order: model, train, serve, operate); any others come after.
COMMAND_ORDER = ("model", "swarm", "tp", "gateway", "ctl", "up", "profile")


def command_modules() -> list[str]:
    import foundry.commands as package

    found = {m.name for m in pkgutil.iter_modules(package.__path__)}
    ordered = [n for n in COMMAND_ORDER if n in found]
    ordered += sorted(found - set(ordered))
    return [f"foundry.commands.{n}" for n in ordered]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it (``default``
    in the text), the flag has none (None, an on/off switch), or it is a positional."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default is None
            or action.default is argparse.SUPPRESS
            or isinstance(action.default, bool)
            or action.nargs == 0  # store_true, store_const, count, help, version
            or "default" in text.lower()
        ):
            return action.help
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class FoundryParser(argparse.ArgumentParser):
    """The parser of `foundry` and of every subcommand under it (``add_subparsers`` makes
    parsers of its own class): each shows its flags' defaults, and none takes a prefix of a
    flag for the flag (``--step`` is an error, not ``--steps``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def chosen_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` chose, e.g. `foundry ctl status`'s: the one whose
    usage an error about its flags should print."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if not subs or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def build_parser() -> argparse.ArgumentParser:
    parser = FoundryParser(
        prog="foundry",
        description=(
            "Train and serve a Mixture-of-Experts language model across the machines you own."
        ),
    )
    parser.add_argument("--version", action="version", version=f"foundry {__version__}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (default: INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in command_modules():
        module = importlib.import_module(name)
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = sys.argv[1:] if argv is None else list(argv)
    for n, arg in enumerate(arguments, start=1):
        # Bytes that are not UTF-8 reach Python as lone surrogates. Every text we take goes
        # on a wire or into a file as UTF-8, so refuse it here, once, for every command.
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raw = arg.encode("utf-8", "surrogateescape")
            parser.error(f"argument {n} ({raw!r}) is not valid UTF-8; foundry takes UTF-8 text")
    args, unknown = parser.parse_known_args(arguments)
    if unknown:
        # `foundry up --gpu`: the error and usage of `foundry up`, not of `foundry`.
        chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The gguf package narrates every file it writes at INFO; our own log line says it once.
    logging.getLogger("gguf").setLevel(logging.WARNING)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `foundry ctl status | head`: the reader left; not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not complain again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, ValueError) as exc:
        # A file that cannot be read or written, a value no flag check caught: one line, and
        # the traceback only on request.
        logging.getLogger("foundry").debug("failed", exc_info=True)
        print(f"error: {exc} (--log-level DEBUG shows where)", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
