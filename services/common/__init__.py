"""Code shared by two or more services. Imports no service; nothing here but models/ imports torch.

Layered, each layer importing only those below it (an import-linter contract in pyproject.toml):

- service/: what every role process runs on: the lifecycle, arguments, logging and signals, Prometheus.
- local/: role processes started on this machine (`kuberl up`, the planner's local backend).
  models/: the torch building blocks of every algorithm's networks, and the policy heads.
- envs.py: the environments actors step and the spaces networks see.
- config/: the experiment config's sections that every role reads, a module per concern.
- net/: how roles reach each other: gRPC servers and channels, TLS, tokens, buffer-shard addresses.
- protocol/: what travels between roles: the Tensor codec, fragments, weights, action spaces.
  settings.py (typed settings), stats.py (a service's counters and rates), atomic.py (crash-safe
  files), notify.py (an asyncio broadcast).
"""
