"""What travels between roles: the Tensor codec, trajectory fragments, versioned weights, action spaces."""
