"""The daemon's core: registry, memory, data plane, peers, commits, leases, transfers.

Nothing here imports grpc or the generated wire code: the servers in ``kvd.server`` translate
between the wire and these modules, so the core is tested without a server.
"""
