"""NWOR ("no write on reject"): deferred KV-cache writes for speculative decoding.

A verification step runs the target model over each request's last token plus its draft
tokens and writes the KV of *all* those positions. Some drafts are then rejected; their
KV is garbage that sits in the paged cache until overwritten. For kvd that garbage matters:
a block can be shipped to a peer while it still holds rejected-draft KV. NWOR keeps it out:

* ``STAGE``: during a verification *window* the KV writes are staged; once the acceptance
  mask is known, only accepted positions reach the cache. Two strategies, picked by who
  reads the cache during the forward:

  - *deferred* (``attention_reads_cache=False``): the engine's attention consumes the
    window's fresh K/V directly (the reference engine), so the write itself is postponed
    and done once, with rejected lanes masked out (slot ``-1``, which every KV writer skips).
  - *undo* (``attention_reads_cache=True``): the attention kernel reads the window's K/V
    back from the paged cache (vLLM's backends), so the write must happen during the
    forward. The manager snapshots the slots first and, at commit, puts the old bytes back
    into the rejected slots. After the commit the cache is byte-identical to the deferred
    strategy's.

* ``IMMEDIATE``: writes go straight through (vLLM's behaviour); only the counters and the
  committed watermarks are produced. Accepted positions end up identical to ``STAGE``.
* ``OFF``: the manager is a pass-through.

Acceptance is given as a *device* mask; building it, masking the slots and counting are all
device ops. The counters reach the host through :class:`AsyncHostCopy` and are folded in by
:meth:`DeferredWriteManager.poll` once the copy has landed: nothing here calls ``.item()``,
``.cpu()`` or ``.tolist()``, and no Python loop runs per token.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from .hostcopy import AsyncHostCopy

logger = logging.getLogger(__name__)

__all__ = [
    "DeferredWriteManager",
    "KvWriter",
    "NworMode",
    "NworStats",
    "SlotSnapshotter",
    "acceptance_mask",
    "committed_watermarks",
    "num_valid_tokens",
]

#: Writes ``key``/``value`` ([tokens, heads, head_dim]) into ``kv_cache`` at ``slot_mapping``
#: (one slot per token, ``block * block_size + offset``). Must skip lanes whose slot is < 0,
#: as vLLM's ``reshape_and_cache`` kernels do: NWOR masks rejected lanes that way.
KvWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class SlotSnapshotter(Protocol):
    """Reads and restores the bytes of a set of slots of one layer's cache (undo strategy)."""

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """A copy of what ``kv_cache`` holds at ``slots`` (lanes with slot < 0: anything)."""
        ...

    def restore(self, kv_cache: torch.Tensor, slots: torch.Tensor, snapshot: torch.Tensor, keep: torch.Tensor) -> None:
        """Put ``snapshot`` back into every slot whose ``keep`` lane is False; leave the others."""
        ...


class NworMode(enum.Enum):
    """What the manager does with KV writes inside a verification window."""

    OFF = "off"
    STAGE = "stage"
    IMMEDIATE = "immediate"

    @classmethod
    def parse(cls, value: NworMode | str | None) -> NworMode:
        """Parse a config value (``None``: the default, ``stage``).

        The switch to disable NWOR is the connector's ``nwor_mode: "off"`` in
        ``kv_connector_extra_config``: configuration comes from there only, never from the
        engine process's environment.
        """
        if isinstance(value, NworMode):
            return value
        raw = (value if value is not None else "stage").strip().lower()
        aliases = {"disabled": "off", "none": "off", "false": "off", "0": "off", "": "off"}
        raw = aliases.get(raw, raw)
        try:
            return cls(raw)
        except ValueError:
            raise ValueError(f"unknown NWOR mode {value!r}: expected one of off, stage, immediate") from None


@dataclasses.dataclass(frozen=True)
class NworStats:
    """Counters since the manager was built (host values, folded in by ``poll``)."""

    mode: str
    windows: int = 0
    committed_tokens: int = 0
    rejected_tokens: int = 0
    fallbacks: int = 0
    pending_windows: int = 0  # windows whose counts are still on their way to the host


@dataclasses.dataclass
class _Staged:
    layer_name: str
    key: torch.Tensor | None
    value: torch.Tensor | None
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    writer: KvWriter | None
    snapshot: torch.Tensor | None
    snapshotter: SlotSnapshotter | None


# --- device-side helpers (no host sync, no per-token loop) ------------------------------------


def num_valid_tokens(
    num_scheduled: torch.Tensor, num_draft: torch.Tensor, valid_sampled_count: torch.Tensor
) -> torch.Tensor:
    """Per request, how many of its scheduled positions hold final (non-rejected) KV.

    ``num_scheduled`` counts every position fed to the model this step, ``num_draft`` those
    that were drafts, ``valid_sampled_count`` the rejection sampler's output length (accepted
    drafts + 1). Rows without drafts keep all their positions whatever was sampled (a partial
    prefill's sample is discarded, its KV is still final).
    """
    accepted = torch.clamp(valid_sampled_count.to(num_scheduled.dtype) - 1, min=0)
    accepted = torch.where(num_draft > 0, torch.minimum(accepted, num_draft.to(accepted.dtype)), 0)
    return num_scheduled - num_draft.to(num_scheduled.dtype) + accepted


def acceptance_mask(query_start_loc: torch.Tensor, num_valid: torch.Tensor, num_lanes: int) -> torch.Tensor:
    """Boolean mask over the step's token lanes: True where the lane's KV is final.

    ``query_start_loc`` is ``[num_reqs + 1]`` (cumulative scheduled tokens, vLLM's layout),
    ``num_valid`` ``[num_reqs]``. Lanes past the last request (CUDA-graph padding) are False.
    """
    device = query_start_loc.device
    lane = torch.arange(num_lanes, device=device, dtype=query_start_loc.dtype)
    num_reqs = num_valid.shape[0]
    if num_reqs == 0:
        return torch.zeros(num_lanes, dtype=torch.bool, device=device)
    req = torch.searchsorted(query_start_loc[1:].contiguous(), lane, right=True)
    in_batch = req < num_reqs
    req = torch.clamp(req, max=num_reqs - 1)
    offset = lane - query_start_loc[req]
    return in_batch & (offset < num_valid.to(offset.dtype)[req])


def committed_watermarks(
    positions: torch.Tensor, query_start_loc: torch.Tensor, num_valid: torch.Tensor
) -> torch.Tensor:
    """Per request, the number of tokens whose KV is now final: last valid position + 1.

    Computed from the device's ``positions`` (the source of truth under async scheduling,
    where the CPU's token counts are optimistic), so the result is exact without a sync.
    """
    last_lane = query_start_loc[:-1].to(torch.int64) + num_valid.to(torch.int64) - 1
    last_lane = torch.clamp(last_lane, min=0)
    return positions.to(torch.int64).gather(0, last_lane) + 1


def _masked_slots(slot_mapping: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``slot_mapping`` with rejected lanes set to -1 (skipped by every KV writer)."""
    n = slot_mapping.shape[0]
    if mask.shape[0] < n:
        mask = torch.nn.functional.pad(mask, (0, n - mask.shape[0]), value=False)
    return torch.where(mask[:n], slot_mapping, torch.full_like(slot_mapping, -1))


# --- the manager ----------------------------------------------------------------------------------


class DeferredWriteManager:
    """Stages KV writes during a verification window and commits only accepted positions.

    Lifecycle per step: ``begin_window(num_tokens)`` before the forward (only on steps with
    drafts), ``write(...)`` from every attention layer (pass-through outside a window),
    ``commit(mask)`` once the rejection sampler has produced the acceptance mask, or
    ``cancel(reason)`` if the step cannot be finished normally (everything staged is
    flushed, as if NWOR were off). ``poll()`` folds finished counter copies into ``stats``.

    Single-threaded: it lives on the engine's step thread.
    """

    def __init__(
        self,
        mode: NworMode | str | None = NworMode.STAGE,
        *,
        attention_reads_cache: bool = False,
        snapshotter: SlotSnapshotter | None = None,
    ) -> None:
        """``attention_reads_cache`` selects the undo strategy (then ``snapshotter`` is needed)."""
        self._mode = NworMode.parse(mode)
        self._undo = attention_reads_cache
        if self._undo and snapshotter is None and self._mode is NworMode.STAGE:
            raise ValueError("the undo strategy (attention_reads_cache=True) needs a SlotSnapshotter")
        self._snapshotter = snapshotter
        self._staged: list[_Staged] = []
        self._window_tokens: int | None = None
        self._pending: deque[tuple[AsyncHostCopy, int]] = deque()
        self._windows = 0
        self._committed = 0
        self._rejected = 0
        self._fallbacks = 0

    # -- state -----------------------------------------------------------------------------

    @property
    def mode(self) -> NworMode:
        return self._mode

    @property
    def window_active(self) -> bool:
        return self._window_tokens is not None

    @property
    def num_staged(self) -> int:
        """Writes staged in the open window (a test and debugging aid)."""
        return len(self._staged)

    def stats(self) -> NworStats:
        """The counters as of the last ``poll`` (does not poll)."""
        return NworStats(
            mode=self._mode.value,
            windows=self._windows,
            committed_tokens=self._committed,
            rejected_tokens=self._rejected,
            fallbacks=self._fallbacks,
            pending_windows=len(self._pending),
        )

    # -- window lifecycle --------------------------------------------------------------------

    def begin_window(self, num_tokens: int) -> bool:
        """Open a verification window over ``num_tokens`` token lanes. False when NWOR is off.

        A window left open by a step that never committed is flushed first (counted as a
        fallback): KV must never be silently dropped.
        """
        if self._mode is NworMode.OFF:
            return False
        if self._window_tokens is not None:
            self.cancel("a new window began before the previous one was committed")
        self._window_tokens = int(num_tokens)
        return True

    def write(
        self,
        layer_name: str,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        writer: KvWriter,
    ) -> None:
        """Write (or stage) one layer's KV for the current step's token lanes."""
        if self._window_tokens is None or self._mode is not NworMode.STAGE:
            writer(key, value, kv_cache, slot_mapping)
            return
        if self._undo:
            assert self._snapshotter is not None
            snapshot = self._snapshotter.gather(kv_cache, slot_mapping)
            writer(key, value, kv_cache, slot_mapping)
            self._staged.append(
                _Staged(layer_name, None, None, kv_cache, slot_mapping, None, snapshot, self._snapshotter)
            )
            return
        # Deferred: keep private copies, the producer may reuse its buffers for the next layer.
        self._staged.append(_Staged(layer_name, key.clone(), value.clone(), kv_cache, slot_mapping, writer, None, None))

    def commit(self, accept_mask: torch.Tensor) -> torch.Tensor | None:
        """Close the window: write accepted lanes only (or undo rejected ones). Never syncs.

        Returns the device count of accepted lanes (``None`` when no window was open), which
        the caller may fold into its own async copy.
        """
        if self._window_tokens is None:
            return None
        num_tokens = self._window_tokens
        mask = accept_mask[:num_tokens] if accept_mask.shape[0] > num_tokens else accept_mask
        if self._mode is NworMode.STAGE:
            for staged in self._staged:
                if staged.snapshot is not None and staged.snapshotter is not None:
                    n = staged.slot_mapping.shape[0]
                    keep = mask[:n]
                    if keep.shape[0] < n:
                        keep = torch.nn.functional.pad(keep, (0, n - keep.shape[0]), value=False)
                    staged.snapshotter.restore(staged.kv_cache, staged.slot_mapping, staged.snapshot, keep)
                else:
                    assert staged.writer is not None and staged.key is not None and staged.value is not None
                    staged.writer(staged.key, staged.value, staged.kv_cache, _masked_slots(staged.slot_mapping, mask))
        accepted = mask.sum(dtype=torch.int64).reshape(1)
        self._pending.append((AsyncHostCopy(accepted), int(mask.shape[0])))
        self._windows += 1
        self._staged.clear()
        self._window_tokens = None
        return accepted

    def cancel(self, reason: str) -> None:
        """Abandon the window: flush every staged write unmasked (the safe fallback)."""
        if self._window_tokens is None:
            return
        if self._mode is NworMode.STAGE:
            for staged in self._staged:
                if staged.writer is not None and staged.key is not None and staged.value is not None:
                    staged.writer(staged.key, staged.value, staged.kv_cache, staged.slot_mapping)
                # undo strategy: the writes already happened; dropping the snapshot keeps them.
        self._fallbacks += 1
        logger.warning("NWOR window abandoned (%s): %d staged writes flushed", reason, len(self._staged))
        self._staged.clear()
        self._window_tokens = None

    def poll(self) -> NworStats:
        """Fold the counter copies that have landed into the stats (never blocks)."""
        while self._pending and self._pending[0][0].ready():
            copy, lanes = self._pending.popleft()
            accepted = int(copy.numpy()[0])
            self._committed += accepted
            self._rejected += lanes - accepted
        return self.stats()
