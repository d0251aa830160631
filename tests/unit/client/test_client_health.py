"""kvd_client._health speaks grpc.health.v1 without grpcio-health-checking."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2

from kvd_client import _health


@pytest.mark.parametrize("service", ["", "kvd.v1.RouterService"])
def test_request_bytes_are_a_health_check_request(service: str) -> None:
    ours = _health.check_request(service).SerializeToString()
    assert ours == health_pb2.HealthCheckRequest(service=service).SerializeToString()
    assert health_pb2.HealthCheckRequest.FromString(ours).service == service


@pytest.mark.parametrize("status", list(health_pb2.HealthCheckResponse.ServingStatus.values()))
def test_response_bytes_parse_to_the_same_status(status: int) -> None:
    wire = health_pb2.HealthCheckResponse(status=status).SerializeToString()
    parsed = _health.check_method.__globals__["Int32Value"].FromString(wire)
    assert parsed.value == status
    assert _health.is_serving(parsed) is (status == health_pb2.HealthCheckResponse.SERVING)


def test_method_path_is_the_stock_one() -> None:
    assert "/" + health_pb2.DESCRIPTOR.services_by_name["Health"].full_name + "/Check" == _health.CHECK_METHOD
