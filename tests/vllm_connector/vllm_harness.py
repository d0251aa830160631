"""Drive vLLM 0.33's real Scheduler and KvdConnector (both roles) without a model.

``VllmEngine`` is one engine: vLLM's ``Scheduler`` (with the connector's scheduler half built
by vLLM from ``kv_connector_module_path``), the connector's worker half built by
``KVConnectorFactory``, a KV cache allocated by vLLM's own ``allocate_kv_cache`` (LBHNC), and
a stand-in model runner that calls the worker hooks in the v1 runner's order and writes the
reference engine's deterministic KV, so a pulled cache can be checked byte for byte.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvd.demo.reference_engine import kv_values, oracle_next_token

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 16
VOCAB = 1000
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def tiny_model_dir(root: Path) -> Path:
    """A local HF config.json of a tiny Llama (ModelConfig wants one; no weights are loaded)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": NUM_KV_HEADS,
                "num_hidden_layers": NUM_LAYERS,
                "vocab_size": VOCAB,
                "max_position_embeddings": 1024,
                "torch_dtype": "float32",
            }
        )
    )
    return root


def make_config(
    model_dir: Path,
    engine_id: str,
    extra: dict[str, Any],
    *,
    block_size: int,
    num_blocks: int,
    speculative_tokens: int = 0,
) -> VllmConfig:
    model = ModelConfig(
        model=str(model_dir), tokenizer=None, skip_tokenizer_init=True, dtype="float32", max_model_len=1024
    )
    transfer = KVTransferConfig(
        kv_connector="KvdConnector",
        kv_connector_module_path="kvd_engine.connector",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config=extra,
    )
    speculative = None
    if speculative_tokens:
        from vllm.config import ParallelConfig, SpeculativeConfig

        speculative = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=speculative_tokens,
            prompt_lookup_max=3,
            prompt_lookup_min=2,
            target_model_config=model,
            target_parallel_config=ParallelConfig(),
        )
    config = VllmConfig(
        model_config=model,
        speculative_config=speculative,
        cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024, is_encoder_decoder=False
        ),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


class SchedulerDriver:
    """One engine step: vLLM's Scheduler schedules, the stand-in runner (``_execute``) runs, the
    Scheduler takes the output. Shared by every harness engine."""

    scheduler: Scheduler
    tokens: dict[str, list[int]]
    outputs: dict[str, Any]

    def _execute(self, out: Any) -> ModelRunnerOutput:
        raise NotImplementedError

    def has_work(self) -> bool:
        """Requests to run, or finished ones whose ids the workers have not been told yet."""
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.finished_req_ids)

    def step(self) -> None:
        out = self.scheduler.schedule()
        runner_output = self._execute(out)
        for outputs in self.scheduler.update_from_output(out, runner_output).values():
            for o in outputs.outputs:
                self.tokens[o.request_id] += list(o.new_token_ids)
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o


class VllmEngine(SchedulerDriver):
    """One engine: real Scheduler + real connector halves + a stand-in model runner."""

    def __init__(
        self,
        model_dir: Path,
        engine_id: str,
        extra: dict[str, Any],
        *,
        block_size: int = 16,
        num_blocks: int = 64,
        speculative_tokens: int = 0,
    ) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.config = make_config(
            model_dir,
            engine_id,
            extra,
            block_size=block_size,
            num_blocks=num_blocks,
            speculative_tokens=speculative_tokens,
        )
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32
        )
        page = spec.page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * num_blocks * NUM_LAYERS,
                    layers=list(LAYERS),
                    layer_stride=page * num_blocks,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        self.scheduler = Scheduler(
            self.config, self.kv_cache_config, StructuredOutputManager(self.config), block_size=block_size
        )
        # As vLLM's EngineCore: requests hash their full blocks (the prefix cache's block identity).
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(block_size, hash_fn, self.config.num_hash_lookahead_tokens)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.worker.register_kv_caches(self.kv_caches)
        self.block_tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, Any] = {}
        self.results: list[KVConnectorOutput] = []

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add_request(
        self, request_id: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None
    ) -> Request:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        request = Request(request_id, list(prompt), params, None, block_hasher=self.block_hasher)
        self.tokens[request_id] = list(prompt)
        self.scheduler.add_request(request)
        return request

    # -- the stand-in model runner ---------------------------------------------------------------

    def _execute(self, out: Any) -> ModelRunnerOutput:
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        for req in out.scheduled_new_reqs:
            self.block_tables[req.req_id] = list(req.block_ids[0])
        cached = out.scheduled_cached_reqs
        for rid, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if rid in cached.resumed_req_ids:
                self.block_tables[rid] = []
            if new_blocks is not None:
                self.block_tables[rid] += list(new_blocks[0])
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            start = computed[rid]
            self._write_kv(rid, start, n)
            req_ids.append(rid)
            tokens = self.tokens[rid]
            done_prompt = start + n >= len(tokens)
            sampled.append([oracle_next_token(tokens[start + n - 1], start + n, VOCAB)] if done_prompt else [])
        worker.start_load_kv(None)
        results = worker.get_transfer_results(set(out.finished_req_ids))
        errors = worker.get_block_ids_with_load_errors()
        worker.wait_for_save()
        worker.clear_connector_metadata()
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=errors,
        )
        self.results.append(kv_out)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def _write_kv(self, request_id: str, start: int, n: int) -> None:
        tokens = torch.as_tensor(self.tokens[request_id][start : start + n])
        positions = torch.arange(start, start + n)
        table = torch.as_tensor(self.block_tables[request_id])
        b, o = table[positions // self.block_size], positions % self.block_size
        heads = torch.arange(NUM_KV_HEADS)
        for layer, name in enumerate(LAYERS):
            cache = self.kv_caches[name]  # [blocks, heads, block_size, 2 * head_dim]
            k = kv_values(tokens, positions, layer, heads, HEAD_DIM, 0)
            v = kv_values(tokens, positions, layer, heads, HEAD_DIM, 1)
            cache[b, :, o] = torch.cat((k, v), dim=-1)

    # -- checks ---------------------------------------------------------------------------------

    def kv_of(self, request_id: str, num_tokens: int) -> torch.Tensor:
        """``[layers, tokens, heads, 2 * head_dim]`` read through the request's block table."""
        table = torch.as_tensor(self.block_tables[request_id])
        positions = torch.arange(num_tokens)
        b, o = table[positions // self.block_size], positions % self.block_size
        return torch.stack([self.kv_caches[name][b, :, o] for name in LAYERS])

    def close(self) -> None:
        self.worker.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


def expected_kv(tokens: list[int]) -> torch.Tensor:
    t = torch.as_tensor(tokens)
    positions = torch.arange(len(tokens))
    heads = torch.arange(NUM_KV_HEADS)
    return torch.stack(
        [
            torch.cat(
                (
                    kv_values(t, positions, layer, heads, HEAD_DIM, 0),
                    kv_values(t, positions, layer, heads, HEAD_DIM, 1),
                ),
                dim=-1,
            )
            for layer in range(NUM_LAYERS)
        ]
    )


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)
