"""Generate the blocking client (client/sync.py) from its asyncio twin (client/aio.py).

The two clients have the same methods, arguments, errors and, but for a few words, docstrings;
keeping them by hand let them drift. As httpcore does with its ``unasync`` script, the asyncio
source is the one that is edited and the sync one is derived from it:

1. :data:`TEXT` pairs replace the few passages of prose that must read differently (a docstring
   that speaks of the event loop, say). Each async passage must occur exactly once, so editing one
   without its pair fails the generation instead of leaving a wrong docstring behind.
2. :data:`TOKENS` rewrite each line with word-bounded regexes: ``async def`` -> ``def``,
   ``await`` -> nothing, ``AsyncKvdClient`` -> ``KvdClient``, ``grpc.aio`` -> ``grpc``, the
   ``_aio`` helpers -> their sync names, and so on.
3. An import line left identical to the one above it (``import grpc.aio`` became ``import grpc``)
   is dropped, then ``ruff check --select I --fix`` sorts the imports and ``ruff format`` formats
   the result, so the output passes ruff as checked in.

Where the two clients genuinely differ in code, the asyncio source is written so the difference is
one of these tokens (``contextlib.aclosing`` -> ``contextlib.closing``) or lives in a helper both
call (``kvd_client._base``, ``kvd_client.channel``, ``kvd_client.grpc_errors``).

The engine streams (``_aio_engine_stream.py``, ``_engine_stream.py``) are not generated: one runs
on a background thread with a hot-path ``poll``, the other on an asyncio task with an async
iterator, so they share their helpers (in ``_engine_stream``) rather than their text.

Usage: python tools/gen_sync.py [--check]
  (no flag)  rewrite client/sync.py
  --check    exit 1, printing a diff, if client/sync.py differs from a fresh generation
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "client" / "aio.py"
TARGET = ROOT / "client" / "sync.py"
HEADER = "# Generated from client/aio.py by tools/gen_sync.py; do not edit.\n"

TEXT: tuple[tuple[str, str], ...] = (
    (
        "# The source of client/sync.py too: edit here, then run python tools/gen_sync.py.\n",
        "",  # the generated file gets HEADER instead
    ),
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
"""(asyncio text, sync text): prose that differs between the twins; each async text occurs once."""

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
    # grpc.
    (r"\bgrpc\.aio\b", "grpc"),
    # kvd_client.
    (r"\bAsyncKvdClient\b", "KvdClient"),
    (r"\bAsyncEngineStream\b", "EngineStream"),
    (r"\b_aio_engine_stream\b", "_engine_stream"),
    (r"\bAsyncTransferWatch\b", "TransferWatch"),
    (r"\b_aio_transfer_watch\b", "_transfer_watch"),
    (r"\bcreate_aio_channel\b", "create_channel"),
    (r"\btranslate_async\b", "translate"),
    (r"\btranslate_aiter\b", "translate_iter"),
)
"""(regex, replacement) applied in order to every line of the asyncio source."""

_TOKENS = tuple((re.compile(pattern), replacement) for pattern, replacement in TOKENS)


def _replace_text(source: str) -> str:
    for async_text, sync_text in TEXT:
        count = source.count(async_text)
        if count != 1:
            raise SystemExit(
                f"tools/gen_sync.py: TEXT entry found {count} times in {SOURCE.name}, not once:\n{async_text}"
            )
        source = source.replace(async_text, sync_text)
    return source


def _unasync_lines(source: str) -> str:
    out: list[str] = []
    for line in source.splitlines(keepends=True):
        for pattern, replacement in _TOKENS:
            line = pattern.sub(replacement, line)
        if out and line.startswith("import ") and line == out[-1]:
            continue  # "import grpc" twice, once from "import grpc.aio"
        out.append(line)
    return "".join(out)


def _ruff(args: list[str], source: str) -> str:
    """``source`` through ruff (as if it were client/sync.py, so the project's settings apply)."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(TARGET), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"tools/gen_sync.py: ruff {' '.join(args)} failed:\n{result.stderr}{result.stdout}")
    return result.stdout


def generate() -> str:
    """The text client/sync.py must hold, made from client/aio.py."""
    source = _unasync_lines(_replace_text(SOURCE.read_text()))
    source = _ruff(["check", "--select", "I", "--fix", "--quiet", "--exit-zero"], HEADER + source)
    return _ruff(["format", "--quiet"], source)


def check() -> list[str]:
    """The unified diff from the checked-in client/sync.py to a fresh generation; empty if current."""
    current = TARGET.read_text() if TARGET.exists() else ""
    fresh = generate()
    return list(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            fresh.splitlines(keepends=True),
            fromfile="client/sync.py (checked in)",
            tofile="client/sync.py (generated from client/aio.py)",
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail with a diff if client/sync.py is stale")
    args = parser.parse_args()
    if args.check:
        diff = check()
        if diff:
            sys.stdout.writelines(diff)
            print("client/sync.py is stale: run python tools/gen_sync.py and commit the result", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(generate())
    print(TARGET.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
