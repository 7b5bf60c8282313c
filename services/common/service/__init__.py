"""What every role process runs on: the lifecycle, arguments, logging and signals, stats, Prometheus."""
