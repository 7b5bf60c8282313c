"""The learner service: trains on streamed batches, checkpoints, publishes versioned weights."""
