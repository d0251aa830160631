"""The data-plane worker process: NIXL, UCX and the engines' mapped memory, out of the control
process's crash domain (docs/architecture.md, "Processes").

Imports no gRPC and nothing of the control process's core; it shares only
:mod:`kvd.dataplane_protocol` with it. Started as ``python -m kvd.worker`` by kvd.core.workers.
"""
