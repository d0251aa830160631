"""Translation between the wire (kvd.v1 protos) and the core's frozen dataclasses.

Every incoming message is validated here or in the core's constructors (which raise
InvalidArgument), so a malformed request changes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TypeVar

from kvd.core.memory import CudaIpcSpec, MemoryKind, RegionRequest
from kvd.core.params import TransferParams
from kvd.core.peers import HandshakeInfo, NixlRegion, RemoteEngine
from kvd.core.transfers import Transfer, TransferState
from kvd.layout.plan import EngineView
from kvd.layout.spec import KvFormat, KvLayout, LayerPlacement, LayoutSpec
from kvd_client import records
from kvd_client.dtypes import DTYPE_NAMES, DTYPE_OF_NAME, DType
from kvd_client.errors import InvalidArgument
from kvd_client.group_blocks import split_groups
from kvd_client.v1 import common_pb2, peer_pb2
from kvd_client.v1.schema import KvGroupKind

E = TypeVar("E", bound=enum.IntEnum)

# The core's transfer states and the wire's share their names.
_STATE: dict[TransferState, common_pb2.TransferState] = {
    state: getattr(common_pb2, f"TRANSFER_STATE_{state.name}") for state in TransferState
}


def _enum(enum_type: type[E], value: int, what: str) -> E:
    """The wire enum member of ``value``; UNSPECIFIED (0) and unknown numbers are refused."""
    try:
        return enum_type(value)
    except ValueError:
        wire_enum = common_pb2.DESCRIPTOR.enum_types_by_name[enum_type.__name__]
        names = [v.name for v in wire_enum.values if v.number != 0]
        raise InvalidArgument(f"{what}: {value} is not one of {names}") from None


def layout_from_pb(msg: common_pb2.KvLayoutSpec) -> LayoutSpec:
    return LayoutSpec(
        num_layers=msg.num_layers,
        kv_format=_enum(KvFormat, msg.kv_format, "layout.kv_format"),
        layout=_enum(KvLayout, msg.layout, "layout.layout"),
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        total_num_kv_heads=msg.total_num_kv_heads,
        head_dim=msg.head_dim,
        dtype=DTYPE_NAMES[_enum(DType, msg.dtype, "layout.dtype")],
        num_blocks=msg.num_blocks,
        tp_rank=msg.tp_rank,
        tp_size=msg.tp_size or 1,
    )


def layout_to_pb(spec: LayoutSpec) -> common_pb2.KvLayoutSpec:
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    fields["dtype"] = DTYPE_OF_NAME[spec.dtype]
    return common_pb2.KvLayoutSpec(**fields)


def placement_from_pb(msg: common_pb2.LayerPlacement) -> LayerPlacement:
    return records.from_message(LayerPlacement, msg)


def placement_to_pb(p: LayerPlacement) -> common_pb2.LayerPlacement:
    return records.to_message(p, common_pb2.LayerPlacement)


def group_from_pb(msg: common_pb2.KvCacheGroup, index: int) -> EngineView:
    """One KV cache group after group 0 (``index`` >= 1, for messages)."""
    if not msg.HasField("layout"):
        raise InvalidArgument(f"KV cache group {index}: layout is required")
    kind = _enum(KvGroupKind, msg.kind, f"KV cache group {index} kind")
    try:
        spec = layout_from_pb(msg.layout)
    except InvalidArgument as exc:
        raise InvalidArgument(f"KV cache group {index} ({kind.name.lower()}): {exc.message}") from None
    return EngineView(
        spec,
        tuple(placement_from_pb(p) for p in msg.layers),
        kind=kind,
        name=msg.name,
        sliding_window=msg.sliding_window,
        block_table=msg.block_table - 1,
    )


def group_to_pb(view: EngineView) -> common_pb2.KvCacheGroup:
    return common_pb2.KvCacheGroup(
        kind=int(view.kind),  # type: ignore[arg-type]
        layout=layout_to_pb(view.spec),
        layers=[placement_to_pb(p) for p in view.placements],
        sliding_window=view.sliding_window,
        name=view.name,
        block_table=view.block_table + 1,
    )


def group_ids_from_pb(ids: Sequence[int], counts: Sequence[int], what: str) -> tuple[tuple[int, ...], ...]:
    return split_groups(list(ids), list(counts), what)


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
        # CudaIpcSpec's fields are CudaIpcHandle's: copy them by name.
        spec = CudaIpcSpec(**{f.name: getattr(h, f.name) for f in dataclasses.fields(CudaIpcSpec)})
        return RegionRequest(MemoryKind.CUDA_IPC, msg.size_bytes, cuda_ipc=spec)
    raise InvalidArgument(f"region {index}: kind must be MEMORY_KIND_SHM or MEMORY_KIND_CUDA_IPC")


def params_from_pb(msg: common_pb2.KvTransferParams) -> TransferParams:
    return records.from_message(TransferParams, msg)


def params_to_pb(p: TransferParams) -> common_pb2.KvTransferParams:
    return records.to_message(p, common_pb2.KvTransferParams)


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
        error_class=type(t.error).__name__ if t.error else "",
        elapsed_s=t.elapsed_s,
        direct=t.direct,
        phase_s=t.phases,
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
                early_reads=e.early_reads,
                step_notifications=e.step_notifications,
                finish_read_ends_reads=e.finish_read_ends_reads,
                groups=[group_to_pb(g) for g in e.extra_groups],
            )
            for e in info.engines
        ],
        agent_regions=[
            peer_pb2.RegionDescriptor(
                address=r.address,
                size_bytes=r.size,
                vram=r.vram,
                device_index=r.device_index,
                registration_serial=r.serial,
            )
            for r in info.regions
        ],
        early_read_window_ms=min(int(info.early_read_window_s * 1000), 2**32 - 1),
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
                extra_groups=tuple(group_from_pb(g, i) for i, g in enumerate(e.groups, start=1)),
                early_reads=e.early_reads,
                step_notifications=e.step_notifications,
                finish_read_ends_reads=e.finish_read_ends_reads,
            )
        )
    regions = tuple(
        NixlRegion(r.address, r.size_bytes, r.device_index, r.vram, r.registration_serial) for r in msg.agent_regions
    )
    return HandshakeInfo(
        msg.incarnation, msg.agent_name, msg.agent_metadata, tuple(engines), regions, msg.early_read_window_ms / 1000
    )
