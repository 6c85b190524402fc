"""A job at run time: its build, prefetch, progress, provenance and description."""
