"""`python -m microscale <command>`: each command lives in microscale/models/cli_<command>.py
and exposes add_arguments(parser) and run(args)."""

import argparse
import importlib
import pkgutil
import sys

from . import models


def _commands() -> dict:
    names = [m.name for m in pkgutil.iter_modules(models.__path__) if m.name.startswith("cli_")]
    return {n[len("cli_"):]: f"{models.__name__}.{n}" for n in sorted(names)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="microscale")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, modname in _commands().items():
        mod = importlib.import_module(modname)
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(p)
        modules[name] = mod
    args = parser.parse_args(argv)
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
