"""The reference engine's deterministic "model": what every KV vector and every token must be.

KV values are a pure function of (token id, position, layer, head, dim) (:func:`kv_values`), so
any engine, daemon or test can say what the bytes must be (:func:`expected_kv`); the next token
is a pure function of the last one and its position (:func:`oracle_next_token`), so drafts are
verified against it and the token stream is the same whatever the drafts' acceptance
(:class:`AcceptancePattern`, :class:`DraftProposer`) only the number of steps changes.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Sequence
from random import Random  # the name `random` is shadowed inside AcceptancePattern

import torch

__all__ = [
    "AcceptancePattern",
    "DraftProposer",
    "expected_kv",
    "kv_values",
    "layer_name",
    "oracle_next_token",
    "oracle_next_tokens",
]

K, V, Q = 0, 1, 2


def layer_name(index: int) -> str:
    """The name vLLM gives attention layer ``index`` (what ``register_kv_caches`` keys on)."""
    return f"model.layers.{index}.self_attn.attn"


# --- the deterministic "model" -----------------------------------------------------------------


def kv_values(
    tokens: torch.Tensor, positions: torch.Tensor, layer: int, head_ids: torch.Tensor, head_dim: int, which: int
) -> torch.Tensor:
    """``[T, H, D]`` float32: K (``which=0``), V (1) or Q (2) of tokens at positions.

    Values are multiples of 1/128 in [-125/128, 125/128]: exact in float16, bfloat16 and
    float32, so a cast is lossless and bytes can be compared across engines and dtypes.
    """
    dims = torch.arange(head_dim, device=tokens.device, dtype=torch.int64)
    x = (
        tokens.to(torch.int64)[:, None, None] * 131
        + positions.to(torch.int64)[:, None, None] * 31
        + layer * 17
        + head_ids.to(tokens.device, torch.int64)[None, :, None] * 7
        + dims[None, None, :] * 3
        + which * 53
    )
    return ((x % 251) - 125).to(torch.float32) / 128.0


def expected_kv(
    token_ids: Sequence[int],
    *,
    layer: int,
    head_ids: Iterable[int],
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    start_position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V ``[T, H, D]`` any engine must hold for ``token_ids`` (at consecutive positions)."""
    tokens = torch.as_tensor(list(token_ids), dtype=torch.int64)
    positions = torch.arange(start_position, start_position + tokens.shape[0], dtype=torch.int64)
    heads = torch.as_tensor(list(head_ids), dtype=torch.int64)
    return (
        kv_values(tokens, positions, layer, heads, head_dim, K).to(dtype),
        kv_values(tokens, positions, layer, heads, head_dim, V).to(dtype),
    )


_MULT = 1103515245
_INC = 12345


def oracle_next_token(token: int, position: int, vocab_size: int) -> int:
    """The "model": the token at ``position`` that follows ``token``. Deterministic."""
    return (token * _MULT + position * _INC + 7) % vocab_size


def oracle_next_tokens(tokens: torch.Tensor, next_positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vectorised :func:`oracle_next_token` (same values)."""
    return (tokens.to(torch.int64) * _MULT + next_positions.to(torch.int64) * _INC + 7) % vocab_size


# --- speculative decoding -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AcceptancePattern:
    """How many of each step's drafts the proposer gets right (so how many are accepted)."""

    kind: str  # "all", "none", "partial", "random"
    accept: int = 0  # partial: drafts right per step
    seed: int = 0  # random: the draw of each step

    def __post_init__(self) -> None:
        if self.kind not in ("all", "none", "partial", "random"):
            raise ValueError(f"unknown acceptance pattern {self.kind!r}")
        if self.accept < 0:
            raise ValueError("AcceptancePattern.accept must be >= 0")

    @classmethod
    def all(cls) -> AcceptancePattern:
        return cls("all")

    @classmethod
    def none(cls) -> AcceptancePattern:
        return cls("none")

    @classmethod
    def partial(cls, accept: int) -> AcceptancePattern:
        return cls("partial", accept=accept)

    @classmethod
    def random(cls, seed: int) -> AcceptancePattern:
        return cls("random", seed=seed)

    def correct_drafts(self, num_drafts: int, rng: Random) -> int:
        if self.kind == "all":
            return num_drafts
        if self.kind == "none":
            return 0
        if self.kind == "partial":
            return min(self.accept, num_drafts)
        return rng.randint(0, num_drafts)


class DraftProposer:
    """Proposes ``k`` drafts: the first ``pattern.correct_drafts(k)`` right, the rest wrong."""

    def __init__(self, num_speculative_tokens: int, pattern: AcceptancePattern, vocab_size: int) -> None:
        self.k = num_speculative_tokens
        self.pattern = pattern
        self.vocab_size = vocab_size
        self._rng = random.Random(pattern.seed)

    def propose(self, last_token: int, next_position: int) -> list[int]:
        """Drafts for positions ``next_position, next_position + 1, ...`` (k is small: a plain loop)."""
        if self.k == 0:
            return []
        right = self.pattern.correct_drafts(self.k, self._rng)
        drafts = []
        token = last_token
        for j in range(self.k):
            true = oracle_next_token(token, next_position + j, self.vocab_size)
            token = true if j < right else (true + 1) % self.vocab_size
            drafts.append(token)
        return drafts
