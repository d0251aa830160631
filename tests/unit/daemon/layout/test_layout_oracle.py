"""The oracle and the reference executor: the yardsticks the conversion tests measure with.

If these were wrong, every property test would be comparing against nonsense, so they are
checked against hand-computed offsets and against each other.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvd.layout import oracle
from kvd.layout.geometry import DescGeometry
from kvd.layout.plan import EngineView, PullPlan, ReadGroup, Target
from kvd.layout.spec import KvFormat, KvLayout, LayerPlacement, LayoutSpec, contiguous_placements


def _view(kv_format: KvFormat, layout: KvLayout, **kw: int) -> EngineView:
    spec = LayoutSpec(
        num_layers=kw.get("layers", 2),
        kv_format=kv_format,
        layout=layout,
        block_size=kw.get("block_size", 4),
        num_kv_heads=kw.get("heads", 2),
        head_dim=kw.get("head_dim", 2),
        dtype="float16",
        num_blocks=kw.get("blocks", 5),
    )
    return EngineView(spec, tuple(contiguous_placements(spec)))


def test_nhd_offsets_by_hand() -> None:
    """NHD: token t, head h of block b at plane + b*block_bytes + (slot*heads + h)*head_bytes."""
    view = _view(KvFormat.SPLIT, KvLayout.NHD)  # head_bytes 4, token 8, block 32, layer 2*5*32
    offsets = oracle.byte_offsets(view, [3, 1], 6)
    assert offsets.shape == (2, 2, 6, 2)
    assert offsets[0, 0, 0, 0] == 3 * 32
    assert offsets[0, 0, 1, 1] == 3 * 32 + 8 + 4
    assert offsets[0, 1, 5, 0] == 5 * 32 + 1 * 32 + 1 * 8  # V plane, token 5 = block 1 slot 1
    assert offsets[1, 0, 0, 0] == 2 * 5 * 32 + 3 * 32


def test_hnd_and_joint_offsets_by_hand() -> None:
    """HND: (head*block_size + slot)*head_bytes; JOINT: V half right after K within a block."""
    view = _view(KvFormat.JOINT, KvLayout.HND)
    offsets = oracle.byte_offsets(view, [2], 3)
    block = 2 * 2 * 4 * 4  # K+V, heads 2, block 4, head_bytes 4
    assert offsets[0, 0, 2, 1] == 2 * block + (1 * 4 + 2) * 4
    assert offsets[0, 1, 2, 1] == 2 * block + 32 + (1 * 4 + 2) * 4


@pytest.mark.parametrize("kv_format", [KvFormat.SPLIT, KvFormat.JOINT])
@pytest.mark.parametrize("layout", list(KvLayout))
def test_scatter_then_gather_round_trips_and_touches_nothing_else(kv_format: KvFormat, layout: KvLayout) -> None:
    view = _view(kv_format, layout)
    region = torch.randint(0, 256, (view.spec.total_bytes,), dtype=torch.uint8)
    before = region.clone()
    logical = torch.randint(0, 256, (2, 2, 7, 2, 4), dtype=torch.uint8)
    oracle.scatter([region], view, [4, 0], logical)
    assert torch.equal(oracle.gather([region], view, [4, 0], 7), logical)
    mask = torch.from_numpy(oracle.token_mask([region.numel()], view, [4, 0], 7)[0])
    assert int(mask.sum()) == logical.numel()
    assert torch.equal(region[~mask], before[~mask])


def test_executor_copies_pieces_and_logs_them() -> None:
    """One piece of 8 bytes from remote region 1 into local region 0, then nothing else."""
    remote_geo = DescGeometry(planes=((1, 16),), num_units=4, unit_stride=8, unit_bytes=8)
    local_geo = DescGeometry(planes=((0, 0),), num_units=2, unit_stride=8, unit_bytes=8)
    group = ReadGroup(0, remote_geo, np.array([2], np.int32), Target.ENGINE, local_geo, np.array([1], np.int32), 8)
    remote = [torch.zeros(64, dtype=torch.uint8), torch.arange(64, dtype=torch.uint8)]
    local = [torch.zeros(16, dtype=torch.uint8)]
    log = oracle.execute_plan(PullPlan(reads=(group,)), {0: remote}, local)
    assert local[0][8:].tolist() == list(range(32, 40))
    assert not local[0][:8].any()
    assert np.flatnonzero(log.remote_read[0][1]).tolist() == list(range(32, 40))
    assert log.engine_writes[0].sum() == 8 and log.descriptors == 1


def test_executor_refuses_pieces_of_different_lengths() -> None:
    remote_geo = DescGeometry(planes=((0, 0),), num_units=4, unit_stride=8, unit_bytes=8)
    local_geo = DescGeometry(planes=((0, 0),), num_units=4, unit_stride=4, unit_bytes=4)
    group = ReadGroup(0, remote_geo, np.array([0], np.int32), Target.ENGINE, local_geo, np.array([0], np.int32), 8)
    with pytest.raises(AssertionError, match="lengths differ"):
        oracle.execute_plan(
            PullPlan(reads=(group,)), {0: [torch.zeros(32, dtype=torch.uint8)]}, [torch.zeros(16, dtype=torch.uint8)]
        )


def test_oracle_reads_layers_in_any_region() -> None:
    """Placements are free: layer 1 in another region, V before K."""
    spec = LayoutSpec(2, KvFormat.SPLIT, KvLayout.NHD, 2, 1, 1, "uint8", 3)
    placements = (LayerPlacement(0, 0, 6), LayerPlacement(1, 10, 2))
    view = EngineView(spec, placements)
    regions = [torch.arange(16, dtype=torch.uint8), torch.arange(100, 116, dtype=torch.uint8)]
    got = oracle.gather(regions, view, [1], 2)
    assert got[0, 0, :, 0, 0].tolist() == [2, 3]  # K of layer 0: block 1 at 0 + 2
    assert got[1, 1, :, 0, 0].tolist() == [104, 105]  # V of layer 1 at 2 + 2 in region 1
