"""The scheduler half of kvd's connector: which requests pull, which hold, what workers do.

Runs in the engine's scheduler process (vLLM's engine core). Roles, per request, from its
``kv_transfer_params`` (see :mod:`kvd_engine.params`):

* ``do_remote_prefill`` + ``kvd``: another engine prefilled it, this one pulls the prompt's
  KV (classic P -> D), whatever the size.
* ``do_remote_decode`` + ``kvd``: a prefill engine on the next turn of a conversation whose
  KV a decode engine holds: pull it back (D -> P) only when at least
  ``pull_threshold_tokens`` would be loaded, else recompute.
* at finish, ``do_remote_decode`` (a prefill engine) holds its blocks for the decode engine;
  ``do_remote_prefill`` (a decode engine) holds them for the next turn when ``hold_on_decode``.

Holding calls the daemon (``HoldBlocks``) and returns the lease in the request's output; a
daemon that is down means the blocks are freed at once and no params are returned (the
other side recomputes). The engine never fails a request because of kvd.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

from kvd_client import errors

from .config import KvdConnectorConfig
from .engine_api import ConnectorRequest, StepView, TransferResults
from .metadata import KvdConnectorMetadata, PullSpec
from .params import make_params, remote_kv

logger = logging.getLogger(__name__)

__all__ = ["HoldClient", "KvdScheduler"]

PULL_DONE_KEY = "_kvd_pull_scheduled"
_FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


class HoldClient(Protocol):
    def available(self) -> bool: ...

    def hold_blocks(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        ttl_ms: int = 0,
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _status_name(request: Any) -> str:
    status = getattr(request, "status", None)
    return getattr(status, "name", str(status))


class KvdScheduler:
    """Scheduler-side connector logic, free of vLLM types (the facade adapts them)."""

    #: What build_connector_meta makes (the vLLM facade uses a subclass with vLLM's marker base).
    metadata_cls: type[KvdConnectorMetadata] = KvdConnectorMetadata

    def __init__(
        self,
        config: KvdConnectorConfig,
        engine_id: str,
        *,
        block_size: int,
        hold_client: HoldClient | None,
        speculative: bool = False,
        num_groups: int = 1,
        has_state: bool = False,
    ) -> None:
        """``num_groups``: the engine's KV cache groups (hybrid models > 1); ``has_state``: one of
        them is Mamba / linear-attention state (the prefill engine leaves the last prompt token to
        the decode engine, which derives the final state from the pulled one, as vLLM's NIXL
        connector does)."""
        self.config = config
        self.num_groups = num_groups
        self.has_state = has_state
        self.engine_id = engine_id
        self.block_size = block_size
        self.speculative = speculative
        self._hold = hold_client
        self._matched: dict[str, tuple[int, int]] = {}  # request -> (local computed, external) at last query
        self._pending_pulls: dict[str, PullSpec] = {}
        self._pulling: set[str] = set()
        self._final_marks: dict[str, int] = {}
        self._new_holds: dict[str, int] = {}
        self.holds = 0
        self.hold_failures = 0

    # -- admission ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens to pull beyond the local hit (0: recompute), and whether the load is async."""
        params = request.kv_transfer_params
        remote = remote_kv(params)
        if remote is None or params is None or params.get(PULL_DONE_KEY):
            return 0, False
        count = min(remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        if count <= 0:
            return 0, False
        reverse = bool(params.get("do_remote_decode")) and not params.get("do_remote_prefill")
        if reverse and count < self.config.pull_threshold_tokens:
            logger.debug(
                "request %s: %d remote tokens below the pull threshold %d, recomputing",
                request.request_id,
                count,
                self.config.pull_threshold_tokens,
            )
            return 0, False
        if self.num_groups > 1 and (num_computed_tokens or count != remote.num_tokens):
            # A hybrid model's sliding-window and state groups hold what follows all held tokens:
            # a partial pull (local prefix hit, shorter prompt) could not use them.
            logger.info(
                "request %s: hybrid model with a local hit of %d tokens or a partial pull (%d of %d): recomputing",
                request.request_id,
                num_computed_tokens,
                count,
                remote.num_tokens,
            )
            return 0, False
        if remote.skipping(num_computed_tokens) is None:
            logger.info(
                "request %s: local hit of %d tokens is not on a remote block boundary (%d); recomputing",
                request.request_id,
                num_computed_tokens,
                remote.block_size,
            )
            return 0, False
        if self._hold is not None and not self._hold.available():
            return 0, False  # the local daemon is down: a pull would only fail
        self._matched[request.request_id] = (num_computed_tokens, count)
        return count, True

    def update_state_after_alloc(
        self,
        request: ConnectorRequest,
        block_ids: Sequence[int],
        num_external_tokens: int,
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """``block_ids``: the blocks allocated past the local hit (vLLM's unhashed blocks);
        ``group_block_ids``: a hybrid model's other groups' blocks (clipped per group)."""
        params = request.kv_transfer_params
        matched = self._matched.pop(request.request_id, None)
        if not params or num_external_tokens <= 0 or matched is None:
            return
        local_computed, _ = matched
        remote = remote_kv(params)
        skipped = remote.skipping(local_computed) if remote is not None else None
        if skipped is None:
            return
        local_blocks = math.ceil(num_external_tokens / self.block_size)
        if len(block_ids) < local_blocks:
            logger.error(
                "request %s: %d blocks allocated for %d external tokens; not pulling",
                request.request_id,
                len(block_ids),
                num_external_tokens,
            )
            return
        fields = dict(skipped.fields)
        rbs = skipped.block_size or self.block_size
        fields["block_ids"] = skipped.block_ids[: math.ceil(num_external_tokens / rbs)]
        fields["num_tokens"] = num_external_tokens
        self._pending_pulls[request.request_id] = PullSpec(
            request_id=request.request_id,
            local_block_ids=tuple(int(b) for b in block_ids[:local_blocks]),
            remote=fields,
            deadline_ms=self.config.pull_deadline_ms,
            local_group_block_ids=tuple(tuple(int(b) for b in ids) for ids in group_block_ids),
        )
        params[PULL_DONE_KEY] = True  # one transfer per request, even if rescheduled

    def on_new_request(self, request: Any) -> None:
        """A prefill engine of a model with state groups stops one prompt token short.

        The decode engine pulls the state after N-1 tokens and recomputes the last prompt
        token itself (vLLM always recomputes it), which yields the state after N tokens; a
        state after N tokens would be advanced twice by that token. vLLM's NIXL connector does
        the same (``_truncate_request_for_prefill``).
        """
        params = request.kv_transfer_params
        if (
            not self.has_state
            or not params
            or not params.get("do_remote_decode")
            or params.get("_kvd_truncated")
            or request.num_prompt_tokens <= 1
            or request.prompt_token_ids is None
        ):
            return
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]  # noqa: SLF001 - vLLM keeps prompt + output here (as NIXL does)
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvd_truncated"] = True

    # -- per step -----------------------------------------------------------------------------

    def build_connector_meta(self, step: StepView) -> KvdConnectorMetadata:
        meta = self.metadata_cls(
            pulls=list(self._pending_pulls.values()),
            final_watermarks=self._final_marks,
            finished_req_ids=frozenset(step.finished_req_ids),
            held=self._new_holds,
        )
        if not self.speculative:
            # Without drafts the host's counts are exact: every scheduled token is final.
            meta.host_commits = {s.request_id: s.num_computed_tokens + s.num_scheduled_tokens for s in step.scheduled}
        self._pulling.update(self._pending_pulls)
        self._pending_pulls = {}
        self._final_marks = {}
        self._new_holds = {}
        return meta

    def update_connector_output(self, results: TransferResults) -> None:
        for rid in results.finished_recving:
            self._pulling.discard(rid)

    # -- finish ---------------------------------------------------------------------------------

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int], group_block_ids: Sequence[Sequence[int]] = ()
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks (every KV cache group's) for a remote reader when this request's KV is
        wanted elsewhere."""
        rid = request.request_id
        self._matched.pop(rid, None)
        if self._pending_pulls.pop(rid, None) is not None:
            logger.debug("request %s finished before its pull started", rid)
        params = request.kv_transfer_params or {}
        num_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        if num_tokens > 0:
            self._final_marks[rid] = num_tokens
        is_prefill = bool(params.get("do_remote_decode"))
        is_decode = bool(params.get("do_remote_prefill"))
        if not (is_prefill or (is_decode and self.config.hold_on_decode)):
            return False, None
        if _status_name(request) not in _FINISHED_OK or num_tokens <= 0 or self._hold is None:
            return False, None
        blocks = [int(b) for b in block_ids[: math.ceil(num_tokens / self.block_size)]]
        try:
            groups = {"group_block_ids": group_block_ids} if group_block_ids else {}
            held = self._hold.hold_blocks(self.engine_id, rid, blocks, num_tokens, self.config.hold_ttl_ms, **groups)
        except errors.KvdError as err:
            self.hold_failures += 1
            logger.warning("request %s: kvd could not hold its KV (%s); the reader will recompute", rid, err)
            return False, None
        self.holds += 1
        self._new_holds[rid] = int(held.get("lease_expires_unix_ms", 0))
        return True, make_params(held, block_size=self.block_size, receiver_pulls_prefill=is_prefill)

    def shutdown(self) -> None:
        if self._hold is not None:
            self._hold.close()
