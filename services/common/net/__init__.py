"""How roles reach each other: gRPC servers and channels, TLS, bearer tokens, buffer-shard addresses."""
