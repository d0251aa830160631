"""The daemon's core: registry, memory, data plane, peers, commits, leases, transfers.

Nothing here imports grpc or the generated message code: the servers in ``kvd.server`` translate
between the wire and these modules, so the core is tested without a server. The core does use
the wire's grpc-free types from the client layer (``kvd_client.errors``, the generated records
and enums of ``kvd_client.v1.schema``); tests/unit/test_architecture.py checks both rules.
"""
