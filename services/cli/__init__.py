"""The `kuberl` command line: one subcommand per role, plus `up` (a whole local run) and `stats`."""
