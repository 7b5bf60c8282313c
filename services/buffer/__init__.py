"""The buffer service: stores experience and streams training batches. Never imports torch."""
