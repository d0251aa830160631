"""The kvd.v1 wire modules, for callers that build messages: ``from kvd_client import pb``.

``pb.common_pb2.KvLayoutSpec(...)``, ``pb.router_pb2.StartPullRequest(...)``. The generated code
lives in ``kvd_client.v1`` (``python tools/gen_proto.py``); this module only gathers it.
"""

from kvd_client.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

__all__ = ["common_pb2", "engine_pb2", "engine_pb2_grpc", "router_pb2", "router_pb2_grpc"]
