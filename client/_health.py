"""The stock gRPC health check (``grpc.health.v1.Health/Check``) without grpcio-health-checking.

The client installs with grpcio and protobuf only. The health messages are one-field messages:
``HealthCheckRequest{string service = 1}`` and ``HealthCheckResponse{ServingStatus status = 1}``
(an enum is a varint on the wire), byte-for-byte the encodings of protobuf's own
``StringValue`` and ``Int32Value`` wrappers, so those well-known types (de)serialize them. A
test checks the equivalence against grpc_health's generated messages.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.wrappers_pb2 import Int32Value, StringValue

CHECK_METHOD = "/grpc.health.v1.Health/Check"
SERVING = 1
"""``HealthCheckResponse.ServingStatus.SERVING``."""


def check_method(channel: Any) -> Any:
    """The unary Check callable on a sync or asyncio channel: request a service name, get a status."""
    return channel.unary_unary(
        CHECK_METHOD,
        request_serializer=StringValue.SerializeToString,
        response_deserializer=Int32Value.FromString,
    )


def check_request(service: str) -> StringValue:
    """The HealthCheckRequest for ``service`` ("" asks about the whole server)."""
    return StringValue(value=service)


def is_serving(response: Int32Value) -> bool:
    """Whether a HealthCheckResponse says SERVING."""
    return response.value == SERVING
