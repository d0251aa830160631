"""Generate the blocking front ends of the client from their asyncio twins (:data:`PAIRS`).

The blocking client (client/sync.py) and the asyncio one (client/aio.py) have the same methods,
arguments, errors and, but for a few words, docstrings; so have the two engine streams
(client/_engine_stream.py, client/_aio_engine_stream.py). Keeping them by hand let them drift. As
httpcore does with its ``unasync`` script, the asyncio source is the one that is edited and the
sync one is derived from it:

1. The source's first line, ``# The source of <target> too: ...``, becomes :data:`HEADER`.
2. A line whose comment ends with ``# asyncio only`` is dropped with the block it opens (every
   line below it indented deeper): what only the asyncio twin has, such as ``__aiter__`` or the
   ``except asyncio.CancelledError`` that grpc.aio raises for a locally cancelled call.
3. Each pair's ``text`` replaces the few passages of prose that must read differently (a
   docstring that speaks of the event loop, say). Each async passage must occur exactly once, so
   editing one without its pair fails the generation instead of leaving a wrong docstring behind.
4. :data:`TOKENS` rewrite each line with word-bounded regexes: ``async def`` -> ``def``,
   ``await`` -> nothing, ``AsyncKvdClient`` -> ``KvdClient``, ``grpc.aio`` -> ``grpc``,
   ``asyncio.Queue`` -> ``queue.SimpleQueue``, the ``_aio`` helpers -> their sync names, and so on.
5. An import line left identical to the one above it (``import grpc.aio`` became ``import grpc``)
   is dropped, then ``ruff check --select I --fix`` sorts the imports and ``ruff format`` formats
   the result, so the output passes ruff as checked in.

Where the twins genuinely differ in code, the asyncio source is written so the difference is one
of these tokens (``contextlib.aclosing`` -> ``contextlib.closing``) or lives in a helper both
call: ``kvd_client._base``, ``kvd_client.channel``, ``kvd_client.grpc_errors``, and
``kvd_client._background`` for where background work runs (``AsyncBackground``, a task of the
loop, -> ``Background``, a daemon thread; ``wait_event_async`` -> ``wait_event``), and
``kvd_client._frames`` for the engine stream over a framed socket (``AsyncFramedCall``, asyncio
streams, -> ``FramedCall``, a blocking socket and a writer thread). The engine
stream's hot path (``send_commit``, ``poll``) is written in the asyncio source as the thread
twin needs it: a plain queue put, a deque drained without a lock.

The transfer watches (``_aio_transfer_watch.py``, ``_transfer_watch.py``) are not generated:
the thread twin is waited on from any thread, so a lock guards its book around every touch
(``with self._lock:`` blocks that change the code's indentation), which the loop-bound asyncio
twin must not have; and their waiters are different futures (``concurrent.futures`` waited with
a timeout, asyncio's cancelled on the way out). They share their rules and the runs that read
the same instead, in ``kvd_client._watch_book``.

Usage: python tools/gen_sync.py [--check]
  (no flag)  rewrite every generated file
  --check    exit 1, printing a diff, if a generated file differs from a fresh generation
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_NOTE = "# The source of {target} too: edit here, then run python tools/gen_sync.py.\n"
"""The first line of every asyncio source (it names the file generated from it)."""
HEADER = "# Generated from {source} by tools/gen_sync.py; do not edit.\n"
"""The first line of every generated file."""
ASYNCIO_ONLY = "# asyncio only"
"""The comment that ends a line opening a block only the asyncio twin has."""

CLIENT_TEXT: tuple[tuple[str, str], ...] = (
    (
        '"""The asyncio client of a kvd daemon',
        '"""The blocking client of a kvd daemon',
    ),
    (
        '''    """An asyncio connection to one daemon (Unix socket for engines, TCP for routers).

    Create and use it inside one running event loop (grpc.aio channels belong to their loop).
    Pass ``channel=`` to use a grpc.aio channel you built; the client then does not close it.
    """''',
        '''    """A connection to one daemon (Unix socket for engines, TCP for routers).

    Pass ``channel=`` to use a channel you built (interceptors, tests); the client then does not
    close it. Thread-safe: grpc channels and stubs may be shared between threads.
    """''',
    ),
    (
        """        Call it from the running loop (the stream's reader is a task of that loop). No deadline
        applies: the stream lives as long as the engine.""",
        """        No deadline applies: the stream lives as long as the engine.""",
    ),
    (
        '"""Wait until the transfer ends:',
        '"""Block until the transfer ends:',
    ),
)
"""(asyncio text, sync text): prose that differs between the clients; each async text occurs once."""

ENGINE_STREAM_TEXT: tuple[tuple[str, str], ...] = (
    (
        '''"""The engine's long-lived stream to its daemon (asyncio front end).

Same contract as :class:`kvd_client.EngineStream`: sends are plain (non-async) queue puts that
never wait on the daemon, a background task collects what the daemon sends, :attr:`closed` and
:attr:`error` report the end of the RPC. ``poll`` and ``close`` are coroutines, and the stream is an
async iterator of the daemon's messages. Use it from the event loop that created it.

With ``stream_socket`` (the client passes its daemon's: kvd_client._frames) the stream runs over
the daemon's framed socket, without gRPC, where the daemon serves one; over gRPC otherwise.
"""''',
        '''"""The engine's long-lived stream to its daemon (sync front end).

An inference engine calls :meth:`EngineStream.send_commit` and
:meth:`EngineStream.send_post_forward` on its per-step critical path, so a send is one
``SimpleQueue.put`` of a tuple (a fraction of a microsecond): the proto message is built later, on
grpc's request thread, and nothing ever waits on the daemon. A background thread reads what the
daemon sends into a deque that :meth:`poll` drains without blocking. When the RPC ends for any
reason, :attr:`closed` turns true and :attr:`error` says why (None after a clean :meth:`close`),
so the engine notices a dead daemon at its next poll.

With ``stream_socket`` (the client passes its daemon's: kvd_client._frames) the stream runs over
the daemon's framed socket, without gRPC, where the daemon serves one (a writer thread of its own
sends what the queue holds); over gRPC otherwise.
"""''',
    ),
    (
        '''    """One engine rank's bidirectional stream to its daemon, driven by an asyncio task."""''',
        '''    """One engine rank's bidirectional stream to its daemon, driven by a background thread.

    Use one consumer for :meth:`poll`; sends may come from any thread. Messages sent after the
    stream has ended are dropped and the send returns False.
    """''',
    ),
)
"""(asyncio text, sync text): prose that differs between the engine streams."""


@dataclasses.dataclass(frozen=True)
class Pair:
    """One generated file: ``target`` made from the asyncio ``source`` (paths under the repository)."""

    source: str
    target: str
    text: tuple[tuple[str, str], ...]


PAIRS: tuple[Pair, ...] = (
    Pair("client/aio.py", "client/sync.py", CLIENT_TEXT),
    Pair("client/_aio_engine_stream.py", "client/_engine_stream.py", ENGINE_STREAM_TEXT),
)
"""Every generated file, from its asyncio source."""

TOKENS: tuple[tuple[str, str], ...] = (
    # Syntax.
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\b__aiter__\b", "__iter__"),
    (r"\b__anext__\b", "__next__"),
    (r"\bStopAsyncIteration\b", "StopIteration"),
    # Standard library.
    (r"\bAsyncGenerator\[(.+), None\]", r"Generator[\1, None, None]"),
    (r"\bAsyncGenerator\b", "Generator"),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\bAsyncIterable\b", "Iterable"),
    (r"\baclosing\b", "closing"),
    (r"\basyncio\.sleep\b", "time.sleep"),
    (r"^import asyncio$", "import queue\nimport threading"),
    (r"\basyncio\.Queue\b", "queue.SimpleQueue"),
    (r"\basyncio\.Event\b", "threading.Event"),
    (r"\.put_nowait\(", ".put("),
    # grpc.
    (r"\bgrpc\.aio\b", "grpc"),
    # kvd_client.
    (r"\bAsyncKvdClient\b", "KvdClient"),
    (r"\bAsyncEngineStream\b", "EngineStream"),
    (r"\b_aio_engine_stream\b", "_engine_stream"),
    (r"\bAsyncTransferWatch\b", "TransferWatch"),
    (r"\b_aio_transfer_watch\b", "_transfer_watch"),
    (r"\bcreate_aio_channel\b", "create_channel"),
    (r"\bAsyncBackground\b", "Background"),
    (r"\bAsyncFramedCall\b", "FramedCall"),
    (r"\bwait_event_async\b", "wait_event"),
    (r"\btranslate_async\b", "translate"),
    (r"\btranslate_aiter\b", "translate_iter"),
)
"""(regex, replacement) applied in order to every line of the asyncio source."""

_TOKENS = tuple((re.compile(pattern), replacement) for pattern, replacement in TOKENS)


def _replace_text(pair: Pair, source: str) -> str:
    note = SOURCE_NOTE.format(target=pair.target)
    texts = ((note, ""), *pair.text)  # the note's place is taken by HEADER, after the tokens
    for async_text, sync_text in texts:
        count = source.count(async_text)
        if count != 1:
            raise SystemExit(f"tools/gen_sync.py: text found {count} times in {pair.source}, not once:\n{async_text}")
        source = source.replace(async_text, sync_text)
    return source


def _drop_asyncio_only(source: str) -> str:
    """``source`` without the blocks opened by a line ending in :data:`ASYNCIO_ONLY`."""
    out: list[str] = []
    block_indent: int | None = None
    for line in source.splitlines(keepends=True):
        indent = len(line) - len(line.lstrip())
        if block_indent is not None:
            if not line.strip() or indent > block_indent:
                continue
            block_indent = None
        if line.rstrip().endswith(ASYNCIO_ONLY):
            block_indent = indent
            continue
        out.append(line)
    return "".join(out)


def _unasync_lines(source: str) -> str:
    out: list[str] = []
    for line in source.splitlines(keepends=True):
        for pattern, replacement in _TOKENS:
            line = pattern.sub(replacement, line)
        if out and line.startswith("import ") and line == out[-1]:
            continue  # "import grpc" twice, once from "import grpc.aio"
        out.append(line)
    return "".join(out)


def _ruff(args: list[str], source: str, target: str) -> str:
    """``source`` through ruff (as if it were ``target``, so the project's settings apply)."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(ROOT / target), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"tools/gen_sync.py: ruff {' '.join(args)} failed:\n{result.stderr}{result.stdout}")
    return result.stdout


def generate(pair: Pair) -> str:
    """The text ``pair.target`` must hold, made from ``pair.source``."""
    source = _unasync_lines(_replace_text(pair, _drop_asyncio_only((ROOT / pair.source).read_text())))
    source = HEADER.format(source=pair.source) + source
    source = _ruff(["check", "--select", "I", "--fix", "--quiet", "--exit-zero"], source, pair.target)
    return _ruff(["format", "--quiet"], source, pair.target)


def check(pair: Pair) -> list[str]:
    """The unified diff from the checked-in ``pair.target`` to a fresh generation; empty if current."""
    target = ROOT / pair.target
    current = target.read_text() if target.exists() else ""
    fresh = generate(pair)
    return list(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            fresh.splitlines(keepends=True),
            fromfile=f"{pair.target} (checked in)",
            tofile=f"{pair.target} (generated from {pair.source})",
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail with a diff if a generated file is stale")
    args = parser.parse_args()
    if args.check:
        stale = 0
        for pair in PAIRS:
            diff = check(pair)
            if diff:
                sys.stdout.writelines(diff)
                print(f"{pair.target} is stale: run python tools/gen_sync.py and commit the result", file=sys.stderr)
                stale += 1
        return 1 if stale else 0
    for pair in PAIRS:
        (ROOT / pair.target).write_text(generate(pair))
        print(pair.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
