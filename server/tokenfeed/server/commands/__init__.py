"""The command line: serve, build, inspect, explain, describe; make demo."""
