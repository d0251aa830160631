"""kvd_engine: the part of kvd that runs inside an inference engine.

* :mod:`kvd_engine.nwor`: deferred KV writes for speculative decoding (NWOR);
* :mod:`kvd_engine.reference_engine`: a small paged-attention engine for end-to-end tests;
* :mod:`kvd_engine.scheduler` / :mod:`kvd_engine.worker`: the two halves of kvd's KV
  connector, free of vLLM types; :mod:`kvd_engine.connector` wraps them as vLLM's
  ``KvdConnector`` (importing it needs vLLM; importing this package never does);
* :mod:`kvd_engine.vllm_nwor`: NWOR installed into vLLM 0.33's runner.

This package configures no logging handlers: it lives in other people's processes.
"""

from .cache_layout import CacheGeometry, KvFormat, KvLayout, SlotIO
from .config import KvdConnectorConfig
from .engine_api import SchedulerConnector, StepView, TransferResults, WorkerConnector
from .hostcopy import AsyncHostCopy
from .local import kvd_connectors
from .nwor import DeferredWriteManager, NworMode, NworStats, acceptance_mask, committed_watermarks, num_valid_tokens
from .reference_engine import AcceptancePattern, ReferenceEngine, expected_kv, kv_values, oracle_next_token
from .scheduler import KvdScheduler
from .worker import KvdWorker

__all__ = [
    "AcceptancePattern",
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
    "ReferenceEngine",
    "SchedulerConnector",
    "SlotIO",
    "StepView",
    "TransferResults",
    "WorkerConnector",
    "acceptance_mask",
    "committed_watermarks",
    "expected_kv",
    "kvd_connectors",
    "kv_values",
    "num_valid_tokens",
    "oracle_next_token",
]
