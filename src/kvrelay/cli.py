"""The ``kvrelay`` command line: one subcommand per capability, each registered by its package.

Each module in ``COMMAND_MODULES`` defines ``register(subparsers)``, adding its subcommands
with ``set_defaults(func=...)``; ``func(args) -> int`` is the exit status. Modules import their
heavy dependencies (vLLM, torch) inside ``func``, so ``kvrelay --help`` stays fast and the
router works without vLLM installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES: tuple[str, ...] = (
    "kvrelay.cluster.cli",
    "kvrelay.fakevllm.cli",
    "kvrelay.router.cli",
    "kvrelay.bench.cli",
    "kvrelay.bench.demo_command",
    "kvrelay.tune.cli",
    "kvrelay.deploy.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrelay",
        description="KV-cache-aware routing for multi-turn traffic on P/D disaggregated vLLM.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args))


if __name__ == "__main__":
    sys.exit(main())
