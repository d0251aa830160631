"""kvd_engine: the part of kvd that runs inside an inference engine.

* :mod:`kvd_engine.nwor`: deferred KV writes for speculative decoding (NWOR);
* :mod:`kvd_engine.scheduler` / :mod:`kvd_engine.worker`: the two halves of kvd's KV
  connector, free of vLLM types; :mod:`kvd_engine.connector` wraps them as vLLM's
  ``KvdConnector`` (importing it needs vLLM; importing this package never does);
* :mod:`kvd_engine.vllm_nwor`: NWOR installed into vLLM 0.33's runner.

The reference engine that ``kvd demo`` and the tests drive lives in :mod:`kvd.demo`, outside
this package. This package configures no logging handlers: it lives in other people's processes.
"""

from .cache_layout import CacheGeometry, KvFormat, KvLayout, SlotIO
from .config import KvdConnectorConfig
from .engine_api import SchedulerConnector, StepView, TransferResults, WorkerConnector
from .hostcopy import AsyncHostCopy
from .local import kvd_connectors
from .nwor import DeferredWriteManager, NworMode, NworStats, acceptance_mask, committed_watermarks, num_valid_tokens
from .scheduler import KvdScheduler
from .worker import KvdWorker

__all__ = [
    "AsyncHostCopy",
    "CacheGeometry",
    "DeferredWriteManager",
    "KvFormat",
    "KvLayout",
    "KvdConnectorConfig",
    "KvdScheduler",
    "KvdWorker",
    "NworMode",
    "NworStats",
    "SchedulerConnector",
    "SlotIO",
    "StepView",
    "TransferResults",
    "WorkerConnector",
    "acceptance_mask",
    "committed_watermarks",
    "kvd_connectors",
    "num_valid_tokens",
]
