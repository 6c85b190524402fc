"""The gRPC service, its port (health, TLS, tokens), the daemon, and its serving workers."""
