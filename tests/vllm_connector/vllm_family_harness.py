"""vLLM 0.33's real Scheduler and KvdConnector for every model family: MLA, hybrid, drafters.

Like ``vllm_harness.VllmEngine``, but the engine's ``KVCacheConfig`` is built by vLLM's own
planner (``get_global_kv_cache_groups`` + ``get_kv_cache_configs``) from per-layer KV cache specs
the test writes (a tiny DeepSeek-V2-Lite-like MLA model, sliding window + full attention, a
Mamba2 hybrid, a target with a drafter), with the hybrid KV cache manager on, and an engine may
have several TP ranks (one worker connector and one KV allocation per rank).

The stand-in model runner writes deterministic values into every group: attention / MLA layers
get :func:`attention_values` at each scheduled token position through the group's block table;
state (Mamba) layers get :func:`state_bytes` of the tokens computed so far in the request's
state block. The state a pull loaded is snapshotted before the runner first advances it.

This box has no GPU: vLLM's platform says it cannot run the hybrid KV cache manager, so the
harness lets it (the scheduler and the KV cache manager are platform-independent Python).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.platforms import current_platform
from vllm.sampling_params import SamplingParams
from vllm.v1.core import kv_cache_planning
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache
from vllm_harness import VOCAB, SchedulerDriver, make_config

from kvd.demo.reference_engine import oracle_next_token


@contextlib.contextmanager
def hybrid_kv_cache_allowed() -> Iterator[None]:
    """Let vLLM's config keep the hybrid KV cache manager on this GPU-less box, for one config only.

    Scoped rather than patched at import: the other vLLM tests in the same process must see the
    platform as it is.
    """
    with mock.patch.object(type(current_platform), "support_hybrid_kv_cache", classmethod(lambda cls: True)):
        yield


def model_dir(root: Path, config: Mapping[str, Any]) -> Path:
    """A local HF config.json (ModelConfig wants one; no weights are loaded)."""
    root.mkdir(parents=True, exist_ok=True)
    base = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "torch_dtype": "float32",
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
    }
    base.update(config)
    (root / "config.json").write_text(json.dumps(base))
    return root


def attention_values(
    tokens: torch.Tensor, positions: torch.Tensor, layer: int, heads: int, content: int
) -> torch.Tensor:
    """``[tokens, heads, content]`` float32: a function of (token, position, layer, head, channel)."""
    t = tokens.view(-1, 1, 1).to(torch.int64)
    p = positions.view(-1, 1, 1).to(torch.int64)
    h = torch.arange(heads).view(1, -1, 1)
    c = torch.arange(content).view(1, 1, -1)
    return ((t * 7 + p * 13 + layer * 101 + h * 29 + c * 3) % 997).to(torch.float32) / 8.0


def state_bytes(tokens: list[int], layer: int, size: int) -> torch.Tensor:
    """``[size]`` int8: a Mamba state that depends on every token consumed so far and their count."""
    seed = (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens) * 7 + layer * 5 + 1) % 65521
    return ((torch.arange(size, dtype=torch.int64) * seed + seed) % 251).to(torch.uint8).view(torch.int8)


@contextlib.contextmanager
def tp_rank(rank: int, size: int) -> Iterator[None]:
    """The connector asks vLLM's parallel state for its rank; this process has no TP group."""
    with mock.patch("kvd_engine.connector._tp_rank_and_size", return_value=(rank, size)):
        yield


class FamilyEngine(SchedulerDriver):
    """One engine: real Scheduler (hybrid KV cache manager), real connector halves per TP rank."""

    def __init__(
        self,
        model: Path,
        engine_id: str,
        extra: dict[str, Any],
        specs: Mapping[str, KVCacheSpec],
        *,
        tp_size: int = 1,
        block_size: int = 16,
        num_blocks: int = 160,
    ) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        with hybrid_kv_cache_allowed():
            self.config = make_config(model, engine_id, extra, block_size=block_size, num_blocks=num_blocks)
        assert self.config.scheduler_config.disable_hybrid_kv_cache_manager is False, "HMA must stay on"
        self.config.cache_config.num_gpu_blocks_override = num_blocks
        self.config.cache_config.kv_cache_layout = "LBHNC"
        # Off, whatever vLLM's default for the model (it changed with the transformers release pip
        # picks): these requests carry no block hashes, so a prefix cache would hold nothing, and a
        # decode engine holds hard (soft holds are verified by block hashes: test_vllm_holds.py).
        # Mamba groups need it off anyway (vLLM: Mamba prefix caching needs "align").
        self.config.cache_config.enable_prefix_caching = False
        groups = kv_cache_planning.get_global_kv_cache_groups(self.config, [dict(specs)])
        self.kv_cache_config = kv_cache_planning.get_kv_cache_configs(self.config, [dict(specs)], [1 << 30], groups)[0]
        self.specs = dict(specs)
        self.layer_index = {name: i for i, name in enumerate(sorted(specs))}
        # The scheduler gets what vLLM's engine core gives it (one spec per group).
        scheduler_config = generate_scheduler_kv_cache_config([self.kv_cache_config])
        self.scheduler = Scheduler(
            self.config, scheduler_config, StructuredOutputManager(self.config), block_size=block_size
        )
        self.workers: list[Any] = []
        self.kv_caches: list[dict[str, torch.Tensor]] = []
        for rank in range(tp_size):
            with tp_rank(rank, tp_size):
                worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
            caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.kv_caches.append(caches)
        self.block_tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, Any] = {}
        self.results: list[KVConnectorOutput] = []
        self.loaded_state: dict[str, dict[str, torch.Tensor]] = {}  # request -> layer -> state bytes at load
        self._seen: set[str] = set()
        self._pending_sent: dict[str, int] = {}
        self._pending_recv: dict[str, int] = {}
        self._failed: set[str] = set()

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def group_of(self, layer: str) -> int:
        return next(i for i, g in enumerate(self.kv_cache_config.kv_cache_groups) if layer in g.layer_names)

    def add_request(
        self, request_id: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None
    ) -> Request:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        request = Request(request_id, list(prompt), params, None)
        self.scheduler.add_request(request)
        self.tokens[request_id] = list(request.prompt_token_ids or prompt)
        return request

    # -- the stand-in model runner ---------------------------------------------------------------

    def _execute(self, out: Any) -> ModelRunnerOutput:
        for req in out.scheduled_new_reqs:
            self.block_tables[req.req_id] = [list(ids) for ids in req.block_ids]
        cached = out.scheduled_cached_reqs
        for rid, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if rid in cached.resumed_req_ids:
                self.block_tables[rid] = [[] for _ in self.kv_cache_config.kv_cache_groups]
            if new_blocks is not None:
                for g, ids in enumerate(new_blocks):
                    self.block_tables[rid][g] += list(ids)
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            start = computed[rid]
            self._write(rid, start, n)
            req_ids.append(rid)
            tokens = self.tokens[rid]
            done_prompt = start + n >= len(tokens)
            sampled.append([oracle_next_token(tokens[start + n - 1], start + n, VOCAB)] if done_prompt else [])
        finished_sending: set[str] = set()
        finished_recving: set[str] = set()
        errors: set[int] = set()
        for worker in self.workers:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)
            results = worker.get_transfer_results(set(out.finished_req_ids))
            errors |= worker.get_block_ids_with_load_errors()
            worker.wait_for_save()
            worker.clear_connector_metadata()
            self._failed |= set(results.failed_recving or ())
            for rid in results.finished_sending or ():
                self._pending_sent[rid] = self._pending_sent.get(rid, 0) + 1
            for rid in results.finished_recving or ():
                self._pending_recv[rid] = self._pending_recv.get(rid, 0) + 1
        # As vLLM's KVOutputAggregator: a request is done once every rank said so.
        for pending, done in ((self._pending_sent, finished_sending), (self._pending_recv, finished_recving)):
            for rid, count in list(pending.items()):
                if count >= len(self.workers):
                    done.add(rid)
                    del pending[rid]
        failed = self._failed & finished_recving  # a failed load is also "received" by every rank
        self._failed -= failed
        kv_out = KVConnectorOutput(
            finished_sending=finished_sending or None,
            finished_recving=finished_recving or None,
            failed_recving=failed,
            invalid_block_ids=errors,
        )
        self.results.append(kv_out)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def _write(self, rid: str, start: int, n: int) -> None:
        tokens = torch.as_tensor(self.tokens[rid][start : start + n])
        positions = torch.arange(start, start + n)
        first = rid not in self._seen
        self._seen.add(rid)
        for name, spec in self.specs.items():
            table = self.block_tables[rid][self.group_of(name)]
            layer = self.layer_index[name]
            for caches in self.kv_caches:  # every TP rank (MLA and these tests' state: same bytes)
                view = caches[name]
                if isinstance(spec, MambaSpec):
                    block = state_block(table)
                    if first and start > 0:
                        self.loaded_state.setdefault(rid, {})[name] = view[block, 0, 0].clone()
                    view[block, 0, 0] = state_bytes(self.tokens[rid][: start + n], layer, view.shape[-1])
                else:
                    assert isinstance(spec, AttentionSpec)
                    ids = torch.as_tensor(table)
                    b, o = ids[positions // spec.block_size], positions % spec.block_size
                    view[b, :, o] = attention_values(tokens, positions, layer, view.shape[1], view.shape[-1])

    # -- checks ---------------------------------------------------------------------------------

    def values_at(self, rid: str, layer_name: str, positions: torch.Tensor, rank: int = 0) -> torch.Tensor:
        """``[positions, heads, content]`` of an attention layer through the request's block table."""
        spec = self.specs[layer_name]
        table = torch.as_tensor(self.block_tables[rid][self.group_of(layer_name)])
        b, o = table[positions // spec.block_size], positions % spec.block_size
        return self.kv_caches[rank][layer_name][b, :, o]

    def expected_at(self, rid: str, layer_name: str, positions: torch.Tensor, rank: int = 0) -> torch.Tensor:
        view = self.kv_caches[rank][layer_name]
        tokens = torch.as_tensor(self.tokens[rid])[positions]
        return attention_values(tokens, positions, self.layer_index[layer_name], view.shape[1], view.shape[-1])

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


def state_block(table: list[int]) -> int:
    """The request's running-state block: the last real block of its state group's table."""
    real = [b for b in table if b != 0]
    assert real, f"no state block in {table}"
    return real[-1]
