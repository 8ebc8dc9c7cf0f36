"""Agent workers: where handoffs are taken from an agent's inbox and handled."""
