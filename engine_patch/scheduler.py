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

**Soft holds** (decode, ``decode_hold_mode: "soft"``, the default) cost no KV capacity: the
blocks go back to vLLM's prefix cache at finish like any request's, and the scheduler remembers
each full block's identity (vLLM's block hash: its tokens and every token before). A later pull
is admitted only after the daemon asked, over the scheduler stream, and this scheduler found the
blocks still carrying those hashes and pinned them (a reference in vLLM's block pool) for the
read; after the read it checks again and unpins. Evicted or reused blocks answer no. The checks
run here, between steps, because vLLM's block pool belongs to the scheduler's thread; so that an
idle engine still answers, :meth:`KvdScheduler.has_pending_work` keeps vLLM stepping while a soft
hold lives (as vLLM's own connectors do while they hold or move KV). The book of soft holds and
pins is :class:`kvd_engine.soft_holds.SoftHolds`.

**Nobody will read → released at once.** A request that came with a remote lease and finishes
(aborted, rejected) or is recomputed without pulling tells its daemon, which tells the holder;
while it waits to pull, the scheduler renews that lease every ``lease_renew_interval_ms``
(heartbeats), so short TTLs survive long queues and a dead reader's leases lapse.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvd_client import errors

from .config import KvdConnectorConfig
from .engine_api import ConnectorRequest, StepView, TransferResults
from .metadata import KvdConnectorMetadata, PullSpec
from .params import make_params, remote_kv
from .soft_holds import BlockIdentity, SoftHolds

if TYPE_CHECKING:
    from kvd_client.v1 import engine_pb2

logger = logging.getLogger(__name__)

__all__ = ["BlockIdentity", "HoldClient", "KvdScheduler", "SchedulerStreamClient"]

PULL_DONE_KEY = "_kvd_pull_scheduled"
RELEASED_KEY = "_kvd_lease_released"
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
        soft: bool = False,
    ) -> dict[str, Any]: ...

    def close(self) -> None: ...


class SchedulerStreamClient(Protocol):
    """The scheduler stream (:class:`kvd_engine.scheduler_link.SchedulerLink`): never blocks."""

    def poll_commands(self) -> tuple[list[engine_pb2.SchedulerCommand], bool]: ...

    def send_check_result(self, seq: int, ok: bool, reason: str = "") -> bool: ...

    def renew(self, leases: Sequence[tuple[str, str]]) -> bool: ...

    def release(self, leases: Sequence[tuple[str, str]], reason: str) -> bool: ...


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
        stream: SchedulerStreamClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill_backoff: int | None = None,
    ) -> None:
        """``num_groups``: the engine's KV cache groups (hybrid models > 1); ``has_state``: one of
        them is Mamba / linear-attention state (the prefill engine leaves the last prompt token to
        the decode engine, which derives the final state from the pulled one, as vLLM's NIXL
        connector does); ``prefill_backoff``: the trailing prompt tokens a prefill for a remote
        decode leaves to the decode engine (default: 1 with state groups, else 0; a multi-module
        MTP drafter needs its lookahead window, see :meth:`_truncate_for_decode`)."""
        self.config = config
        self.num_groups = num_groups
        self.has_state = has_state
        self.prefill_backoff = (1 if has_state else 0) if prefill_backoff is None else max(0, prefill_backoff)
        self.engine_id = engine_id
        self.block_size = block_size
        self.speculative = speculative
        self._hold = hold_client
        self._matched: dict[str, tuple[int, int]] = {}  # request -> (local computed, external) at last query
        self._pending_pulls: dict[str, PullSpec] = {}
        self._pulling: set[str] = set()
        self._final_marks: dict[str, int] = {}
        self._new_holds: dict[str, int] = {}
        self._stream = stream
        self._clock = clock
        self._soft = SoftHolds()
        self._awaiting: dict[str, tuple[str, str]] = {}  # request -> (holder address, lease id) it will read
        self._reading: dict[str, tuple[str, str]] = {}  # the same, for requests whose pull was scheduled
        self._last_renew = 0.0
        self.holds = 0
        self.soft_holds = 0
        self.hold_failures = 0
        self.releases = 0

    def bind_block_identity(self, identity: BlockIdentity | None) -> None:
        """The engine's block pool. Soft holds need it: an engine without one (the reference
        engine; vLLM with prefix caching off) holds hard on decode."""
        self._soft.identity = identity

    def has_pending_work(self) -> bool:
        """Keep the engine stepping while a soft hold lives: its checks are answered between steps."""
        return self._soft.pending

    @property
    def pinned_blocks(self) -> int:
        """Blocks pinned for soft reads in flight (0 when no read is under way)."""
        return self._soft.pinned_blocks

    @property
    def evicted_checks(self) -> int:
        """Soft-hold checks that found the blocks evicted or reused."""
        return self._soft.evicted_checks

    # -- requests that will read a lease elsewhere ------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """A new request: renew the remote lease it carries while it waits to pull, and stop a
        prefill for a remote decode short of the tokens the decode engine recomputes
        (:meth:`_truncate_for_decode`)."""
        remote = remote_kv(request.kv_transfer_params, warn=True)
        if remote is not None:
            self._awaiting[request.request_id] = (
                str(remote.fields.get("daemon_address", "")),
                str(remote.fields.get("lease_id", "")),
            )
        self._truncate_for_decode(request)

    def _release(self, request: ConnectorRequest, reason: str) -> None:
        """Nobody here will read the request's remote lease: tell the holder now."""
        lease = self._awaiting.pop(request.request_id, None)
        params = request.kv_transfer_params
        if lease is None:
            remote = remote_kv(params)
            if remote is None:
                return
            lease = (str(remote.fields.get("daemon_address", "")), str(remote.fields.get("lease_id", "")))
        if params is not None:
            if params.get(RELEASED_KEY):
                return
            params[RELEASED_KEY] = True
        self.releases += 1
        logger.debug("request %s: releasing remote lease %s at %s (%s)", request.request_id, lease[1], lease[0], reason)
        if self._stream is not None:
            self._stream.release([lease], reason)

    def _heartbeat(self) -> None:
        interval_s = self.config.lease_renew_interval_ms / 1000.0
        if not self._awaiting or self._stream is None or interval_s <= 0:
            return
        now = self._clock()
        if now - self._last_renew < interval_s:
            return
        self._last_renew = now
        self._stream.renew(list(self._awaiting.values()))

    # -- soft holds: the daemon's checks ------------------------------------------------------------

    def serve(self) -> None:
        """Answer the daemon's soft-hold checks (engine thread, between steps; never blocks)."""
        if self._stream is None:
            return
        commands, lost = self._stream.poll_commands()
        if lost:
            self._soft.drop("the scheduler stream to the daemon was lost")
        for command in commands:
            result = self._soft.on_command(command)
            if result is not None:
                self._stream.send_check_result(*result)

    # -- admission ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens to pull beyond the local hit (0: recompute), and whether the load is async."""
        params = request.kv_transfer_params
        remote = remote_kv(params)
        if remote is None or params is None or params.get(PULL_DONE_KEY) or params.get(RELEASED_KEY):
            return 0, False
        count = min(remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        if count <= 0:
            self._release(request, "the local prefix cache holds every remote token")
            return 0, False
        reverse = bool(params.get("do_remote_decode")) and not params.get("do_remote_prefill")
        if reverse and count < self.config.pull_threshold_tokens:
            logger.debug(
                "request %s: %d remote tokens below the pull threshold %d, recomputing",
                request.request_id,
                count,
                self.config.pull_threshold_tokens,
            )
            self._release(request, "below the pull threshold: recomputed")
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
        lease = self._awaiting.pop(request.request_id, None)  # the pull's admitted read holds the lease now
        if lease is not None:
            self._reading[request.request_id] = lease
        local_blocks = math.ceil(num_external_tokens / self.block_size)
        if skipped is None or len(block_ids) < local_blocks:
            # vLLM now waits for this request's load: a pull that cannot start is reported
            # failed by the worker at once (recomputed), never left waiting for KV.
            refused = (
                f"its kv_transfer_params no longer name {num_external_tokens} tokens to pull"
                if skipped is None  # matched tokens were promised for these params: they no longer parse
                else f"{len(block_ids)} blocks allocated for {num_external_tokens} external tokens"
            )
            logger.error("request %s: not pulling: %s", request.request_id, refused)
            self._pending_pulls[request.request_id] = PullSpec(
                request_id=request.request_id,
                local_block_ids=tuple(int(b) for b in block_ids[:local_blocks]),
                remote={},
                refused=refused,
            )
            params[PULL_DONE_KEY] = True
            return
        fields = dict(skipped.fields)
        rbs = skipped.block_size or self.block_size
        fields["block_ids"] = skipped.block_ids[: math.ceil(num_external_tokens / rbs)]
        fields["num_tokens"] = num_external_tokens
        self._pending_pulls[request.request_id] = PullSpec(
            request_id=request.request_id,
            local_block_ids=tuple(int(b) for b in block_ids[:local_blocks]),
            remote=fields,
            deadline_ms=self.config.effective_pull_deadline_ms,  # explicit: the worker times it the same
            local_group_block_ids=tuple(tuple(int(b) for b in ids) for ids in group_block_ids),
        )
        params[PULL_DONE_KEY] = True  # one transfer per request, even if rescheduled

    def _truncate_for_decode(self, request: Any) -> None:
        """A prefill for a remote decode stops ``prefill_backoff`` prompt tokens short.

        With state groups (Mamba) the decode engine pulls the state after N-1 tokens and
        recomputes the last prompt token itself (vLLM always recomputes it), which yields the
        state after N tokens; a state after N tokens would be advanced twice by that token. A
        multi-module MTP drafter reads that many tokens ahead: a prefill that computed them would
        leave unverified drafts in the MTP layers' KV, which the decode engine never rebuilds. The
        decode engine pulls what the prefill held (``num_tokens``) and recomputes the rest.
        vLLM's NIXL connector does the same (``_truncate_request_for_prefill``), and likewise
        leaves alone a request that skips the prefix cache (it loads nothing remote).
        """
        backoff = self.prefill_backoff
        params = request.kv_transfer_params
        if (
            not backoff
            or not params
            or not params.get("do_remote_decode")
            or params.get("_kvd_truncated")
            or request.num_prompt_tokens <= backoff
        ):
            return
        skips_cache = getattr(request, "get_skip_reading_prefix_cache", None)
        if skips_cache is not None and skips_cache():
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-backoff:]
        elif getattr(request, "prompt_embeds", None) is not None:
            request.prompt_embeds = request.prompt_embeds[:-backoff]
        else:
            return
        del request._all_token_ids[-backoff:]  # noqa: SLF001 - vLLM keeps prompt + output here (as NIXL does)
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        params["_kvd_truncated"] = True

    # -- per step -----------------------------------------------------------------------------

    def build_connector_meta(self, step: StepView) -> KvdConnectorMetadata:
        self.serve()
        self._heartbeat()
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
            lease = self._reading.pop(rid, None)
            if rid in results.failed_recving and lease is not None and self._stream is not None:
                # The pull failed (the request recomputes): nobody here will read the lease again.
                self.releases += 1
                self._stream.release([lease], "the pull failed: recomputed")
        self.serve()

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
        if not params.get(PULL_DONE_KEY) and (rid in self._awaiting or remote_kv(params) is not None):
            # It carried a remote lease and never pulled (aborted, rejected, recomputed): nobody will read it.
            self._release(request, f"request finished ({_status_name(request)}) without pulling")
        self._awaiting.pop(rid, None)
        self._reading.pop(rid, None)
        num_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        if num_tokens > 0:
            self._final_marks[rid] = num_tokens
        is_prefill = bool(params.get("do_remote_decode"))
        is_decode = bool(params.get("do_remote_prefill"))
        if not (is_prefill or (is_decode and self.config.hold_on_decode)):
            return False, None
        if _status_name(request) not in _FINISHED_OK or num_tokens <= 0 or self._hold is None:
            return False, None
        # A soft hold is verified through one block table's hashes: hybrid models hold hard.
        soft = self.config.decode_hold_mode == "soft" and self._soft.identity is not None and self.num_groups == 1
        if is_decode and not is_prefill and soft:
            return self._hold_soft(request, block_ids, num_tokens)
        blocks = [int(b) for b in block_ids[: math.ceil(num_tokens / self.block_size)]]
        try:
            held = self._hold.hold_blocks(
                self.engine_id, rid, blocks, num_tokens, self.config.hold_ttl_ms, group_block_ids=group_block_ids
            )
        except errors.KvdError as err:
            self.hold_failures += 1
            logger.warning("request %s: kvd could not hold its KV (%s); the reader will recompute", rid, err)
            return False, None
        self.holds += 1
        # The expiry granted now; heartbeats may renew the lease later, so the worker waits for the
        # daemon's finished_sending rather than free the blocks at this time (KvdConnectorMetadata.held).
        self._new_holds[rid] = int(held.get("lease_expires_unix_ms", 0))
        return True, make_params(held, block_size=self.block_size, receiver_pulls_prefill=is_prefill)

    def _hold_soft(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hold the request's full blocks softly: vLLM frees them now (into its prefix cache).

        Only full blocks carry a hash, so the hold covers them; the last partial block (fewer
        than ``block_size`` tokens) is recomputed by the reader.
        """
        rid = request.request_id
        full = num_tokens // self.block_size
        if self._soft.identity is None or self._hold is None or full <= 0:
            return False, None
        blocks = tuple(int(b) for b in block_ids[:full])
        identities = self._soft.identities_of(blocks)
        if identities is None:
            logger.debug("request %s: its blocks are not in the prefix cache; no soft hold", rid)
            return False, None
        try:
            held = self._hold.hold_blocks(
                self.engine_id, rid, list(blocks), full * self.block_size, self.config.hold_ttl_ms, soft=True
            )
        except errors.KvdError as err:
            self.hold_failures += 1
            logger.info("request %s: kvd could not hold its KV softly (%s); the next turn recomputes", rid, err)
            return False, None
        self.soft_holds += 1
        self._soft.add(rid, str(held.get("lease_id", "")), blocks, identities)
        return False, make_params(held, block_size=self.block_size, receiver_pulls_prefill=False)

    def shutdown(self) -> None:
        if self._hold is not None:
            self._hold.close()
