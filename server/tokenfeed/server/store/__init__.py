"""The token store: a chunk's files, this node's store in the cache, the fleet's shared store."""
