"""Descriptor tables prepared from NIXL's compressed rows read the bytes their indices name.

kvd hands NIXL each table as rows (address, length, device, stride, count)
(:meth:`kvd.layout.geometry.DescGeometry.strided`), and a NIXL without that form gets the rows
expanded (:func:`kvd.layout.geometry.expand_strided`). Both must name, index by index, the same
bytes as the geometry's own arithmetic. The real-NIXL part runs in a child process (NIXL agents
left in the test process have crashed later tests): two bare agents over UCX, runs of several
lengths and planes, each READ's bytes compared with a plain numpy copy.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import sys, time
import numpy as np
from nixl import _api as api
from kvd.layout.geometry import DescGeometry, expand_strided, split_runs
from kvd.worker.nixl_agent import takes_strided_lists

config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
reader = api.nixl_agent("strided-reader", config)
holder = api.nixl_agent("strided-holder", config)
assert takes_strided_lists(reader), "this NIXL documents no compressed lists: kvd would expand them"
rng = np.random.default_rng(int(sys.argv[1]))
UNITS, UNIT = 37, 256
planes = ((0, 0), (0, 3 * UNITS * UNIT), (1, 0))  # two regions, one plane placed after a gap
geo = DescGeometry(planes, UNITS, UNIT, UNIT, 3)
size = 4 * UNITS * UNIT
source = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(2)]
target = [np.zeros(size, dtype=np.uint8) for _ in range(2)]
regs = [holder.register_memory([(b.ctypes.data, size, 0, "")], "DRAM") for b in source]
regs += [reader.register_memory([(b.ctypes.data, size, 0, "")], "DRAM") for b in target]
name = reader.add_remote_agent(holder.get_agent_metadata())
src_addr = [b.ctypes.data for b in source]
dst_addr = [b.ctypes.data for b in target]

def read(form):
    for buffer in target:
        buffer[:] = 0
    rows = geo.strided(src_addr) if form == "compressed" else expand_strided(geo.strided(src_addr))
    remote = reader.prep_xfer_dlist(name, rows, "DRAM")
    rows = geo.strided(dst_addr) if form == "compressed" else geo.descriptors(dst_addr)
    local = reader.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
    # Runs of 1..8 units between shuffled blocks, as a pull cuts them, on every plane.
    units = rng.permutation(UNITS)[: UNITS // 2]
    local_units = np.sort(units)
    remote_units = np.sort(rng.permutation(UNITS)[: local_units.size])
    l_start, r_start, log2, _ = split_runs(local_units, remote_units, 3)
    plane = np.repeat(np.arange(len(planes)), log2.size)
    tile = lambda a: np.tile(a, len(planes))
    l_idx = geo.index(plane, tile(l_start), tile(log2))
    r_idx = geo.index(plane, tile(r_start), tile(log2))
    handle = reader.make_prepped_xfer("READ", local, l_idx, remote, r_idx, b"strided")
    state, deadline = reader.transfer(handle), time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        holder.get_new_notifs()  # the holder's progress (no progress thread here)
        state = reader.check_xfer_state(handle)
    assert state == "DONE", state
    expected = [np.zeros(size, dtype=np.uint8) for _ in range(2)]
    for p, ls, rs, k in zip(plane, tile(l_start), tile(r_start), tile(log2)):
        region, offset = planes[p]
        n = min(1 << int(k), UNITS - int(rs)) * UNIT
        assert n == min(1 << int(k), UNITS - int(ls)) * UNIT
        src = source[region][offset + int(rs) * UNIT : offset + int(rs) * UNIT + n]
        expected[region][offset + int(ls) * UNIT : offset + int(ls) * UNIT + n] = src
    for got, want in zip(target, expected):
        assert np.array_equal(got, want), form
    reader.release_xfer_handle(handle)
    reader.release_dlist_handle(local)
    reader.release_dlist_handle(remote)
    return int(log2.max())

longest = max(read("compressed"), read("expanded"))
print("ok", longest)
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_compressed_and_expanded_tables_read_the_bytes_each_index_names(seed: int) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(seed)], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert result.returncode == 0, result.stderr[-4000:]
    last = result.stdout.strip().splitlines()[-1].split()  # NIXL logs to stdout before it
    assert last[0] == "ok", result.stdout
    assert int(last[1]) >= 1, "no run longer than one unit was read"
