"""Installing NWOR into vLLM 0.33's v1 model runner: guarded by version, reversible.

Three patches, all at class level, undone by :func:`uninstall`:

* each attention implementation's ``do_kv_cache_update`` (the one KV write every attention
  layer of vLLM 0.33 goes through, eager or via the ``unified_kv_cache_update`` custom op)
  is routed through the :class:`~kvd_engine.nwor.DeferredWriteManager`;
* ``GPUModelRunner.execute_model`` opens a verification window when the step carries drafts
  (and flushes it if the forward raises);
* ``GPUModelRunner._sample`` closes it right after the rejection sampler: the acceptance
  mask, the commit and the committed-token watermarks are computed on the device from the
  sampler's output, the runner's ``positions`` and ``query_start_loc`` (the GPU is the source
  of truth under async scheduling) and handed to the kvd worker. Nothing is read back to
  the host here; the worker copies the watermarks asynchronously.

vLLM's attention kernels read the window's K/V back from the paged cache, so the manager
uses the *undo* strategy: the window is written during the forward and rejected slots get
their previous bytes back at the commit, before the proposer runs and before the post-forward
signal leaves. Python patches do not run inside captured CUDA graphs: the install refuses
(NWOR stays off) unless the runner executes eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .nwor import DeferredWriteManager, NworMode, acceptance_mask, committed_watermarks, num_valid_tokens

logger = logging.getLogger(__name__)

__all__ = ["PackedCacheSlots", "SUPPORTED_VLLM", "install", "install_for_connector", "installed", "uninstall"]

SUPPORTED_VLLM = ("0.33.",)
PLACEHOLDER_TOKEN_ID = -1  # vllm.v1.sample.rejection_sampler.PLACEHOLDER_TOKEN_ID

WatermarkSink = Callable[[Sequence[str], torch.Tensor], None]


class PackedCacheSlots:
    """Snapshot/restore of token slots in vLLM >= 0.33 per-layer ``[blocks, heads, block_size, 2D]`` caches.

    Works on the logical view whatever the physical order; the block size is the cache's own
    (kernel blocks), matching the slot mapping the backend writes with. Lanes with slot < 0
    (padding) are pointed at slot 0 (vLLM's null block) and restored unchanged.
    """

    @staticmethod
    def _index(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block_size = kv_cache.shape[2]
        s = torch.clamp(slots.to(torch.int64), min=0)
        return s // block_size, s % block_size

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b, o = self._index(kv_cache, slots)
        return kv_cache[b, :, o]  # advanced indexing: a copy, [lanes, heads, 2D]

    def restore(self, kv_cache: torch.Tensor, slots: torch.Tensor, snapshot: torch.Tensor, keep: torch.Tensor) -> None:
        b, o = self._index(kv_cache, slots)
        keep = keep & (slots >= 0)  # padding lanes: put back what was there
        current = kv_cache[b, :, o]
        kv_cache[b, :, o] = torch.where(keep.view(-1, 1, 1), current, snapshot)


@dataclasses.dataclass
class _Installed:
    manager: DeferredWriteManager
    sink: WatermarkSink | None
    patches: list[tuple[Any, str, Any]]


_STATE: _Installed | None = None


def installed() -> DeferredWriteManager | None:
    """The manager currently installed, if any."""
    return _STATE.manager if _STATE is not None else None


def _vllm_version() -> str:
    import vllm  # noqa: PLC0415 - optional: this module imports without vLLM

    return str(getattr(vllm, "__version__", ""))


def _default_impl_classes() -> list[type]:
    """Attention implementations of vLLM 0.33 that write the cache in ``do_kv_cache_update``."""
    classes: list[type] = []
    for module, name in (
        ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl"),
        ("vllm.v1.attention.backends.flash_attn", "FlashAttentionImpl"),
        ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl"),
        ("vllm.v1.attention.backends.flashinfer", "FlashInferImpl"),
    ):
        try:
            mod = __import__(module, fromlist=[name])
        except Exception:  # a backend that cannot even import on this platform is simply not patched
            logger.debug("NWOR: attention backend %s not importable", module, exc_info=True)
            continue
        cls = getattr(mod, name, None)
        if cls is not None and "do_kv_cache_update" in vars(cls):
            classes.append(cls)
    return classes


def install(
    manager: DeferredWriteManager,
    watermark_sink: WatermarkSink | None = None,
    *,
    runner_cls: Any = None,
    impl_classes: Iterable[type] | None = None,
    eager: bool = True,
) -> bool:
    """Patch vLLM's runner and attention writes. False (and nothing patched) if unsupported."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("NWOR is already installed into vLLM's runner; uninstall() first")
    version = _vllm_version()
    if not version.startswith(SUPPORTED_VLLM):
        logger.warning("NWOR not installed: vLLM %s is not one of the supported versions %s", version, SUPPORTED_VLLM)
        return False
    if not eager and manager.mode is NworMode.STAGE:
        logger.warning("NWOR not installed: CUDA graphs replay KV writes without Python; run with enforce_eager")
        return False
    if runner_cls is None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: PLC0415 - optional, see above

        runner_cls = GPUModelRunner
    impls: list[Any] = list(impl_classes) if impl_classes is not None else _default_impl_classes()
    for needed in ("execute_model", "_sample"):
        if not callable(getattr(runner_cls, needed, None)):
            logger.warning("NWOR not installed: %s has no %s (vLLM changed)", runner_cls.__name__, needed)
            return False
    patches: list[tuple[Any, str, Any]] = []
    for cls in impls:
        patches.append((cls, "do_kv_cache_update", vars(cls)["do_kv_cache_update"]))
    patches.append((runner_cls, "execute_model", runner_cls.execute_model))
    patches.append((runner_cls, "_sample", runner_cls._sample))  # noqa: SLF001 - the hook vLLM 0.33 offers
    _STATE = _Installed(manager, watermark_sink, patches)
    for cls in impls:
        cls.do_kv_cache_update = _wrap_kv_update(vars(cls)["do_kv_cache_update"])
    runner_cls.execute_model = _wrap_execute_model(runner_cls.execute_model)
    runner_cls._sample = _wrap_sample(runner_cls._sample)  # noqa: SLF001 - see above
    logger.info(
        "NWOR (%s) installed into %s and %d attention backends", manager.mode.value, runner_cls.__name__, len(impls)
    )
    return True


def uninstall() -> None:
    """Put back every patched method. Idempotent."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None:
        return
    for owner, name, original in reversed(state.patches):
        setattr(owner, name, original)
    if state.manager.window_active:
        state.manager.cancel("NWOR uninstalled mid-window")


def install_for_connector(connector: Any) -> bool:
    """Install for a ``KvdConnector`` worker: undo-strategy manager, watermarks to its worker."""
    worker = connector.worker
    config = connector.config
    manager = DeferredWriteManager(config.nwor_mode, attention_reads_cache=True, snapshotter=PackedCacheSlots())
    if installed() is not None:
        uninstall()
    ok = install(manager, worker.set_step_watermarks, eager=_runs_eagerly(getattr(connector, "_vllm_config", None)))
    if ok:
        worker.bind_nwor(manager)
    return ok


def _runs_eagerly(vllm_config: Any) -> bool:
    """Whether the runner executes Python per step (no captured CUDA graphs around attention)."""
    if vllm_config is None:
        return True
    if getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False):
        return True
    if getattr(getattr(vllm_config, "device_config", None), "device_type", "") == "cpu":
        return True
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and str(getattr(mode, "name", mode)).upper() == "NONE"


# --- the wrappers -----------------------------------------------------------------------------------


def _wrap_kv_update(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def do_kv_cache_update(
        self: Any,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        state = _STATE
        if state is None or not state.manager.window_active:
            original(self, layer, key, value, kv_cache, slot_mapping)
            return
        writer = functools.partial(original, self, layer)
        state.manager.write(getattr(layer, "layer_name", ""), key, value, kv_cache, slot_mapping, writer)

    do_kv_cache_update.__kvd_nwor__ = True  # type: ignore[attr-defined]
    return do_kv_cache_update


def _wrap_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        state = _STATE
        if state is not None:
            drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
            if any(drafts.values()):
                state.manager.begin_window(int(scheduler_output.total_num_scheduled_tokens))
            self._kvd_nwor_tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0))
        try:
            return original(self, scheduler_output, *args, **kwargs)
        except BaseException:
            if state is not None and state.manager.window_active:
                state.manager.cancel("execute_model raised")
            raise

    return execute_model


def _wrap_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        output = original(self, logits, spec_decode_metadata)
        state = _STATE
        if state is not None:
            try:
                _after_sample(self, state, output, spec_decode_metadata)
            except Exception:  # NWOR must never take the engine down: flush and go on
                logger.exception("NWOR commit failed; flushing the window")
                if state.manager.window_active:
                    state.manager.cancel("commit failed")
        return output

    return _sample


def _after_sample(runner: Any, state: _Installed, output: Any, spec: Any) -> None:
    """Acceptance mask, NWOR commit and watermarks: device ops only."""
    num_reqs = int(runner.input_batch.num_reqs)
    num_tokens = int(getattr(runner, "_kvd_nwor_tokens", 0))
    if num_reqs == 0 or num_tokens == 0:
        return
    starts = runner.query_start_loc.gpu[: num_reqs + 1]
    num_scheduled = (starts[1:] - starts[:-1]).to(torch.int64)
    if spec is not None:
        cu = spec.cu_num_draft_tokens.to(torch.int64)
        num_draft = torch.diff(cu, prepend=torch.zeros(1, dtype=torch.int64, device=cu.device))
        valid = (output.sampled_token_ids != PLACEHOLDER_TOKEN_ID).sum(dim=1)
    else:
        num_draft = torch.zeros_like(num_scheduled)
        valid = torch.ones_like(num_scheduled)
    num_valid = num_valid_tokens(num_scheduled, num_draft, valid)
    if state.manager.window_active:
        state.manager.commit(acceptance_mask(starts, num_valid, num_tokens))
    if state.sink is not None:
        positions = runner.positions[:num_tokens]
        marks = committed_watermarks(positions, starts, num_valid)
        state.sink(list(runner.input_batch.req_ids[:num_reqs]), marks)
