"""Benchmark of heterogeneous pulls; the code lives in :mod:`kvd.bench.convert` (``kvd bench`` uses it).

Run: ``python tests/bench/bench_convert.py [--tokens 1024] [--repeat 5] [--device cpu|cuda]``.
"""

from kvd.bench.convert import main

if __name__ == "__main__":
    main()
