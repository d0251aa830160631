"""A pull of a soft hold cancelled while the holder waits for its engine's PIN answer (two real
daemons, the holder engine's scheduler stream answered by the test): the holder ends that read's
admission at once (its memory unpinned, nothing retired), the engine is told to drop the pin it
took, and the same pull asked again starts anew and moves exact bytes."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from kvtest import engine_pair, small_spec

from kvd_client._scheduler_stream import SchedulerStream
from kvd_client.v1 import common_pb2
from kvd_client.v1.schema import HoldCheckAction

pytestmark = pytest.mark.integration


class SlowPinningEngine:
    """Answers the holder's PIN checks after ``pin_delay_s`` (a long engine step), the rest at once;
    records every check as (action, pin id)."""

    def __init__(self, target: str, engine_id: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stream = SchedulerStream.over(self.channel, engine_id)
        self.pin_delay_s = 1.5
        self.seen: list[tuple[HoldCheckAction, str]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            for command in self.stream.poll():
                if command.WhichOneof("kind") != "check":
                    continue
                check = command.check
                action = HoldCheckAction(check.action)
                with self.lock:
                    self.seen.append((action, check.pin_id))
                if action is HoldCheckAction.PIN and self.pin_delay_s:
                    threading.Timer(self.pin_delay_s, self.stream.send_check_result, (check.seq, True, "")).start()
                elif action is not HoldCheckAction.UNPIN:
                    self.stream.send_check_result(check.seq, True, "")
            time.sleep(0.01)

    def checks(self) -> list[tuple[HoldCheckAction, str]]:
        with self.lock:
            return list(self.seen)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.stream.close()
        self.channel.close()


def test_a_soft_pull_cancelled_during_its_pin_ends_its_admission_and_a_retry_moves_exact_bytes(spawn_daemon) -> None:
    a, b = spawn_daemon(name="holder"), spawn_daemon(name="reader")
    with engine_pair(a.unix_target, b.unix_target, small_spec(), seed=3) as (holder, reader):
        engine = SlowPinningEngine(a.unix_target, "holder")
        try:
            time.sleep(0.5)  # the scheduler stream is attached
            params = holder.client.hold_blocks(
                engine_id="holder", request_id="r1", block_ids=[0, 1], num_tokens=20, soft=True
            ).kv_transfer_params
            first = reader.client.start_pull(
                engine_id="reader", tp_rank=0, request_id="r1", local_block_ids=[5, 6], remote=params
            ).transfer_id
            deadline = time.monotonic() + 10
            while not engine.checks() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert engine.checks() and engine.checks()[0][0] is HoldCheckAction.PIN  # the holder waits for it
            cancelled = reader.client.cancel_transfer(transfer_id=first)
            assert cancelled.state == common_pb2.TRANSFER_STATE_ABORTED
            engine.pin_delay_s = 0.0
            # Well before the PIN's answer (1.5 s) and the admission's deadline: the read is over.
            deadline = time.monotonic() + 1.0
            while holder.client.get_status().admitted_reads and time.monotonic() < deadline:
                time.sleep(0.02)
            assert holder.client.get_status().admitted_reads == 0
            pin_id = engine.checks()[0][1]
            while (HoldCheckAction.UNPIN, pin_id) not in engine.checks() and time.monotonic() < deadline + 1.0:
                time.sleep(0.02)
            assert (HoldCheckAction.UNPIN, pin_id) in engine.checks()  # the engine drops what it pinned

            retry = reader.client.start_pull(
                engine_id="reader", tp_rank=0, request_id="r1", local_block_ids=[5, 6], remote=params
            ).transfer_id
            assert retry != first  # the cancelled pull is over: the same order starts a new one
            status = reader.client.wait_transfer(retry, timeout_s=30)
            assert status.state == common_pb2.TRANSFER_STATE_DONE, status.error_message
            assert bool((reader.token_bytes([5, 6], 20) == holder.token_bytes([0, 1], 20)).all())
            assert holder.client.get_status().admitted_reads == 0
            pins = {p for action, p in engine.checks() if action is HoldCheckAction.PIN}
            dropped = {p for action, p in engine.checks() if action is not HoldCheckAction.PIN}
            assert pins == dropped  # every pin the engine took was released (UNPIN or VERIFY_UNPIN)
        finally:
            engine.close()
