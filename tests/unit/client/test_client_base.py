"""The pure rules both clients share: request building, deadlines, transfer outcomes, mapping."""

from __future__ import annotations

import math

import grpc
import pytest

from kvd_client import _base, errors
from kvd_client.grpc_errors import error_code, error_metadata, status_code, to_kvd_error
from kvd_client.v1 import common_pb2, engine_pb2, router_pb2


def test_build_request_sets_only_given_fields() -> None:
    req = _base.build_request(engine_pb2.HoldBlocksRequest, None, engine_id="e", request_id=None, block_ids=[1, 2])
    assert req == engine_pb2.HoldBlocksRequest(engine_id="e", block_ids=[1, 2])


def test_build_request_passes_a_prebuilt_request_through() -> None:
    req = router_pb2.GetTransferRequest(transfer_id="t")
    assert _base.build_request(router_pb2.GetTransferRequest, req, transfer_id=None) is req


def test_build_request_refuses_ambiguity_and_wrong_types() -> None:
    req = router_pb2.GetTransferRequest(transfer_id="t")
    with pytest.raises(TypeError, match="transfer_id"):
        _base.build_request(router_pb2.GetTransferRequest, req, transfer_id="u")
    with pytest.raises(TypeError):
        _base.build_request(router_pb2.GetTransferRequest, router_pb2.GetStatusRequest())


def test_grpc_timeout() -> None:
    assert _base.grpc_timeout(None, 10.0) == 10.0
    assert _base.grpc_timeout(2.5, 10.0) == 2.5
    assert _base.grpc_timeout(None, None) is None
    assert _base.grpc_timeout(math.inf, 10.0) is None
    with pytest.raises(ValueError):
        _base.grpc_timeout(-1, 10.0)


def test_time_left() -> None:
    assert _base.time_left(None) == math.inf
    assert _base.time_left(0.0) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "state",
    [
        common_pb2.TRANSFER_STATE_PLANNED,
        common_pb2.TRANSFER_STATE_READING,
        common_pb2.TRANSFER_STATE_POSTPROCESSING,
        common_pb2.TRANSFER_STATE_DONE,
    ],
)
def test_no_error_for_live_or_done_transfers(state: common_pb2.TransferState) -> None:
    assert _base.transfer_error(common_pb2.TransferStatus(state=state, error_code="X")) is None


def test_transfer_error_maps_code_names() -> None:
    status = common_pb2.TransferStatus(
        transfer_id="t",
        state=common_pb2.TRANSFER_STATE_FAILED,
        error_code="DEADLINE_EXCEEDED",
        error_message="pull of t ran past its deadline",
    )
    err = _base.transfer_error(status)
    assert type(err) is errors.DeadlineExceeded and "deadline" in str(err)
    with pytest.raises(errors.DeadlineExceeded):
        _base.final_status(status)


def test_transfer_error_with_unknown_code_falls_back() -> None:
    failed = common_pb2.TransferStatus(transfer_id="t", state=common_pb2.TRANSFER_STATE_FAILED, error_code="NONSENSE")
    err = _base.transfer_error(failed)
    assert type(err) is errors.Internal and "TRANSFER_STATE_FAILED" in str(err)
    aborted = common_pb2.TransferStatus(state=common_pb2.TRANSFER_STATE_ABORTED)
    assert type(_base.transfer_error(aborted)) is errors.Aborted


class _FakeRpcError(grpc.RpcError):
    """Enough of grpc.Call to be converted (sync errors carry tuples, aio errors Metadata)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: object) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> object:  # type: ignore[override]
        return self._trailing


def test_to_kvd_error_reads_class_from_either_metadata_shape() -> None:
    as_tuple = _FakeRpcError(
        grpc.StatusCode.NOT_FOUND, "no lease", (("other", "x"), ("kvd-error-class", "UnknownLease"))
    )
    assert type(to_kvd_error(as_tuple)) is errors.UnknownLease
    as_aio = _FakeRpcError(
        grpc.StatusCode.NOT_FOUND,
        "no engine",
        grpc.aio.Metadata(("kvd-error-class", "UnknownEngine")),
    )
    assert type(to_kvd_error(as_aio)) is errors.UnknownEngine
    none = _FakeRpcError(grpc.StatusCode.UNAVAILABLE, "", None)
    err = to_kvd_error(none)
    assert type(err) is errors.Unavailable and str(err) == "UNAVAILABLE"


def test_to_kvd_error_of_a_bare_rpc_error() -> None:
    err = to_kvd_error(grpc.RpcError())
    assert type(err) is errors.KvdError and err.code == errors.ErrorCode.UNKNOWN


@pytest.mark.parametrize("code", list(errors.ErrorCode))
def test_every_error_code_maps_to_the_grpc_code_of_its_name_and_back(code: errors.ErrorCode) -> None:
    """The edges map codes by name: kvd's codes are exactly gRPC's, numbers included."""
    status = status_code(code)
    assert status.name == code.name and status.value[0] == code.value
    assert error_code(status) is code


def test_every_grpc_code_has_a_kvd_code() -> None:
    assert {error_code(s) for s in grpc.StatusCode} == set(errors.ErrorCode)


def test_error_metadata_names_the_exact_class() -> None:
    assert error_metadata(errors.LeaseExpired("x")) == (("kvd-error-class", "LeaseExpired"),)


def test_transfer_and_load_errors_keep_the_exact_class() -> None:
    """The daemon names the class (error_class): a router tells IncompatibleLayout (never retry)
    from PeerUnavailable (retry), though both travel with their general code."""
    for code, name, cls in (
        ("FAILED_PRECONDITION", "IncompatibleLayout", errors.IncompatibleLayout),
        ("UNAVAILABLE", "PeerUnavailable", errors.PeerUnavailable),
        ("DEADLINE_EXCEEDED", "LeaseExpired", errors.LeaseExpired),
    ):
        status = common_pb2.TransferStatus(
            state=common_pb2.TRANSFER_STATE_FAILED, error_code=code, error_class=name, error_message="m"
        )
        assert type(_base.transfer_error(status)) is cls
        failed = engine_pb2.LoadFailed(request_id="r", error_code=code, error_class=name, error_message="m")
        assert type(_base.load_error(failed)) is cls
    # A class whose code disagrees is not trusted: the code's general class.
    odd = common_pb2.TransferStatus(
        state=common_pb2.TRANSFER_STATE_FAILED, error_code="UNAVAILABLE", error_class="IncompatibleLayout"
    )
    assert type(_base.transfer_error(odd)) is errors.Unavailable


def test_pull_results_rebuild_each_error_and_refuse_a_wrong_count() -> None:
    response = router_pb2.StartPullsResponse(
        results=[
            router_pb2.StartPullResult(transfer_id="t1"),
            router_pb2.StartPullResult(error_code="NOT_FOUND", error_message="gone", error_class="UnknownLease"),
            router_pb2.StartPullResult(error_code="WHAT", error_message="?"),
        ]
    )
    got = _base.pull_results(response, 3)
    assert got[0] == "t1" and type(got[1]) is errors.UnknownLease and str(got[1]) == "gone"
    assert type(got[2]) is errors.KvdError and got[2].code is errors.ErrorCode.UNKNOWN
    with pytest.raises(errors.Internal, match="answered 3 results for 2 pulls"):
        _base.pull_results(response, 2)
