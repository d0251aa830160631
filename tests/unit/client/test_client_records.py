"""The generated schema mirrors the proto, and kvd_client.records converts it table-driven."""

from __future__ import annotations

import dataclasses

import pytest

from kvd_client import records
from kvd_client.dtypes import DTYPE_NAMES, DTYPE_OF_NAME
from kvd_client.v1 import common_pb2, schema

ENUMS = [schema.KvLayout, schema.KvFormat, schema.DType, schema.MemoryKind, schema.TransferState]
RECORDS = {schema.KvTransferParams: common_pb2.KvTransferParams, schema.LayerPlacement: common_pb2.LayerPlacement}


@pytest.mark.parametrize("enum_type", ENUMS, ids=lambda e: e.__name__)
def test_each_enum_has_the_wire_values_but_unspecified(enum_type: type) -> None:
    wire = common_pb2.DESCRIPTOR.enum_types_by_name[enum_type.__name__]
    expected = {v.name: v.number for v in wire.values if v.number != 0}
    prefix = next(v.name for v in wire.values if v.number == 0).removesuffix("UNSPECIFIED")
    assert {prefix + m.name: m.value for m in enum_type} == expected


@pytest.mark.parametrize(("record_type", "message_type"), RECORDS.items(), ids=lambda t: t.__name__)
def test_each_record_has_the_message_fields_in_order(record_type: type, message_type: type) -> None:
    assert message_type.DESCRIPTOR.full_name == record_type.PROTO
    assert records.field_names(record_type) == tuple(f.name for f in message_type.DESCRIPTOR.fields)
    for field in message_type.DESCRIPTOR.fields:
        repeated = field.is_repeated
        default = getattr(record_type(), field.name)
        assert default == (() if repeated else field.default_value), field.name


def test_params_round_trip_through_the_message_and_the_wire() -> None:
    params = schema.KvTransferParams(
        daemon_address="h:1",
        daemon_incarnation="inc",
        engine_id="e",
        tp_size=2,
        lease_id="l",
        block_ids=(3, 1, 2),
        num_tokens=40,
        request_id="r",
        lease_expires_unix_ms=17,
    )
    message = records.to_message(params, common_pb2.KvTransferParams)
    wire = common_pb2.KvTransferParams.FromString(message.SerializeToString())
    assert records.from_message(schema.KvTransferParams, wire) == params
    assert records.from_fields(schema.KvTransferParams, records.as_fields(params)) == params
    assert records.as_fields(params)["block_ids"] == [3, 1, 2]


def test_from_fields_coerces_json_values_and_ignores_unknown_keys() -> None:
    params = records.from_fields(schema.KvTransferParams, {"num_tokens": "5", "block_ids": ["1", 2], "other": 1})
    assert params == schema.KvTransferParams(num_tokens=5, block_ids=(1, 2))


@pytest.mark.parametrize("bad", [{"block_ids": "12"}, {"block_ids": 3}, {"num_tokens": "many"}])
def test_from_fields_refuses_values_of_the_wrong_shape(bad: dict[str, object]) -> None:
    with pytest.raises((TypeError, ValueError)):
        records.from_fields(schema.KvTransferParams, bad)


def test_a_record_converts_only_to_its_own_message() -> None:
    with pytest.raises(TypeError, match="kvd.v1.LayerPlacement"):
        records.to_message(schema.LayerPlacement(), common_pb2.KvTransferParams)
    with pytest.raises(TypeError, match="kvd.v1.KvTransferParams"):
        records.from_message(schema.KvTransferParams, common_pb2.LayerPlacement())


def test_records_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        schema.LayerPlacement().region = 1  # type: ignore[misc]


def test_the_dtype_table_names_every_wire_dtype_once() -> None:
    assert set(DTYPE_NAMES) == set(schema.DType)
    assert len(DTYPE_OF_NAME) == len(DTYPE_NAMES)
