"""Translation between the wire (kvd.v1 protos) and the core's frozen dataclasses.

Every incoming message is validated here or in the core's constructors (which raise
InvalidArgument), so a malformed request changes nothing.
"""

from __future__ import annotations

from kvd.core.memory import CudaIpcSpec, MemoryKind, RegionRequest
from kvd.core.params import TransferParams
from kvd.core.peers import HandshakeInfo, RemoteEngine
from kvd.core.transfers import Transfer, TransferState
from kvd.layout.plan import EngineView
from kvd.layout.spec import KvFormat, KvLayout, LayerPlacement, LayoutSpec
from kvd.v1 import common_pb2, peer_pb2
from kvd_client.errors import InvalidArgument

_LAYOUT = {common_pb2.KV_LAYOUT_NHD: KvLayout.NHD, common_pb2.KV_LAYOUT_HND: KvLayout.HND}
_FORMAT = {
    common_pb2.KV_FORMAT_SPLIT: KvFormat.SPLIT,
    common_pb2.KV_FORMAT_JOINT: KvFormat.JOINT,
    common_pb2.KV_FORMAT_MLA: KvFormat.MLA,
    common_pb2.KV_FORMAT_PACKED: KvFormat.PACKED,
}
_DTYPE = {
    common_pb2.DTYPE_FLOAT16: "float16",
    common_pb2.DTYPE_BFLOAT16: "bfloat16",
    common_pb2.DTYPE_FLOAT32: "float32",
    common_pb2.DTYPE_FLOAT8_E4M3: "float8_e4m3fn",
    common_pb2.DTYPE_FLOAT8_E5M2: "float8_e5m2",
    common_pb2.DTYPE_UINT8: "uint8",
}
_STATE = {
    TransferState.PLANNED: common_pb2.TRANSFER_STATE_PLANNED,
    TransferState.READING: common_pb2.TRANSFER_STATE_READING,
    TransferState.POSTPROCESSING: common_pb2.TRANSFER_STATE_POSTPROCESSING,
    TransferState.DONE: common_pb2.TRANSFER_STATE_DONE,
    TransferState.FAILED: common_pb2.TRANSFER_STATE_FAILED,
    TransferState.ABORTED: common_pb2.TRANSFER_STATE_ABORTED,
    TransferState.FENCING: common_pb2.TRANSFER_STATE_FENCING,
}


def _enum(table: dict, value: int, what: str, enum_type: object) -> object:
    try:
        return table[value]
    except KeyError:
        names = getattr(enum_type, "keys", lambda: [])()
        raise InvalidArgument(f"{what}: {value} is not one of {[n for n in names if not n.endswith('UNSPECIFIED')]}") from None


def layout_from_pb(msg: common_pb2.KvLayoutSpec) -> LayoutSpec:
    return LayoutSpec(
        num_layers=msg.num_layers,
        kv_format=_enum(_FORMAT, msg.kv_format, "layout.kv_format", common_pb2.KvFormat),  # type: ignore[arg-type]
        layout=_enum(_LAYOUT, msg.layout, "layout.layout", common_pb2.KvLayout),  # type: ignore[arg-type]
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        total_num_kv_heads=msg.total_num_kv_heads,
        head_dim=msg.head_dim,
        dtype=_enum(_DTYPE, msg.dtype, "layout.dtype", common_pb2.DType),  # type: ignore[arg-type]
        num_blocks=msg.num_blocks,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
    )


def layout_to_pb(spec: LayoutSpec) -> common_pb2.KvLayoutSpec:
    return common_pb2.KvLayoutSpec(
        num_layers=spec.num_layers,
        kv_format={v: k for k, v in _FORMAT.items()}[spec.kv_format],
        layout={v: k for k, v in _LAYOUT.items()}[spec.layout],
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        total_num_kv_heads=spec.total_num_kv_heads,
        head_dim=spec.head_dim,
        dtype={v: k for k, v in _DTYPE.items()}[spec.dtype],
        num_blocks=spec.num_blocks,
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
    )


def placement_from_pb(msg: common_pb2.LayerPlacement) -> LayerPlacement:
    return LayerPlacement(region=msg.region, k_offset=msg.k_offset, v_offset=msg.v_offset)


def placement_to_pb(p: LayerPlacement) -> common_pb2.LayerPlacement:
    return common_pb2.LayerPlacement(region=p.region, k_offset=p.k_offset, v_offset=p.v_offset)


def region_from_pb(msg: common_pb2.MemoryRegion, index: int) -> RegionRequest:
    source = msg.WhichOneof("source")
    if msg.kind == common_pb2.MEMORY_KIND_SHM:
        if source != "shm_name":
            raise InvalidArgument(f"region {index}: a MEMORY_KIND_SHM region needs shm_name")
        return RegionRequest(MemoryKind.SHM, msg.size_bytes, shm_name=msg.shm_name)
    if msg.kind == common_pb2.MEMORY_KIND_CUDA_IPC:
        if source != "cuda_ipc":
            raise InvalidArgument(f"region {index}: a MEMORY_KIND_CUDA_IPC region needs cuda_ipc")
        h = msg.cuda_ipc
        return RegionRequest(
            MemoryKind.CUDA_IPC,
            msg.size_bytes,
            cuda_ipc=CudaIpcSpec(
                device_index=h.device_index,
                handle=h.handle,
                storage_size_bytes=h.storage_size_bytes,
                storage_offset_bytes=h.storage_offset_bytes,
                ref_counter_handle=h.ref_counter_handle,
                ref_counter_offset=h.ref_counter_offset,
                event_handle=h.event_handle,
                event_sync_required=h.event_sync_required,
            ),
        )
    raise InvalidArgument(f"region {index}: kind must be MEMORY_KIND_SHM or MEMORY_KIND_CUDA_IPC")


def params_from_pb(msg: common_pb2.KvTransferParams) -> TransferParams:
    return TransferParams(
        daemon_address=msg.daemon_address,
        daemon_incarnation=msg.daemon_incarnation,
        engine_id=msg.engine_id,
        tp_size=msg.tp_size,
        lease_id=msg.lease_id,
        block_ids=tuple(msg.block_ids),
        num_tokens=msg.num_tokens,
        request_id=msg.request_id,
        lease_expires_unix_ms=msg.lease_expires_unix_ms,
    )


def params_to_pb(p: TransferParams) -> common_pb2.KvTransferParams:
    return common_pb2.KvTransferParams(
        daemon_address=p.daemon_address,
        daemon_incarnation=p.daemon_incarnation,
        engine_id=p.engine_id,
        tp_size=p.tp_size,
        lease_id=p.lease_id,
        block_ids=list(p.block_ids),
        num_tokens=p.num_tokens,
        request_id=p.request_id,
        lease_expires_unix_ms=p.lease_expires_unix_ms,
    )


def transfer_to_pb(t: Transfer) -> common_pb2.TransferStatus:
    return common_pb2.TransferStatus(
        transfer_id=t.transfer_id,
        request_id=t.request_id,
        engine_id=t.engine_id,
        tp_rank=t.tp_rank,
        peer_address=t.peer_address,
        state=_STATE[t.state],
        bytes=t.nbytes,
        descriptors=t.descriptors,
        error_code=t.error.code.name if t.error else "",
        error_message=t.error.message if t.error else "",
        elapsed_s=t.elapsed_s,
        direct=t.direct,
    )


def handshake_to_pb(info: HandshakeInfo) -> peer_pb2.HandshakeResponse:
    return peer_pb2.HandshakeResponse(
        incarnation=info.incarnation,
        agent_name=info.agent_name,
        agent_metadata=info.agent_metadata,
        engines=[
            peer_pb2.EngineDescriptor(
                engine_id=e.engine_id,
                layout=layout_to_pb(e.view.spec),
                regions=[
                    peer_pb2.RegionDescriptor(address=a, size_bytes=s, vram=e.vram, device_index=e.device_index)
                    for a, s in zip(e.region_addresses, e.region_sizes, strict=True)
                ],
                layers=[placement_to_pb(p) for p in e.view.placements],
                registration_id=e.registration_id,
            )
            for e in info.engines
        ],
    )


def handshake_from_pb(msg: peer_pb2.HandshakeResponse) -> HandshakeInfo:
    engines = []
    for e in msg.engines:
        vram = any(r.vram for r in e.regions)
        engines.append(
            RemoteEngine(
                engine_id=e.engine_id,
                view=EngineView(layout_from_pb(e.layout), tuple(placement_from_pb(p) for p in e.layers)),
                region_addresses=tuple(r.address for r in e.regions),
                region_sizes=tuple(r.size_bytes for r in e.regions),
                vram=vram,
                device_index=e.regions[0].device_index if e.regions else 0,
                registration_id=e.registration_id,
            )
        )
    return HandshakeInfo(msg.incarnation, msg.agent_name, msg.agent_metadata, tuple(engines))
