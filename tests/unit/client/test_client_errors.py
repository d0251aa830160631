"""kvd_client.errors: one exception hierarchy, each class travelling as one kvd error code."""

from __future__ import annotations

import pytest

from kvd_client import errors
from kvd_client.errors import (
    ERROR_OF_STATUS,
    RETRYABLE_STATUS,
    ErrorCode,
    KvdError,
    error_class_named,
    from_status,
)

S = ErrorCode

# The contract: every class and the code it travels as.
EXPECTED_CODES: dict[type[KvdError], ErrorCode] = {
    errors.KvdError: S.INTERNAL,
    errors.InvalidArgument: S.INVALID_ARGUMENT,
    errors.NotFound: S.NOT_FOUND,
    errors.UnknownEngine: S.NOT_FOUND,
    errors.UnknownLease: S.NOT_FOUND,
    errors.UnknownTransfer: S.NOT_FOUND,
    errors.AlreadyExists: S.ALREADY_EXISTS,
    errors.FailedPrecondition: S.FAILED_PRECONDITION,
    errors.IncompatibleLayout: S.FAILED_PRECONDITION,
    errors.UnsupportedModelFeature: S.FAILED_PRECONDITION,
    errors.MemoryOpenError: S.FAILED_PRECONDITION,
    errors.StaleRegistration: S.FAILED_PRECONDITION,
    errors.DeadlineExceeded: S.DEADLINE_EXCEEDED,
    errors.LeaseExpired: S.DEADLINE_EXCEEDED,
    errors.Unavailable: S.UNAVAILABLE,
    errors.PeerUnavailable: S.UNAVAILABLE,
    errors.Aborted: S.ABORTED,
    errors.ResourceExhausted: S.RESOURCE_EXHAUSTED,
    errors.Cancelled: S.CANCELLED,
    errors.PermissionDenied: S.PERMISSION_DENIED,
    errors.Unauthenticated: S.UNAUTHENTICATED,
    errors.Internal: S.INTERNAL,
    errors.HeldKvEvicted: S.NOT_FOUND,
}


def _all_subclasses(cls: type[KvdError]) -> set[type[KvdError]]:
    out = {cls}
    for sub in cls.__subclasses__():
        out |= _all_subclasses(sub)
    return out


def _module_classes() -> set[type[KvdError]]:
    return {c for c in _all_subclasses(KvdError) if c.__module__ == errors.__name__}


def test_every_error_class_is_in_the_contract() -> None:
    """No KvdError subclass exists without a declared status code here (a new class needs a decision)."""
    assert _module_classes() == set(EXPECTED_CODES)


@pytest.mark.parametrize("cls", list(EXPECTED_CODES), ids=lambda c: c.__name__)
def test_each_class_maps_to_its_code(cls: type[KvdError]) -> None:
    """Each class carries its gRPC status code, on the class and on instances; the message is kept."""
    assert cls.code == EXPECTED_CODES[cls]
    err = cls("what went wrong")
    assert err.code == EXPECTED_CODES[cls]
    assert err.message == "what went wrong" == str(err)
    assert isinstance(err, KvdError)


def test_status_table_maps_each_code_to_the_general_class() -> None:
    """ERROR_OF_STATUS maps each code to the most general class travelling as that code."""
    for code, cls in ERROR_OF_STATUS.items():
        assert cls.code == code
        general = [c for c in EXPECTED_CODES if c.code == code and c is not KvdError]
        assert all(issubclass(c, cls) for c in general), f"{cls.__name__} is not the most general for {code}"
    # Every code some class travels as can be turned back into a class.
    assert {c.code for c in EXPECTED_CODES} <= set(ERROR_OF_STATUS)


def test_class_names_are_unique() -> None:
    """Names travel in trailing metadata: each name designates one class."""
    names = [c.__name__ for c in _module_classes()]
    assert len(names) == len(set(names))
    for cls in _module_classes():
        assert error_class_named(cls.__name__) is cls
    assert error_class_named("NoSuchError") is None
    assert error_class_named("") is None


@pytest.mark.parametrize("cls", list(EXPECTED_CODES), ids=lambda c: c.__name__)
def test_from_status_round_trips_class_names(cls: type[KvdError]) -> None:
    """A daemon's (code, details, class name) becomes exactly the class it raised, with its message."""
    err = from_status(cls.code, "lease abc expired", cls.__name__)
    assert type(err) is cls
    assert err.code == cls.code
    assert err.message == "lease abc expired"


@pytest.mark.parametrize("code", list(ERROR_OF_STATUS))
def test_from_status_without_class_name_gives_the_codes_class(code: ErrorCode) -> None:
    """With no (or an unknown) class name the code's general class is raised."""
    assert type(from_status(code, "x")) is ERROR_OF_STATUS[code]
    assert type(from_status(code, "x", "SomethingNewer")) is ERROR_OF_STATUS[code]


def test_from_status_ignores_a_class_name_that_disagrees_with_the_code() -> None:
    """A class name whose code differs from the status code falls back to the code's class."""
    err = from_status(S.UNAVAILABLE, "peer gone", "LeaseExpired")
    assert type(err) is errors.Unavailable
    assert err.code == S.UNAVAILABLE


def test_from_status_of_an_unmapped_code_keeps_the_code() -> None:
    """A code without a class (UNKNOWN, DATA_LOSS...) becomes a KvdError carrying that code."""
    for code in (S.UNKNOWN, S.DATA_LOSS, S.UNIMPLEMENTED, S.OUT_OF_RANGE):
        err = from_status(code, "")
        assert type(err) is KvdError
        assert err.code == code
        assert err.message == code.name  # empty details: the code's name
    assert KvdError.code == S.INTERNAL  # setting it on an instance did not change the class


def test_retryable_status() -> None:
    """Only 'this endpoint is failing right now' codes are retryable: UNAVAILABLE and RESOURCE_EXHAUSTED."""
    assert frozenset({S.UNAVAILABLE, S.RESOURCE_EXHAUSTED}) == RETRYABLE_STATUS
    for cls in (errors.InvalidArgument, errors.UnknownLease, errors.LeaseExpired, errors.Internal):
        assert cls.code not in RETRYABLE_STATUS
    for cls in (errors.PeerUnavailable, errors.ResourceExhausted):
        assert cls.code in RETRYABLE_STATUS


def test_specific_errors_are_caught_by_their_general_class() -> None:
    """A caller catching NotFound / DeadlineExceeded / Unavailable also catches the specific leaves."""
    with pytest.raises(errors.NotFound):
        raise errors.UnknownLease("x")
    with pytest.raises(errors.DeadlineExceeded):
        raise errors.LeaseExpired("x")
    with pytest.raises(errors.Unavailable):
        raise errors.PeerUnavailable("x")
    with pytest.raises(errors.FailedPrecondition):
        raise errors.IncompatibleLayout("x")
