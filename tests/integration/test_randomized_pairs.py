"""The randomized cross-check in CI: engines of random format / layout / block size / TP / dtype
come and go on two real daemons while readers pull from them, one at a time and three in parallel;
every pull's bytes are checked against the oracle (tests/randomized_pairs.py says how).

Bounded here (``KVD_RANDOM_S`` seconds per parallelism, 40 by default); a longer run is
``python tests/randomized_pairs.py --seconds 600 --parallel 3``. Each run prints its seed; a
failing case is replayed from the seed alone (``--seed S --parallel P``).
"""

from __future__ import annotations

import os
import random

import pytest
from randomized_pairs import run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SECONDS = float(os.environ.get("KVD_RANDOM_S", "40"))


@pytest.mark.parametrize("parallel", [1, 3])
def test_engines_that_come_and_go_serve_exact_bytes(spawn_daemon, parallel: int) -> None:
    seed = int(os.environ.get("KVD_RANDOM_SEED", "0")) or random.randrange(1 << 31)
    print(f"randomized pairs: seed {seed}, {parallel} in parallel (replay: tests/randomized_pairs.py --seed {seed})")
    daemons = [spawn_daemon(name="a"), spawn_daemon(name="b")]
    outcome = run(daemons, seed, parallel, seconds=SECONDS)
    assert outcome.pulls >= 20, f"only {outcome.pulls} pulls ran in {SECONDS}s"
    assert not outcome.failures, (
        f"seed {seed}: {len(outcome.failures)} of {outcome.pulls} pulls failed; first: {outcome.failures[:3]}"
    )
    assert outcome.exact == outcome.pulls
