"""Text into token ids: a tokenizer.json loaded, and the exact fast engine."""
