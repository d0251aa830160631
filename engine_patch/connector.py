"""``KvdConnector``: kvd's KV connector for vLLM 0.33 (a thin facade, like vLLM's nixl package).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd_engine.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvd_socket": "/run/kvd/engine.sock", "pull_threshold_tokens": 256}}'

The logic lives in :class:`~kvd_engine.scheduler.KvdScheduler` (scheduler process) and
:class:`~kvd_engine.worker.KvdWorker` (one per TP rank); this module only adapts vLLM's
types to them. It imports vLLM, so import it only where vLLM is installed (``import
kvd_engine`` never imports it). ``kv_load_failure_policy: "recompute"`` is what makes a failed
pull a recompute rather than a failed request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvd_client.v1.schema import KvGroupKind

from .cache_layout import CacheGeometry
from .config import KvdConnectorConfig
from .engine_api import ScheduledRequest, StepView, TransferResults
from .groups import RankGroups, clip_group_blocks, resolve_groups
from .metadata import KvdConnectorMetadata
from .registration import geometry_from_vllm_views
from .scheduler import KvdScheduler
from .scheduler_link import SchedulerLink
from .vllm_groups import GroupOrder, groups_of_config
from .worker import KvdWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

__all__ = ["KvdConnector", "KvdVllmMetadata"]


@dataclasses.dataclass
class KvdVllmMetadata(KvdConnectorMetadata, KVConnectorMetadata):
    """:class:`KvdConnectorMetadata` with vLLM's marker base."""


class VllmBlockIdentity:
    """Soft holds' view of vLLM's block pool: a block's identity is its prefix-cache hash.

    Used on the scheduler's thread only (the connector's scheduler hooks), which owns the pool.
    A pin is a reference like a prefix hit's (``touch``); an unpin gives it back (``free_blocks``,
    tail first, as vLLM frees a request's blocks).
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def identities(self, block_ids: Sequence[int]) -> list[Hashable | None]:
        blocks = self.pool.blocks
        return [blocks[b].block_hash for b in block_ids]

    def pin(self, block_ids: Sequence[int]) -> None:
        self.pool.touch([self.pool.blocks[b] for b in block_ids])

    def unpin(self, block_ids: Sequence[int]) -> None:
        self.pool.free_blocks([self.pool.blocks[b] for b in reversed(block_ids)])


def _tp_rank_and_size() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (  # noqa: PLC0415 - only once vLLM runs
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError, ImportError):  # no TP group (tests, single process)
        return 0, 1


def step_view(scheduler_output: SchedulerOutput) -> StepView:
    """The parts of vLLM's SchedulerOutput the connector needs (no per-token loop)."""
    counts = scheduler_output.num_scheduled_tokens
    drafts = scheduler_output.scheduled_spec_decode_tokens or {}
    scheduled = [
        ScheduledRequest(r.req_id, r.num_computed_tokens, counts.get(r.req_id, 0), len(drafts.get(r.req_id, ())))
        for r in scheduler_output.scheduled_new_reqs
    ]
    cached = scheduler_output.scheduled_cached_reqs
    scheduled += [
        ScheduledRequest(rid, computed, counts.get(rid, 0), len(drafts.get(rid, ())))
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False)
    ]
    return StepView(scheduled=scheduled, finished_req_ids=frozenset(scheduler_output.finished_req_ids))


def _needs_groups(order: GroupOrder | None) -> bool:
    """True unless the engine is one plain (non-MLA) attention group: the single-layout path."""
    return order is not None and (len(order.groups) > 1 or order.groups[0].mla)


def _bounded_replay(config: KVCacheConfig | None) -> bool:
    """A sliding-window group under bounded replay (DeepSeek V4.1): vLLM does not replay it after
    a P/D load, so the decode engine must recompute the last prompt token (vLLM's NIXL connector
    backs off one token for it, as for Mamba state)."""
    if config is None:
        return False
    return any(getattr(g.kv_cache_spec, "bounded_replay", False) for g in config.kv_cache_groups)


class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by the node's kvd daemon (pull-based, both directions).

    ``SupportsHMA``: every KV cache group of a hybrid model (full attention, sliding window,
    Mamba / linear-attention state, a drafter's own group) is registered, held and pulled, so
    vLLM keeps its hybrid KV cache manager on.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.config = KvdConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        self.engine_id = str(transfer.engine_id)
        if self.config.recompute_failed_loads and transfer.kv_load_failure_policy != "recompute":
            # The scheduler reads the policy right after building its connector.
            logger.info("KvdConnector: kv_load_failure_policy set to 'recompute' (failed pulls are recomputed)")
            transfer.kv_load_failure_policy = "recompute"
        self.block_size = int(vllm_config.cache_config.block_size)
        self.speculative = vllm_config.speculative_config is not None
        model = vllm_config.model_config
        total_heads = model.get_total_num_kv_heads() if model is not None and not model.use_mla else 0
        # The engine's KV cache groups (None: vLLM gave no KVCacheConfig; one layout then).
        self.group_order: GroupOrder | None = (
            groups_of_config(kv_cache_config, total_heads) if kv_cache_config is not None else None
        )
        if self.group_order is None and model is not None and model.use_mla:
            raise ValueError("KvdConnector needs vLLM's KVCacheConfig to register MLA caches")
        multi = self.group_order is not None and len(self.group_order.tables) > 1
        self._scheduler: KvdScheduler | None = None
        self._worker: KvdWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            has_state = (
                multi
                and self.group_order is not None
                and any(g.kind is KvGroupKind.STATE for g in self.group_order.groups)
            )
            # A multi-module MTP drafter reads this many prompt tokens ahead (vLLM's own margin).
            lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
            hold = SchedulerLink(self.config.target, rpc_timeout_s=self.config.rpc_timeout_s)
            hold.start_stream(self.engine_id)
            self._scheduler = KvdScheduler(
                self.config,
                self.engine_id,
                block_size=self.block_size,
                hold_client=hold,
                speculative=self.speculative,
                num_groups=len(self.group_order.tables) if self.group_order is not None else 1,
                has_state=has_state,
                stream=hold,
                prefill_backoff=max(1 if has_state or _bounded_replay(kv_cache_config) else 0, lookahead - 1),
            )
            self._scheduler.metadata_cls = KvdVllmMetadata
        else:
            tp_rank, tp_size = _tp_rank_and_size()

            def resolve(kv_caches: Mapping[str, torch.Tensor]) -> CacheGeometry:
                return geometry_from_vllm_views(
                    kv_caches, tp_rank=tp_rank, tp_size=tp_size, total_num_kv_heads=total_heads
                )

            order = self.group_order

            def resolve_all(kv_caches: Mapping[str, torch.Tensor]) -> RankGroups:
                assert order is not None
                return resolve_groups(kv_caches, order.groups, tp_rank=tp_rank, tp_size=tp_size)

            self._worker = KvdWorker(
                self.config,
                self.engine_id,
                tp_rank,
                geometry=None if _needs_groups(order) else resolve,
                groups=resolve_all if _needs_groups(order) else None,
                # Block-level errors are ambiguous with several KV cache groups (vLLM raises).
                report_invalid_blocks=kv_cache_config is None or len(kv_cache_config.kv_cache_groups) <= 1,
            )
        logger.info("KvdConnector %s (%s) uses the kvd daemon at %s", self.engine_id, role.name, self.config.target)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: the daemon keeps the engine's KV cache mapped (CUDA IPC) and registered with NIXL
        for the engine's life, and serves peers' reads of it; sleep mode would release or remap
        that memory under the daemon. vLLM then refuses ``enable_sleep_mode`` with this
        connector when it builds its config, instead of letting a peer read freed memory."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Head-major blocks (LBHNC), as vLLM's NIXL connector: per-head runs for TP slicing."""
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None  # one latent "head": any order is the same
        return "LBHNC"

    @property
    def worker(self) -> KvdWorker | None:
        return self._worker

    # -- scheduler side ---------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is None:
            return
        pool = kv_cache_manager.block_pool
        if not pool.enable_caching:
            logger.info(
                "KvdConnector %s: prefix caching is off: decode holds hard (soft holds need block hashes)",
                self.engine_id,
            )
            return
        self._scheduler.bind_block_identity(VllmBlockIdentity(pool))

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def has_pending_push_work(self) -> bool:
        """True while a soft hold lives: vLLM keeps stepping, so its checks are answered."""
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every transfer group: a pull restores the request's own blocks of each group kvd
        serves (vLLM's default names only the prefix-cacheable ones, and the scheduler zeroes
        the new blocks of any group not named, concurrently with the pull writing them)."""
        config = self._kv_cache_config
        if config is None:  # no KVCacheConfig from vLLM: one group
            return (0,)
        return tuple(config.transfer_group_ids)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        block_ids: list[int] = []
        extra: tuple[tuple[int, ...], ...] = ()
        if num_external_tokens > 0:
            groups = blocks.get_unhashed_block_ids_all_groups()
            order = self.group_order
            if order is not None and len(order.tables) > 1:
                clipped = clip_group_blocks(order.table_groups, order.select(groups))
                block_ids, extra = list(clipped[0]), clipped[1:]
            else:
                block_ids = groups[0] if groups else []
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens, extra)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(step_view(scheduler_output))  # type: ignore[return-value]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(
            TransferResults(
                finished_sending=set(connector_output.finished_sending or ()),
                finished_recving=set(connector_output.finished_recving or ()),
                failed_recving=set(getattr(connector_output, "failed_recving", None) or ()),
            )
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hold every group's blocks (sliding window: its in-window tail; state: the running state)."""
        assert self._scheduler is not None
        order = self.group_order
        if order is None or len(order.tables) == 1:
            chosen = order.select(block_ids) if order is not None else block_ids
            return self._scheduler.request_finished(request, list(chosen[0]) if chosen else [])
        clipped = clip_group_blocks(order.table_groups, order.select(block_ids))
        return self._scheduler.request_finished(request, list(clipped[0]), clipped[1:])

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)
        if self.speculative:
            from .vllm_nwor import install_for_connector  # noqa: PLC0415 - patches vLLM: only when used

            install_for_connector(self)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind_connector_metadata(connector_metadata)  # type: ignore[arg-type]

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        res = self._worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=res.finished_sending,
            finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            if self.speculative:
                from .vllm_nwor import uninstall  # noqa: PLC0415 - see install_for_connector

                uninstall()
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
