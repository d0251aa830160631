"""What kvd's reload rule stands on, checked against the real NIXL (docs/lifetimes.md).

Loading a peer's metadata into a known agent *merges* it: a region the peer deregistered stays
loaded, and NIXL's lookup (which assumes loaded regions do not overlap) then fails for a region the
peer registered later over the same addresses: ``prep_xfer_dlist`` raises NIXL_ERR_NOT_FOUND, the
error pulls hit before kvd reloaded such agents. An agent removed and loaded afresh resolves it.
Run in a child process: NIXL agents left in the test process have crashed later tests.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

_SCRIPT = r"""
import torch
from nixl._api import nixl_agent, nixl_agent_config

config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
holder, reader = nixl_agent("holder", config), nixl_agent("reader", config)
memory = torch.zeros(4 << 20, dtype=torch.uint8)
base = memory.data_ptr()


def prep(offset):
    try:
        reader.release_dlist_handle(reader.prep_xfer_dlist("holder", [(base + offset, 4096, 0)], "DRAM"))
        return "ok"
    except Exception as exc:
        return type(exc).__name__


old = holder.register_memory([(base + 0x100000, 0x100000, 0, "")], "DRAM")
reader.add_remote_agent(holder.get_agent_metadata())
holder.deregister_memory(old)
new = holder.register_memory([(base, 0x300000, 0, "")], "DRAM")  # over the old addresses
reader.add_remote_agent(holder.get_agent_metadata())  # merged: the old region stays loaded
print("merged", prep(0x080000), prep(0x280000))
reader.remove_remote_agent("holder")
reader.add_remote_agent(holder.get_agent_metadata())  # reloaded: only what the holder has now
print("reloaded", prep(0x080000), prep(0x280000))
"""


def test_a_merged_stale_region_breaks_lookups_and_a_reload_fixes_them() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("merged", "reloaded"))]
    # Before the stale region's start the lookup works; past it, NIXL finds the stale region.
    assert lines == ["merged ok nixlNotFoundError", "reloaded ok ok"], done.stdout
