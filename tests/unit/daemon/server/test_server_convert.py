"""kvd.server.convert: wire messages <-> the core's frozen dataclasses, refusing what is malformed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.memory import CudaIpcSpec, MemoryKind
from kvd.core.params import TransferParams
from kvd.core.peers import HandshakeInfo, RemoteEngine
from kvd.core.transfers import Transfer, TransferState
from kvd.layout.plan import EngineView
from kvd.layout.spec import DTYPE_SIZES, KvFormat, KvLayout, LayerPlacement, LayoutSpec, contiguous_placements
from kvd.server import convert
from kvd_client.errors import InvalidArgument, PeerUnavailable
from kvd_client.v1 import common_pb2, peer_pb2


@st.composite
def _layouts(draw: st.DrawFn) -> LayoutSpec:
    kv_format = draw(st.sampled_from(list(KvFormat)))
    tp_size = draw(st.sampled_from([1, 2, 4, 8]))
    if kv_format is KvFormat.MLA:
        heads, total = 1, 1
    else:
        total = draw(st.sampled_from([1, 2, 4, 8, 16]))
        heads = max(1, total // tp_size)
    return LayoutSpec(
        num_layers=draw(st.integers(1, 128)),
        kv_format=kv_format,
        layout=draw(st.sampled_from(list(KvLayout))),
        block_size=draw(st.sampled_from([1, 16, 32, 64])),
        num_kv_heads=heads,
        total_num_kv_heads=total,
        head_dim=draw(st.sampled_from([64, 128, 576])),
        dtype=draw(st.sampled_from(sorted(DTYPE_SIZES))),
        num_blocks=draw(st.integers(1, 1 << 20)),
        tp_rank=draw(st.integers(0, tp_size - 1)),
        tp_size=tp_size,
    )


@settings(deadline=None)
@given(_layouts())
def test_layout_round_trips(spec: LayoutSpec) -> None:
    """layout_from_pb(layout_to_pb(spec)) == spec, also through serialized bytes."""
    msg = convert.layout_to_pb(spec)
    assert convert.layout_from_pb(msg) == spec
    wire = common_pb2.KvLayoutSpec.FromString(msg.SerializeToString())
    assert convert.layout_from_pb(wire) == spec


def test_layout_tp_size_zero_means_one() -> None:
    """An unset tp_size (proto default 0) is read as 1."""
    msg = convert.layout_to_pb(LayoutSpec(2, KvFormat.SPLIT, KvLayout.NHD, 16, 8, 128, "bfloat16", 10))
    msg.tp_size = 0
    assert convert.layout_from_pb(msg).tp_size == 1


@pytest.mark.parametrize(
    ("field", "what"), [("kv_format", "layout.kv_format"), ("layout", "layout.layout"), ("dtype", "layout.dtype")]
)
@pytest.mark.parametrize("value", [0, 99])
def test_unknown_or_unset_enum_values_name_the_field(field: str, what: str, value: int) -> None:
    """An enum value that is unset (0) or unknown to this daemon is INVALID_ARGUMENT naming the field."""
    msg = convert.layout_to_pb(LayoutSpec(2, KvFormat.SPLIT, KvLayout.NHD, 16, 8, 128, "bfloat16", 10))
    setattr(msg, field, value)
    with pytest.raises(InvalidArgument, match=rf"^{what}: {value} is not one of \[") as info:
        convert.layout_from_pb(msg)
    assert "UNSPECIFIED" not in str(info.value)


def test_invalid_layout_values_are_refused_by_the_spec() -> None:
    """A well-typed but inconsistent layout (0 layers) is INVALID_ARGUMENT from the spec's validation."""
    msg = convert.layout_to_pb(LayoutSpec(2, KvFormat.SPLIT, KvLayout.NHD, 16, 8, 128, "bfloat16", 10))
    msg.num_layers = 0
    with pytest.raises(InvalidArgument, match="num_layers must be >= 1"):
        convert.layout_from_pb(msg)


@settings(deadline=None)
@given(
    region=st.integers(0, (1 << 32) - 1),
    k=st.integers(0, (1 << 64) - 1),
    v=st.integers(0, (1 << 64) - 1),
)
def test_placement_round_trips(region: int, k: int, v: int) -> None:
    """A layer placement survives the wire unchanged (full uint64 offsets)."""
    p = LayerPlacement(region, k, v)
    assert (
        convert.placement_from_pb(common_pb2.LayerPlacement.FromString(convert.placement_to_pb(p).SerializeToString()))
        == p
    )


_text = st.text(max_size=40)


@settings(deadline=None)
@given(
    st.builds(
        TransferParams,
        daemon_address=_text,
        daemon_incarnation=_text,
        engine_id=_text,
        tp_size=st.integers(0, 64),
        lease_id=_text,
        block_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=50).map(tuple),
        num_tokens=st.integers(0, (1 << 64) - 1),
        request_id=_text,
        lease_expires_unix_ms=st.integers(-(1 << 63), (1 << 63) - 1),
    )
)
def test_params_round_trip(params: TransferParams) -> None:
    """kv_transfer_params survive the wire unchanged."""
    wire = common_pb2.KvTransferParams.FromString(convert.params_to_pb(params).SerializeToString())
    assert convert.params_from_pb(wire) == params


def test_shm_region_from_pb() -> None:
    """A MEMORY_KIND_SHM region with a name becomes an SHM RegionRequest."""
    msg = common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_SHM, size_bytes=4096, shm_name="kvd-e0")
    req = convert.region_from_pb(msg, 0)
    assert (req.kind, req.size_bytes, req.shm_name, req.cuda_ipc) == (MemoryKind.SHM, 4096, "kvd-e0", None)


def test_cuda_ipc_region_from_pb() -> None:
    """A MEMORY_KIND_CUDA_IPC region carries every handle field into CudaIpcSpec."""
    handle = common_pb2.CudaIpcHandle(
        device_index=3,
        handle=b"h" * 64,
        storage_size_bytes=1 << 30,
        storage_offset_bytes=512,
        ref_counter_handle=b"rc",
        ref_counter_offset=8,
        event_handle=b"ev",
        event_sync_required=True,
    )
    msg = common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_CUDA_IPC, size_bytes=1 << 20, cuda_ipc=handle)
    req = convert.region_from_pb(msg, 1)
    assert req.kind is MemoryKind.CUDA_IPC and req.size_bytes == 1 << 20
    assert req.cuda_ipc == CudaIpcSpec(3, b"h" * 64, 1 << 30, 512, b"rc", 8, b"ev", True)


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (
            common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_SHM, size_bytes=1),
            "region 2: a MEMORY_KIND_SHM region needs shm_name",
        ),
        (
            common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_SHM, cuda_ipc=common_pb2.CudaIpcHandle()),
            "needs shm_name",
        ),
        (
            common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_CUDA_IPC, shm_name="x"),
            "region 2: a MEMORY_KIND_CUDA_IPC region needs cuda_ipc",
        ),
        (common_pb2.MemoryRegion(shm_name="x"), "region 2: kind must be MEMORY_KIND_SHM or MEMORY_KIND_CUDA_IPC"),
        (common_pb2.MemoryRegion(kind=42, shm_name="x"), "region 2: kind must be"),  # type: ignore[arg-type]
    ],
)
def test_malformed_regions_are_refused(msg: common_pb2.MemoryRegion, message: str) -> None:
    """A region whose kind and source disagree (or an unknown kind) is INVALID_ARGUMENT naming the region."""
    with pytest.raises(InvalidArgument, match=message):
        convert.region_from_pb(msg, 2)


@pytest.mark.parametrize("state", list(TransferState))
def test_transfer_to_pb_maps_every_state(state: TransferState) -> None:
    """Every core state has a wire state of the same name."""
    t = Transfer("t", "r", "e", 1, "peer:1", (1,), 5.0, state=state, nbytes=100, descriptors=3, direct=False)
    msg = convert.transfer_to_pb(t)
    assert common_pb2.TransferState.Name(msg.state) == f"TRANSFER_STATE_{state.value}"
    assert (msg.transfer_id, msg.request_id, msg.engine_id, msg.tp_rank, msg.peer_address) == (
        "t",
        "r",
        "e",
        1,
        "peer:1",
    )
    assert (msg.bytes, msg.descriptors, msg.direct) == (100, 3, False)
    assert msg.error_code == "" and msg.error_message == ""


def test_transfer_to_pb_carries_the_error() -> None:
    """A failed transfer's error travels as its status code name and message."""
    t = Transfer(
        "t", "r", "e", 0, "peer:1", (1,), 5.0, state=TransferState.FAILED, error=PeerUnavailable("peer:1 died")
    )
    msg = convert.transfer_to_pb(t)
    assert (msg.error_code, msg.error_message) == ("UNAVAILABLE", "peer:1 died")


def _engine(engine_id: str, vram: bool, device: int, kv_format: KvFormat = KvFormat.SPLIT) -> RemoteEngine:
    spec = LayoutSpec(3, kv_format, KvLayout.HND, 16, 1 if kv_format is KvFormat.MLA else 4, 64, "float16", 12)
    return RemoteEngine(
        engine_id=engine_id,
        view=EngineView(spec, tuple(contiguous_placements(spec))),
        region_addresses=(0x7F0000000000, 0x7F1000000000),
        region_sizes=(spec.total_bytes, 4096),
        vram=vram,
        device_index=device,
        registration_id=17,
    )


def test_handshake_round_trips() -> None:
    """A peer's handshake (incarnation, agent, metadata, engines with layouts and regions) survives the wire."""
    info = HandshakeInfo(
        incarnation="inc-1",
        agent_name="kvd-host-1234",
        agent_metadata=b"\x00\x01metadata",
        engines=(_engine("prefill", True, 2), _engine("mla", False, 0, KvFormat.MLA)),
    )
    wire = peer_pb2.HandshakeResponse.FromString(convert.handshake_to_pb(info).SerializeToString())
    assert convert.handshake_from_pb(wire) == info
