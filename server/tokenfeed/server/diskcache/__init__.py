"""The disk cache: one directory under one byte budget and its ledger; which entry goes is the
policy its owner gives (jobs/future.py: Belady, from the jobs' known future)."""
