"""Text into token ids: a tokenizer.json loaded, and the exact fast engine."""

# How many processes of one build share this machine, each with a tiktoken engine: each one's
# threads take that part of fasttok.OWN_ENCODINGS_BYTES for Encodings of their own. Set in the
# environment (so that the processes a build starts inherit it) by `tokenfeed build`
# (offline/buildpool.py) and by the Ray build's workers; 1 where unset.
ENGINE_PROCESSES_ENV = "TOKENFEED_ENGINE_PROCESSES"
