"""What runs in the `pagoda serve` parent process: launcher, CLI, startup check, clients."""
