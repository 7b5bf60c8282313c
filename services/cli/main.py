"""`kuberl <command>`: run one role (`actor`, `buffer`, `learner`), a whole local run (`up`), or read `stats`."""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: kuberl <command> [args]

commands:
  up [CONFIG]   train locally: start a buffer, a learner and actors as processes (default: CartPole-v1 PPO)
  buffer        run a buffer service
  learner       run a learner service
  actor         run an actor service
  stats ADDR    print a service's GetStats as JSON

`kuberl <command> --help` describes each command's flags.
"""
ROLES = ("actor", "buffer", "learner")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ROLES:
        return importlib.import_module(f"services.{cmd}.main").main(rest)
    if cmd == "up":
        from services.cli.up import main as up
        return up(rest)
    if cmd == "stats":
        from services.cli.stats import main as stats
        return stats(rest)
    print(f"kuberl: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
