"""Configuration: the config file into frozen, self-validating specs."""
