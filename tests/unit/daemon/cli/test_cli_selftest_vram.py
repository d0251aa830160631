"""`kvd selftest --vram`: refused with the reason where it cannot run (the GPU run itself is
tests/gpu territory: scripts/gpu-check.sh runs it on a GPU machine, docs/gpu-check.md)."""

from __future__ import annotations

import pytest
import torch

from kvd.cli.main import main
from kvd.cli.selftest_vram import gpu_mismatches


def test_vram_refuses_running_daemons(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--vram", "--peer", "127.0.0.1:1"]) == 2
    assert "--vram starts both daemons itself" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_vram_without_cuda_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--vram"]) == 2
    err = capsys.readouterr().err
    assert "--vram needs a CUDA device" in err and "torch.cuda.is_available() is False" in err


def test_mismatches_are_counted_only_when_there_are_any() -> None:
    expected = torch.arange(64, dtype=torch.uint8)
    count = gpu_mismatches(expected)  # device-agnostic: the same code compares on the GPU
    assert count(expected.clone()) == 0
    damaged = expected.clone()
    damaged[3:6] = 0
    assert count(damaged) == 3
