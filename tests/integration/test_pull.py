"""Two real daemons, engines owning shm KV, real NIXL pulls in both directions."""

from __future__ import annotations

import random

import pytest
from kvtest import ShmEngine, engine_pair, eventually, llama_spec, metric_value, scrape, small_spec

from kvd.bench.cpu import cpu_seconds
from kvd_client.v1 import common_pb2

pytestmark = pytest.mark.integration


def _events(engine: ShmEngine, stream, kind: str, want: int = 1, timeout_s: float = 10.0) -> list:
    import time

    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += [m for m in stream.poll() if m.WhichOneof("kind") == kind]
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("direction", ["decode_pulls_from_prefill", "prefill_pulls_from_decode"])
def test_pull_moves_exact_bytes_both_directions(spawn_daemon, direction: str) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    if direction == "prefill_pulls_from_decode":
        a, b = b, a  # the holder is on the other daemon
    spec = small_spec(num_blocks=48)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=7) as (holder, reader):
        holder_stream = holder.client.open_engine_stream("holder", 0)
        reader_stream = reader.client.open_engine_stream("reader", 0)
        num_tokens = 16 * 9 + 5  # a partial last block
        rng = random.Random(3)
        held_blocks = rng.sample(range(48), 10)
        local_blocks = rng.sample(range(48), 10)
        hold = holder.client.hold_blocks(
            engine_id="holder", request_id="req-1", block_ids=held_blocks, num_tokens=num_tokens
        )
        params = hold.kv_transfer_params
        assert params.lease_id and params.daemon_address == a.tcp and params.num_tokens == num_tokens

        started = reader.client.start_pull(
            engine_id="reader", tp_rank=0, request_id="req-1", local_block_ids=local_blocks, remote=params
        )
        status = reader.client.wait_transfer(started.transfer_id, timeout_s=30)
        assert status.state == common_pb2.TRANSFER_STATE_DONE
        assert status.bytes == num_tokens * spec.token_bytes * 2 * spec.num_layers

        assert reader.token_bytes(local_blocks, num_tokens).equal(holder.token_bytes(held_blocks, num_tokens))
        assert reader.untouched_mask_ok(local_blocks, 0xAB, num_tokens), "bytes outside the pulled tokens changed"

        assert _events(reader, reader_stream, "finished_recving"), "the reader was not told its load finished"
        sent = _events(holder, holder_stream, "finished_sending")
        assert sent and sent[0].finished_sending.request_id == "req-1" and not sent[0].finished_sending.expired
        assert not holder.client.lookup_held(engine_id="holder").held, "the lease outlived its read"

        pulled = metric_value(scrape(b.metrics), "kvd_transfer_bytes_total", direction="pull")
        served = metric_value(scrape(a.metrics), "kvd_transfer_bytes_total", direction="serve")
        assert pulled == status.bytes
        assert served == status.bytes
        assert metric_value(scrape(b.metrics), "kvd_handshakes_total", outcome="ok") == 1
        holder_stream.close()
        reader_stream.close()


def test_one_k_token_request_posts_merged_descriptors(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    spec = llama_spec(num_blocks=80)
    holder = ShmEngine(a.unix_target, "p", spec)
    reader = ShmEngine(b.unix_target, "d", spec)
    try:
        holder.register()
        reader.register()
        holder.fill_random(seed=1)
        params = holder.client.hold_blocks(
            engine_id="p", request_id="r", block_ids=list(range(64)), num_tokens=1024
        ).kv_transfer_params
        started = reader.client.start_pull(
            engine_id="d", tp_rank=0, request_id="r", local_block_ids=list(range(10, 74)), remote=params
        )
        status = reader.client.wait_transfer(started.transfer_id, timeout_s=60)
        # 32 layers x K/V, each a single run of 64 adjacent blocks: 64 descriptors, not 4096.
        assert status.descriptors == 64
        assert reader.token_bytes(list(range(10, 74)), 1024).equal(holder.token_bytes(list(range(64)), 1024))
        text = scrape(b.metrics)
        assert metric_value(text, "kvd_transfer_descriptors_sum") == 64
    finally:
        holder.close()
        reader.close()


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_a_pull_between_two_engines_of_one_daemon_reads_in_place(spawn_daemon, transports: str) -> None:
    """Both engines on one node, one daemon: the daemon is the holder and the reader. Concurrent
    pulls each way arrive byte-exact through NIXL's own agent (over TCP too), the holder's
    accounting sees each read (served == pulled), and nothing is loaded as a remote agent."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None
    a = spawn_daemon(name="a", env=env)
    spec = small_spec(num_blocks=48)
    prefill = ShmEngine(a.unix_target, "prefill", spec)
    decode = ShmEngine(a.unix_target, "decode", spec)
    try:
        prefill.register()
        decode.register()
        prefill.fill_random(seed=5)
        decode.fill_random(seed=6)
        pulls = []
        for i in range(4):  # decode pulls four requests from prefill, prefill one back from decode
            src = list(range(i * 4, i * 4 + 4))
            params = prefill.client.hold_blocks(
                engine_id="prefill", request_id=f"r{i}", block_ids=src, num_tokens=4 * spec.block_size
            ).kv_transfer_params
            pulls.append((decode, "decode", src, list(range(24 + i * 4, 28 + i * 4)), params, prefill))
        back = list(range(40, 44))
        params = decode.client.hold_blocks(
            engine_id="decode", request_id="t2", block_ids=back, num_tokens=4 * spec.block_size
        ).kv_transfer_params
        pulls.append((prefill, "prefill", back, list(range(16, 20)), params, decode))

        def run(item):  # type: ignore[no-untyped-def]
            reader, engine_id, _src, dst, params, _holder = item
            started = reader.client.start_pull(
                engine_id=engine_id, tp_rank=0, request_id=f"pull-{dst[0]}", local_block_ids=dst, remote=params
            )
            return reader.client.wait_transfer(started.transfer_id, timeout_s=60)

        with ThreadPoolExecutor(len(pulls)) as pool:
            statuses = list(pool.map(run, pulls))
        for (reader, _, src, dst, _, holder), status in zip(pulls, statuses, strict=True):
            assert status.state == common_pb2.TRANSFER_STATE_DONE, status
            assert reader.token_bytes(dst, 4 * spec.block_size).equal(holder.token_bytes(src, 4 * spec.block_size))
        text = scrape(a.metrics)
        pulled = metric_value(text, "kvd_transfer_bytes_total", direction="pull")
        assert pulled == sum(s.bytes for s in statuses) > 0
        served = eventually(
            lambda: metric_value(scrape(a.metrics), "kvd_transfer_bytes_total", direction="serve"), pulled
        )
        assert served == pulled
        assert metric_value(text, "kvd_remote_agents") == 1  # its own agent's lists, nothing loaded
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_with_nixls_progress_thread_pulls_are_exact_and_an_idle_worker_does_not_spin(
    spawn_daemon, transports: str
) -> None:
    """``nixl_progress_thread = true``: NIXL's thread waits on UCX's event fd instead of spinning.
    Pulls both ways arrive byte-exact (over TCP too, where the holder's progress serves every
    READ), and an idle worker with the thread costs next to nothing (spinning, it took a core)."""
    import os
    import time

    env = {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None
    a = spawn_daemon("--nixl-progress-thread", "true", name="a", env=env)
    b = spawn_daemon("--nixl-progress-thread", "true", name="b", env=env)
    spec = small_spec(num_blocks=48)
    engines = {d.name: ShmEngine(d.unix_target, f"e-{d.name}", spec) for d in (a, b)}
    try:
        for engine in engines.values():
            engine.register()
        rng = random.Random(11)
        for round_ in range(6):
            holder_daemon, reader_daemon = (a, b) if round_ % 2 == 0 else (b, a)
            holder, reader = engines[holder_daemon.name], engines[reader_daemon.name]
            holder.fill_random(seed=round_)
            reader.fill(0xAB)
            num_tokens = 16 * rng.randint(1, 12) + rng.randint(0, 15)
            blocks = -(-num_tokens // 16)
            held, local = rng.sample(range(48), blocks), rng.sample(range(48), blocks)
            params = holder.client.hold_blocks(
                engine_id=holder.engine_id, request_id=f"r{round_}", block_ids=held, num_tokens=num_tokens
            ).kv_transfer_params
            started = reader.client.start_pull(
                engine_id=reader.engine_id, tp_rank=0, request_id=f"r{round_}", local_block_ids=local, remote=params
            )
            status = reader.client.wait_transfer(started.transfer_id, timeout_s=30)
            assert status.state == common_pb2.TRANSFER_STATE_DONE, status.error_message
            assert reader.token_bytes(local, num_tokens).equal(holder.token_bytes(held, num_tokens))
        time.sleep(1.5)  # past the worker's fast polls
        for engine in engines.values():
            pid = engine.client.get_status().dataplane_pid
            before, started_at = cpu_seconds(pid), time.monotonic()
            time.sleep(2.0)
            share = (cpu_seconds(pid) - before) / (time.monotonic() - started_at)
            assert share < 0.25, f"an idle data-plane worker used {share:.0%} of a core (a spinning progress thread?)"
    finally:
        for engine in engines.values():
            engine.close()


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_a_read_over_the_post_bound_goes_in_pieces_and_arrives_exact(spawn_daemon, transports: str) -> None:
    """``dataplane_max_post_bytes`` at its 1 MiB floor and a 40 MiB pull of scattered blocks: the
    READ goes to NIXL in ~40 pieces (kvd.worker.nixl_agent), each next one once the previous is
    done, the notification with the last. The bytes arrive exact, and the holder's hold ends on
    that one notification: its engine hears ``finished_sending`` and no lease is left."""
    import os
    import re

    env = {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None
    bound = 1 << 20
    a = spawn_daemon("--dataplane-max-post-bytes", str(bound), name="a", env=env)
    b = spawn_daemon("--dataplane-max-post-bytes", str(bound), "--log-level", "DEBUG", name="b", env=env)
    spec = small_spec(num_blocks=320, num_kv_heads=8, head_dim=128)  # 32 KiB a block per layer's K or V
    holder, reader = ShmEngine(a.unix_target, "holder", spec), ShmEngine(b.unix_target, "reader", spec)
    try:
        holder.register()
        reader.register()
        holder_stream = holder.client.open_engine_stream("holder", 0)
        rng = random.Random(5)
        for round_ in range(3):
            holder.fill_random(seed=round_)
            reader.fill(0xAB)
            num_tokens = 160 * 16 - rng.randint(0, 15)
            held, local = rng.sample(range(320), 160), rng.sample(range(320), 160)
            params = holder.client.hold_blocks(
                engine_id="holder", request_id=f"r{round_}", block_ids=held, num_tokens=num_tokens
            ).kv_transfer_params
            started = reader.client.start_pull(
                engine_id="reader", tp_rank=0, request_id=f"r{round_}", local_block_ids=local, remote=params
            )
            status = reader.client.wait_transfer(started.transfer_id, timeout_s=60)
            assert status.state == common_pb2.TRANSFER_STATE_DONE, status.error_message
            assert status.bytes > 30 * bound and status.descriptors > 30, "the READ must need many pieces"
            assert reader.token_bytes(local, num_tokens).equal(holder.token_bytes(held, num_tokens))
            assert reader.untouched_mask_ok(local, 0xAB, num_tokens)
            sent = _events(holder, holder_stream, "finished_sending")
            assert [m.finished_sending.request_id for m in sent] == [f"r{round_}"]
            assert not sent[0].finished_sending.expired, "the hold expired: the notification never came"
            assert not holder.client.lookup_held(engine_id="holder").held
        pieces = [int(n) for n in re.findall(r"its last piece posted, (\d+) in all", b.log_path.read_text())]
        assert len(pieces) == 3 and min(pieces) >= 30, pieces  # the reader's worker logs each READ in pieces
        holder_stream.close()
    finally:
        holder.close()
        reader.close()


def test_one_daemon_holder_re_registered_between_and_during_pulls(spawn_daemon) -> None:
    """Both engines on one daemon, the holder engine unregistered and registered again under the
    same id (new memory), between pulls and while pulls from it read: a pull after each
    re-registration is exact (the daemon's cached view of itself is refreshed, its lists over the
    old memory never used), and a pull caught by one ends DONE and exact or fails with a
    retryable error naming the cause, never INTERNAL."""
    import threading

    from kvd_client import errors

    a = spawn_daemon(name="a")
    spec = small_spec(num_blocks=64)
    reader = ShmEngine(a.unix_target, "d", spec)
    holder = ShmEngine(a.unix_target, "p", spec)
    caught: list[str] = []
    try:
        reader.register()
        for round_ in range(6):
            holder.register()
            holder.fill_random(100 + round_)
            blocks = list(range(8))
            params = holder.client.hold_blocks(
                engine_id="p", request_id=f"r{round_}", block_ids=blocks, num_tokens=8 * spec.block_size
            ).kv_transfer_params
            started = reader.client.start_pull(
                engine_id="d", tp_rank=0, request_id=f"r{round_}", local_block_ids=list(range(20, 28)), remote=params
            )
            status = reader.client.wait_transfer(started.transfer_id, timeout_s=30)
            assert status.state == common_pb2.TRANSFER_STATE_DONE, status
            assert reader.token_bytes(list(range(20, 28)), 8 * spec.block_size).equal(
                holder.token_bytes(blocks, 8 * spec.block_size)
            )
            # Pulls in flight while the holder goes away and comes back.
            ids = []
            for i in range(3):
                params = holder.client.hold_blocks(
                    engine_id="p", request_id=f"x{round_}-{i}", block_ids=[i], num_tokens=spec.block_size
                ).kv_transfer_params
                ids.append(
                    reader.client.start_pull(
                        engine_id="d", tp_rank=0, request_id=f"x{round_}-{i}", local_block_ids=[40 + i], remote=params
                    ).transfer_id
                )
            swap = threading.Thread(target=holder.close)
            swap.start()
            for transfer_id in ids:
                try:
                    reader.client.wait_transfer(transfer_id, timeout_s=30)
                except errors.KvdError as exc:
                    assert not isinstance(exc, errors.Internal), f"INTERNAL: {exc}"
                    caught.append(type(exc).__name__)
            swap.join()
            holder = ShmEngine(a.unix_target, "p", spec)
        assert a.process.poll() is None
    finally:
        holder.close()
        reader.close()


@pytest.mark.parametrize("transports", ["default", "tcp"])
@pytest.mark.parametrize("daemons", ["two", "one"])
def test_large_reads_copied_by_several_threads_arrive_exact(spawn_daemon, transports: str, daemons: str) -> None:
    """``dataplane_copy_threads`` 2 with its floor at 1 MiB: every READ of a pull over 1 MiB is
    re-cut into ~512 equal descriptors that NIXL's thread pool copies on two threads
    (kvd.worker.nixl_agent). Concurrent pulls of scattered blocks with partial last blocks, both
    ways (and within one daemon), arrive byte-exact with nothing outside them written, the
    holder's accounting sees every byte, and the readers' logs show the parallel posts."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    env = {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None
    flags = (
        "--dataplane-copy-threads",
        "2",
        "--dataplane-parallel-read-min-bytes",
        str(1 << 20),
        "--log-level",
        "DEBUG",
    )
    a = spawn_daemon(*flags, name="a", env=env)
    b = a if daemons == "one" else spawn_daemon(*flags, name="b", env=env)
    spec = llama_spec(num_blocks=64)  # 2 MiB a block
    left, right = ShmEngine(a.unix_target, "left", spec), ShmEngine(b.unix_target, "right", spec)
    try:
        left.register()
        right.register()
        left.fill_random(seed=21)
        right.fill_random(seed=22)
        rng = random.Random(8)
        # Each engine holds from its first 32 blocks and is written in its last 32, every pull's
        # blocks its own: concurrent pulls never read what another writes.
        held_pool = {e: rng.sample(range(32), 32) for e in ("left", "right")}
        write_pool = {e: rng.sample(range(32, 64), 32) for e in ("left", "right")}
        pulls = []
        for i in range(6):  # three each way, at once
            holder, reader = (left, right) if i % 2 == 0 else (right, left)
            num_tokens = 16 * rng.randint(2, 6) + rng.randint(1, 15)
            blocks = -(-num_tokens // 16)
            held = [held_pool[holder.engine_id].pop() for _ in range(blocks)]
            local = [write_pool[reader.engine_id].pop() for _ in range(blocks)]
            params = holder.client.hold_blocks(
                engine_id=holder.engine_id, request_id=f"r{i}", block_ids=held, num_tokens=num_tokens
            ).kv_transfer_params
            pulls.append((holder, reader, held, local, num_tokens, params, i))
        expected = {i: holder.token_bytes(held, n).clone() for holder, _, held, _, n, _, i in pulls}

        def run(item):  # type: ignore[no-untyped-def]
            _holder, reader, _held, local, _n, params, i = item
            started = reader.client.start_pull(
                engine_id=reader.engine_id, tp_rank=0, request_id=f"r{i}", local_block_ids=local, remote=params
            )
            return reader.client.wait_transfer(started.transfer_id, timeout_s=60)

        with ThreadPoolExecutor(len(pulls)) as pool:
            statuses = list(pool.map(run, pulls))
        for (_holder, reader, _held, local, num_tokens, _, i), status in zip(pulls, statuses, strict=True):
            assert status.state == common_pb2.TRANSFER_STATE_DONE, status.error_message
            assert reader.token_bytes(local, num_tokens).equal(expected[i]), f"pull {i} is not byte-exact"
        everyone = [a] if b is a else [a, b]
        pulled = sum(metric_value(scrape(d.metrics), "kvd_transfer_bytes_total", direction="pull") for d in everyone)
        served = eventually(
            lambda: sum(
                metric_value(scrape(d.metrics), "kvd_transfer_bytes_total", direction="serve") for d in everyone
            ),
            pulled,
        )
        assert pulled == served == sum(s.bytes for s in statuses)
        logs = "".join(d.log_path.read_text(errors="replace") for d in everyone)
        assert logs.count("descriptors for 2 copy threads") >= len(pulls), "the READs were not copied in parallel"
    finally:
        left.close()
        right.close()
