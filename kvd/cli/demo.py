"""`kvd demo`: prefill -> decode -> next turn, with two daemons and two reference engines.

Starts two daemons (one per "node"), runs kvd.demo.conversation's two-turn conversation through
them (prefill TP 2 / NHD / block 16; decode TP 1 / HND / block 8 with speculative decoding;
then prefill pulls the conversation back), prints the engines' summary and the daemon metrics
that moved.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

from kvd.core.metrics_text import counters_that_moved
from kvd.spawn import start_owned


def run_demo(args: argparse.Namespace) -> int:
    from kvd.demo.conversation import format_report, run_conversation  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvd-demo-")))
        prefill_node, decode_node = start_owned(stack, workdir, "prefill-node", "decode-node")
        print(f"daemons: prefill node {prefill_node.tcp}, decode node {decode_node.tcp}")
        before = {d.name: counters_that_moved(d.metrics, {}) for d in (prefill_node, decode_node)}
        report = run_conversation(prefill_node.unix_socket, decode_node.unix_socket, log=print)
        print()
        print(format_report(report))
        for daemon in (prefill_node, decode_node):
            moved = counters_that_moved(daemon.metrics, before[daemon.name])
            print(f"\nmetrics that moved on the {daemon.name} daemon ({daemon.metrics}/metrics):")
            for name, value in moved.items():
                if "_bucket{" not in name:  # histograms: their count and sum say enough here
                    print(f"  {name} {value:g}")
    return 0
