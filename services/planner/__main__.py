import os
import sys

# The local backend forks service processes while gRPC threads run; gRPC's fork handlers only log noise.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from services.planner.main import main  # noqa: E402

sys.exit(main())
