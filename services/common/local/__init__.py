"""Role processes on this machine: starting them, finding their ports, supervising and stopping them."""
