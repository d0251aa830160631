"""Device -> host copies that never stall the engine's step.

The engine must learn small device-side results (acceptance counts, committed-token
watermarks) on the host, but a ``.item()`` / ``.cpu()`` / ``.tolist()`` on a CUDA tensor
blocks the CPU until the GPU has drained its queue: that is the "bubble" that async
scheduling removes. :class:`AsyncHostCopy` instead enqueues a ``non_blocking`` copy into
pinned host memory, records an event after it, and lets the caller *poll* the event. On
CPU tensors the copy is an ordinary memcpy and the result is ready at once.

Nothing in this module calls a synchronizing op except :meth:`AsyncHostCopy.wait`, which
exists for background threads (never the step path).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["AsyncHostCopy", "pinned_like"]


def pinned_like(src: torch.Tensor) -> torch.Tensor:
    """A host buffer shaped like ``src``, pinned when ``src`` lives on a CUDA device.

    Pinned memory is what makes a ``non_blocking`` device->host copy truly asynchronous;
    for a CPU source pinning buys nothing (and needs a CUDA context), so it is skipped.
    """
    pin = src.device.type == "cuda"
    return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)


class AsyncHostCopy:
    """One in-flight copy of a small device tensor to the host.

    ``ready()`` polls without blocking; ``numpy()`` returns the host values once ready
    (a view of the host buffer: copy it if you keep it). On a CUDA source the copy and the
    event are enqueued on the current stream, so the values are those the stream had
    computed when the copy was issued: record it *after* the kernels that produce them.
    A CPU source is referenced, not copied (no torch op on the step path at all): do not
    modify it afterwards; every caller in kvd_engine passes a freshly computed tensor.
    """

    __slots__ = ("_host", "_event", "_array")

    def __init__(self, src: torch.Tensor, host: torch.Tensor | None = None) -> None:
        """Start copying ``src`` into ``host`` (allocated when None; unused for CPU sources)."""
        self._event: torch.cuda.Event | None = None
        self._array: np.ndarray | None = None
        if src.device.type != "cuda":
            self._host = src
            return
        if host is None or host.shape != src.shape or host.dtype != src.dtype:
            host = pinned_like(src)
        self._host = host
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._event = event

    def ready(self) -> bool:
        """True once the copied values can be read (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block until the copy is done. For background threads only, never the step path."""
        if self._event is not None:
            self._event.synchronize()

    def numpy(self) -> np.ndarray:
        """The copied values (raises if the copy is still in flight)."""
        if self._array is None:
            if not self.ready():
                raise RuntimeError("AsyncHostCopy.numpy() called before the copy completed; poll ready() first")
            self._array = self._host.numpy()
        return self._array
