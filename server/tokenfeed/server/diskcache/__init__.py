"""The disk cache: one directory under one byte budget, its ledger and eviction policy."""
