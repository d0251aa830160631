"""NWOR inside vLLM 0.33's runner: version guard, reversibility, commit after the rejection sampler.

vLLM's real ``GPUModelRunner._sample`` runs (with a stub rejection sampler); the forward is a
stub that writes through a patched attention ``do_kv_cache_update``, as vLLM's layers do.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_fakes import forbid_sync_ops
from vllm.v1.outputs import SamplerOutput
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from kvd_engine import vllm_nwor
from kvd_engine.nwor import DeferredWriteManager

pytestmark = pytest.mark.vllm

B, H, N, D = 8, 2, 4, 4  # blocks, heads, block size, head dim -> caches [B, H, N, 2D]


class StubImpl:
    """An attention implementation whose KV write skips slots < 0, like vLLM's kernels."""

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        n = slot_mapping.shape[0]
        keep = slot_mapping >= 0
        s = slot_mapping[keep]
        kv_cache[s // N, :, s % N] = torch.cat((key[:n][keep], value[:n][keep]), dim=-1)


class StubRunner(GPUModelRunner):
    """Just the state GPUModelRunner._sample and the NWOR hooks read."""

    def __init__(
        self,
        caches: list[torch.Tensor],
        sampled: torch.Tensor,
        starts: list[int],
        positions: list[int],
        req_ids: list[str],
    ) -> None:
        self.caches = caches
        self.impl = StubImpl()
        self.input_batch = SimpleNamespace(
            num_reqs=len(req_ids), req_ids=req_ids, sampling_metadata=None, update_async_output_token_ids=lambda: None
        )
        self.query_start_loc = SimpleNamespace(gpu=torch.tensor(starts, dtype=torch.int32))
        self.positions = torch.tensor(positions, dtype=torch.int64)
        self.use_async_scheduling = False
        self._draft_token_req_ids = None
        self.rejection_sampler = lambda spec, probs, logits, meta: SamplerOutput(
            sampled_token_ids=sampled, logprobs_tensors=None
        )
        self.sampler = lambda logits, sampling_metadata: SamplerOutput(
            sampled_token_ids=sampled[:, :1], logprobs_tensors=None
        )

    def _get_spec_decode_draft_probs(self, spec: Any) -> None:
        return None

    def execute_model(self, scheduler_output: Any) -> None:  # the forward: every layer writes its KV
        slots = scheduler_output.slots
        for layer, cache in enumerate(self.caches):
            key = torch.full((slots.shape[0], H, D), float(10 + layer))
            self.impl.do_kv_cache_update(SimpleNamespace(layer_name=f"l{layer}"), key, key + 0.5, cache, slots)


def _spec(num_draft: list[int]) -> SpecDecodeMetadata:
    cu = torch.tensor(num_draft).cumsum(0).to(torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=empty,
        num_draft_tokens=num_draft,
        cu_num_draft_tokens=cu,
        cu_num_sampled_tokens=cu + torch.arange(1, len(num_draft) + 1, dtype=torch.int32),
        target_logits_indices=empty,
        bonus_logits_indices=empty,
        logits_indices=empty,
    )


@pytest.fixture
def nwor() -> Any:
    yield
    vllm_nwor.uninstall()


def _setup(mode: str) -> tuple[StubRunner, DeferredWriteManager, list[Any], list[torch.Tensor]]:
    caches = [torch.full((B, H, N, 2 * D), 7.0) for _ in range(2)]
    # Request a: 1 base + 3 drafts at positions 10..13 (slots 9..12), accepts 1 draft.
    # Request b: a 5-token prefill chunk at positions 0..4 (slots 20..24).
    sampled = torch.tensor([[5, 6, -1, -1], [9, -1, -1, -1]])
    runner = StubRunner(caches, sampled, [0, 4, 9], [10, 11, 12, 13, 0, 1, 2, 3, 4], ["a", "b"])
    manager = DeferredWriteManager(mode, attention_reads_cache=True, snapshotter=vllm_nwor.PackedCacheSlots())
    sunk: list[Any] = []
    assert vllm_nwor.install(
        manager, lambda ids, marks: sunk.append((list(ids), marks)), runner_cls=StubRunner, impl_classes=[StubImpl]
    )
    return runner, manager, sunk, caches


def _rows(cache: torch.Tensor, slots: list[int]) -> torch.Tensor:
    s = torch.tensor(slots)
    return cache[s // N, :, s % N]


@pytest.mark.parametrize("mode", ["stage", "immediate"])
def test_rejected_slots_are_restored_before_the_proposer(nwor: Any, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    runner, manager, sunk, caches = _setup(mode)
    slots = torch.tensor([9, 10, 11, 12, 20, 21, 22, 23, 24])
    step = SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2, 3]}, total_num_scheduled_tokens=9, slots=slots)
    with forbid_sync_ops(monkeypatch) as called:
        runner.execute_model(step)
        assert manager.window_active
        runner._sample(None, _spec([3, 0]))
    assert called == [] and not manager.window_active
    for layer, cache in enumerate(caches):
        assert torch.all(_rows(cache, [9, 10, 20, 21, 22, 23, 24])[..., :D] == 10 + layer)
        rejected = _rows(cache, [11, 12])
        assert bool(torch.all(rejected == 7.0)) is (mode == "stage")  # stage: old bytes are back
    ((ids, marks),) = sunk
    assert ids == ["a", "b"] and marks.numpy().tolist() == [12, 5]
    stats = manager.poll()
    assert (stats.committed_tokens, stats.rejected_tokens) == (7, 2)


def test_steps_without_drafts_still_report_watermarks(nwor: Any) -> None:
    runner, manager, sunk, caches = _setup("stage")
    runner.execute_model(
        SimpleNamespace(scheduled_spec_decode_tokens={}, total_num_scheduled_tokens=9, slots=torch.arange(20, 29))
    )
    assert not manager.window_active
    runner._sample(None, None)
    assert sunk[0][1].numpy().tolist() == [14, 5]


def test_a_forward_that_raises_flushes_the_window(nwor: Any) -> None:
    runner, manager, _, _ = _setup("stage")

    def boom(*_: Any) -> None:
        raise RuntimeError("kernel failed")

    runner.impl.do_kv_cache_update = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        runner.execute_model(
            SimpleNamespace(
                scheduled_spec_decode_tokens={"a": [1]}, total_num_scheduled_tokens=9, slots=torch.arange(9)
            )
        )
    assert not manager.window_active and manager.stats().fallbacks == 1


def test_install_is_reversible_on_the_real_runner(nwor: Any) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    before = (GPUModelRunner.execute_model, GPUModelRunner._sample, CPUAttentionBackendImpl.do_kv_cache_update)
    assert vllm_nwor.install(
        DeferredWriteManager("stage", attention_reads_cache=True, snapshotter=vllm_nwor.PackedCacheSlots())
    )
    assert getattr(CPUAttentionBackendImpl.do_kv_cache_update, "__kvd_nwor__", False)
    assert GPUModelRunner._sample is not before[1]
    with pytest.raises(RuntimeError, match="already installed"):
        vllm_nwor.install(DeferredWriteManager("off"))
    vllm_nwor.uninstall()
    assert (GPUModelRunner.execute_model, GPUModelRunner._sample, CPUAttentionBackendImpl.do_kv_cache_update) == before
    vllm_nwor.uninstall()  # idempotent


def test_other_vllm_versions_are_left_alone(nwor: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    before = GPUModelRunner._sample
    assert not vllm_nwor.install(
        DeferredWriteManager("stage", attention_reads_cache=True, snapshotter=vllm_nwor.PackedCacheSlots())
    )
    assert GPUModelRunner._sample is before and vllm_nwor.installed() is None


def test_cuda_graphs_keep_stage_mode_out(nwor: Any) -> None:
    manager = DeferredWriteManager("stage", attention_reads_cache=True, snapshotter=vllm_nwor.PackedCacheSlots())
    assert not vllm_nwor.install(manager, eager=False)
