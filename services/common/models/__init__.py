"""Torch building blocks of every algorithm's networks, and the policy heads (the only torch in common/)."""
