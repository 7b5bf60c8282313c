"""The planner: reads every service's rates and rewrites replica counts (docs/architecture.md
section 4)."""

import os

# The local backend forks service processes while gRPC threads run; gRPC's fork handlers only add log
# noise there. Set before grpc is first imported by this process (it reads it at import).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
