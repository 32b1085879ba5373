"""Built-in environments (Ray actors implementing EnvironmentInterface)."""
