"""The gRPC edge of the daemon: thin servicers that translate wire <-> core and map errors."""
