"""The engine half of ``kvd demo``: a two-turn conversation between two reference engines.

The caller (``kvd demo``) starts two daemons, one per "node", and passes their engine
sockets. This module runs:

1. turn 1 on the prefill engine (TP 2, NHD, 16-token blocks), held for decode;
2. decode (TP 1, HND, 8-token blocks) pulls the prompt's KV through the daemons, then
   decodes with speculative decoding (NWOR keeps rejected drafts out of the cache);
3. turn 2 on the prefill engine pulls the whole conversation back from decode (above the
   threshold), checks every byte it reads, and answers.

Every KV vector an engine reads is checked against the deterministic model, so a wrong byte
anywhere fails the demo. It talks to the daemons only through the connector (kvd_engine) and the client.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from kvd.demo.reference_engine import AcceptancePattern, ReferenceEngine
from kvd_engine.cache_layout import KvLayout
from kvd_engine.config import KvdConnectorConfig
from kvd_engine.local import kvd_connectors
from kvd_engine.worker import KvdWorker

__all__ = ["DemoReport", "TurnReport", "format_report", "run_conversation"]


@dataclasses.dataclass
class TurnReport:
    name: str
    engine: str
    prompt_tokens: int
    output_tokens: int
    pulled_tokens: int
    pulled_bytes: int
    pull_s: float
    recomputed: bool
    steps: int
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    wall_s: float = 0.0


@dataclasses.dataclass
class DemoReport:
    turns: list[TurnReport]
    nwor: dict[str, Any]
    total_s: float


def _engine(socket: str, engine_id: str, threshold: int, **kw: Any) -> ReferenceEngine:
    config = KvdConnectorConfig(kvd_socket=socket, pull_threshold_tokens=threshold, reconnect_initial_s=0.05)
    sched, workers = kvd_connectors(
        config, engine_id, block_size=kw["block_size"], speculative=kw.get("num_speculative_tokens", 0) > 0
    )
    engine = ReferenceEngine(
        engine_id=engine_id, scheduler_connector=sched, worker_connector_factory=workers, check_kv_reads=True, **kw
    )
    deadline = time.monotonic() + 30
    while not all(isinstance(r.worker, KvdWorker) and r.worker.link.connected for r in engine.ranks):
        if time.monotonic() > deadline:
            engine.close()
            raise RuntimeError(f"engine {engine_id} could not register with the daemon at {socket}")
        time.sleep(0.01)
    return engine


def _kv_bytes(engine: ReferenceEngine, tokens: int) -> int:
    g = engine.ranks[0].geometry
    return tokens * g.num_kv_heads * g.head_dim * g.elem_size * 2 * g.num_layers * len(engine.ranks)


def _run_request(
    engine: ReferenceEngine, others: list[ReferenceEngine], request_id: str, name: str, timeout_s: float = 60
) -> TurnReport:
    """Step ``engine`` (and the others, which poll) until the request is done; time its pull."""
    request = engine.requests[request_id]
    started = time.monotonic()
    pull_done = None
    steps = proposed = accepted = 0
    while not request.status.finished:
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{name}: request {request_id} did not finish in {timeout_s}s")
        result = engine.step()
        steps += 1
        proposed += result.drafts_proposed
        accepted += result.drafts_accepted
        for other in others:
            other.step()
        if pull_done is None and request.status.name != "WAITING_FOR_REMOTE_KVS":
            pull_done = time.monotonic()
        if request.status.name == "WAITING_FOR_REMOTE_KVS":
            time.sleep(0.001)
    pulled = 0 if request.load_failed else request.num_external_tokens
    return TurnReport(
        name=name,
        engine=engine.engine_id,
        prompt_tokens=request.num_prompt_tokens,
        output_tokens=len(request.output_token_ids),
        pulled_tokens=pulled,
        pulled_bytes=_kv_bytes(engine, pulled),
        pull_s=(pull_done or started) - started if pulled else 0.0,
        recomputed=request.load_failed or pulled == 0,
        steps=steps,
        drafts_proposed=proposed,
        drafts_accepted=accepted,
        wall_s=time.monotonic() - started,
    )


def run_conversation(
    prefill_socket: str,
    decode_socket: str,
    *,
    prompt_tokens: int = 300,
    decode_tokens: int = 48,
    spec_tokens: int = 3,
    seed: int = 7,
    pull_threshold_tokens: int = 64,
    log: Callable[[str], None] = print,
) -> DemoReport:
    """Run the two-turn conversation against the two daemons; raises if any byte is wrong."""
    begin = time.monotonic()
    common = dict(num_layers=4, total_num_kv_heads=8, head_dim=64, dtype=torch.bfloat16, num_blocks=256)
    prefill = _engine(
        prefill_socket, "demo-prefill", pull_threshold_tokens, tp_size=2, layout=KvLayout.NHD, block_size=16, **common
    )
    decode = None
    try:
        decode = _engine(
            decode_socket,
            "demo-decode",
            pull_threshold_tokens,
            tp_size=1,
            layout=KvLayout.HND,
            block_size=8,
            num_speculative_tokens=spec_tokens,
            acceptance=AcceptancePattern.random(seed),
            **common,
        )
        prompt = [(seed * 7919 + i * 104729) % 1000 for i in range(prompt_tokens)]
        turns = []
        log(f"turn 1: prefill {prompt_tokens} tokens on {prefill.engine_id} (TP 2, NHD, block 16)")
        prefill.add_request("turn-1", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        turns.append(_run_request(prefill, [decode], "turn-1", "prefill"))
        held = prefill.requests["turn-1"].output_kv_transfer_params
        if held is None:
            raise RuntimeError("the prefill daemon did not hold the KV (is it running?)")
        log(f"        decode pulls it into {decode.engine_id} (TP 1, HND, block 8)")
        log(f"        and decodes {decode_tokens} tokens, speculating {spec_tokens} drafts per step")
        decode.add_request("turn-1", prompt, max_tokens=decode_tokens, kv_transfer_params=held)
        turns.append(_run_request(decode, [prefill], "turn-1", "decode"))
        conversation = decode.requests["turn-1"].all_token_ids + [11, 12, 13, 14]
        log(f"turn 2: prefill pulls the {len(conversation)}-token conversation back from decode")
        prefill.add_request(
            "turn-2", conversation, max_tokens=1, kv_transfer_params=decode.requests["turn-1"].output_kv_transfer_params
        )
        turns.append(_run_request(prefill, [decode], "turn-2", "prefill (turn 2)"))
        nwor = dataclasses.asdict(decode.nwor_stats()[0])
        return DemoReport(turns=turns, nwor=nwor, total_s=time.monotonic() - begin)
    finally:
        if decode is not None:
            decode.close()
        prefill.close()


def format_report(report: DemoReport) -> str:
    """A readable summary (``kvd demo`` prints it, then the metrics that moved)."""
    header = f"{'turn':<18}{'engine':<14}{'prompt':>7}{'out':>5}{'pulled':>8}{'bytes':>11}{'pull ms':>9}"
    lines = [header + f"{'steps':>7}{'drafts ok/all':>15}"]
    for t in report.turns:
        drafts = f"{t.drafts_accepted}/{t.drafts_proposed}" if t.drafts_proposed else "-"
        lines.append(
            f"{t.name:<18}{t.engine:<14}{t.prompt_tokens:>7}{t.output_tokens:>5}{t.pulled_tokens:>8}"
            f"{t.pulled_bytes:>11}{t.pull_s * 1000:>9.1f}{t.steps:>7}{drafts:>15}"
        )
    n = report.nwor
    lines.append(
        f"NWOR ({n['mode']}): {n['windows']} verification windows, {n['committed_tokens']} token positions committed, "
        f"{n['rejected_tokens']} rejected drafts never written"
    )
    lines.append(f"all KV read by either engine matched the model bit for bit; {report.total_s:.1f}s in all")
    return "\n".join(lines)
