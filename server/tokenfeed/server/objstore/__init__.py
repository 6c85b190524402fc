"""Object storage: sources and tokenizers by URI (local files, S3), ranged reads, pinned ETags."""
