"""`kuberl <command>`: run one role (`actor`, `buffer`, `learner`), a whole local run (`up`), read `stats`,
print the `config`, or use a trained policy (`eval`, `export`, `serve`)."""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: kuberl <command> [args]

commands:
  up [CONFIG]   train locally: start a buffer, a learner and actors as processes (default: CartPole-v1 PPO)
  tune CONFIG   search hyper-parameters with Optuna: trials are `kuberl up` runs of CONFIG (docs/tuning.md)
  buffer        run a buffer service
  learner       run a learner service
  actor         run an actor service
  planner       run the planner service (balances actors and learners)
  stats ADDR    print a service's GetStats as JSON
  config [CONFIG]  print the config, every default filled in, a comment per key (--defaults: the default
                   config; --reference: docs/config.md, every key's type, default and meaning)

after training (docs/after-training.md):
  eval RUN_DIR_OR_CHECKPOINT   run the trained policy for N episodes: return and length statistics
                               (--json, --stochastic, --video FILE.mp4|FILE.gif)
  export CHECKPOINT            write the policy as one file for C++/C#/JS (--format onnx|torchscript)
  serve CHECKPOINT             serve the policy to simulators over Actor.EnvSession, as an inference-only
                               actor (--listen ADDR, default 0.0.0.0:50055; --stochastic,
                               --follow-learner ADDR)

planner API (--planner ADDR, default $KUBERL_PLANNER or 127.0.0.1:50054):
  plan [--apply]       preview the planner's decision now (or take and apply it)
  scale ROLE N         hold ROLE (actor|learner|buffer) at N replicas (--ttl seconds, default 3600;
                       buffer: N shards, reached one added or drained at a time)
  unscale ROLE         end that override; the planner takes the role back
  pause / resume       stop / restart applying decisions (they are still recorded)
  status               pause state, overrides, replicas, last decision
  decisions [-f]       the recorded decisions (follow new ones with -f)

TLS: every command takes --tls-ca/--tls-cert/--tls-key FILE over the config's tls section (docs/security.md).

`kuberl <command> --help` describes each command's flags.
"""
ROLES = ("actor", "buffer", "learner", "planner")
PLANNER_COMMANDS = ("plan", "scale", "unscale", "pause", "resume", "status", "decisions")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ROLES:  # a service process: it ends here, as `python -m services.<role>` does
        from services.common.service.runtime import exit_process
        exit_process(importlib.import_module(f"services.{cmd}.main").main(rest))
    if cmd == "up":
        from services.cli.up import main as up
        return up(rest)
    if cmd == "tune":
        from services.cli.tune import main as tune
        return tune(rest)
    if cmd in PLANNER_COMMANDS:
        from services.cli.plan import main as plan
        return plan(cmd, rest)
    if cmd == "eval":
        from services.cli.evaluate import main as evaluate
        return evaluate(rest)
    if cmd == "serve":  # a service process, as the roles are
        from services.common.service.runtime import exit_process, stop_cleanly_until_serving
        stop_cleanly_until_serving()
        from services.cli.serve import main as serve
        exit_process(serve(rest))
    if cmd == "export":
        from services.cli.export import main as export
        return export(rest)
    if cmd == "config":
        from services.cli.config_ref import main as config
        return config(rest)
    if cmd == "stats":
        from services.cli.stats import main as stats
        return stats(rest)
    print(f"kuberl: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
