"""The actor service: steps environments with a local policy and pushes fragments to a buffer."""
