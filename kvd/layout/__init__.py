"""Pure descriptions of KV caches and of the plans that move them (no I/O, no NIXL, no gRPC)."""
