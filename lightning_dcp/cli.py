"""``lightning-dcp`` command line: one subcommand per module of :mod:`lightning_dcp.commands`.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their command runs, so ``plan`` and
``simulate`` stay free of torch start-up cost where possible.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "plan": "lightning_dcp.commands.plan",
    "simulate": "lightning_dcp.commands.simulate",
    "profile": "lightning_dcp.commands.profile",
    "train": "lightning_dcp.commands.train",
    "encode": "lightning_dcp.commands.encode",
    "budget": "lightning_dcp.commands.budget",
    "export": "lightning_dcp.commands.export",
    "train-video": "lightning_dcp.commands.train_video",
}


class CLIError(Exception):
    """A user error: printed as ``lightning-dcp: error: ...`` with exit code 2, nothing written."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-dcp", description="Data-Centric Parallel planning, simulation, profiling and training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except CLIError as err:
        print(f"lightning-dcp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    # ``python -m lightning_dcp.cli``: run the package's own module, whose CLIError the commands raise
    # (this file, run as __main__, is a second module with a second CLIError class)
    from lightning_dcp.cli import main as _main

    sys.exit(_main())
