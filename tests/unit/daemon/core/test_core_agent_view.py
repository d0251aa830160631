"""RemoteAgent's record of what NIXL holds for a peer: when fresh metadata may be merged."""

from __future__ import annotations

import pytest

from kvd.core import remote_agents
from kvd.core.dataplane import NixlRegion
from kvd.core.remote_agents import RemoteAgent


def _region(address: int, size: int, serial: int, *, device: int = 0, vram: bool = False) -> NixlRegion:
    return NixlRegion(address, size, device, vram, serial)


def _agent(*regions: NixlRegion) -> RemoteAgent:
    agent = RemoteAgent("peer", tables=None)  # type: ignore[arg-type]
    agent.loaded_metadata(frozenset(regions), fresh=True)
    return agent


A, B = _region(0x10000, 0x1000, 1), _region(0x20000, 0x1000, 2)


@pytest.mark.parametrize(
    ("new", "reload"),
    [
        (_region(0x30000, 0x1000, 3), False),  # new memory elsewhere: merged
        (_region(0x20000, 0x1000, 3), True),  # B's addresses under a new registration
        (_region(0x1F000, 0x2000, 3), True),  # starts before B, ends inside it
        (_region(0x20800, 0x100, 3), True),  # inside B
        (_region(0x1F000, 0x1000, 3), False),  # ends where B starts
        (_region(0x21000, 0x1000, 3), False),  # starts where B ends
        (_region(0x20000, 0x1000, 3, device=1, vram=True), False),  # another device's memory
    ],
)
def test_metadata_is_merged_unless_a_new_region_overlaps_a_released_one(new: NixlRegion, reload: bool) -> None:
    agent = _agent(A, B)
    assert agent.needs_reload(frozenset({A, new})) is reload  # B was released, `new` registered
    assert agent.needs_reload(frozenset({A, B, _region(0x30000, 0x1000, 3)})) is False  # nothing released


def test_a_region_released_and_a_new_one_elsewhere_keep_the_stale_one_on_record() -> None:
    agent = _agent(A, B)
    moved = _region(0x30000, 0x1000, 3)
    assert not agent.needs_reload(frozenset({A, moved}))
    agent.loaded_metadata(frozenset({A, moved}), fresh=False)
    assert B in agent.loaded and B not in agent.current
    # The stale region still blocks a later registration over its addresses.
    assert agent.needs_reload(frozenset({A, moved, _region(0x20000, 0x800, 4)}))


def test_too_many_stale_regions_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_agents, "MAX_STALE_REGIONS", 2)
    stale = [_region(0x100000 * (i + 1), 0x1000, i + 10) for i in range(3)]
    agent = _agent(A, *stale)
    assert agent.needs_reload(frozenset({A}))
    assert not agent.needs_reload(frozenset({A, stale[0]}))


def test_an_engine_is_named_only_by_regions_of_the_current_metadata() -> None:
    from kvd.core.peers import RemoteEngine

    agent = _agent(A, B)
    agent.loaded_metadata(frozenset({A}), fresh=False)

    def engine(*regions: tuple[int, int]) -> RemoteEngine:
        return RemoteEngine(
            engine_id="e",
            view=None,  # type: ignore[arg-type]
            region_addresses=tuple(a for a, _ in regions),
            region_sizes=tuple(s for _, s in regions),
            vram=False,
            device_index=0,
            registration_id=1,
        )

    assert agent.names(engine((0x10000, 0x1000)))
    assert agent.names(engine((0x10100, 0x100)))  # inside a registered region
    assert not agent.names(engine((0x20000, 0x1000)))  # B is released
    assert not agent.names(engine((0x10000, 0x1000), (0x30000, 0x10)))
