"""kvd's connector halves wired for engines that are not vLLM (the reference engine, ``kvd demo``)."""

from __future__ import annotations

from collections.abc import Callable

from .cache_layout import CacheGeometry
from .config import KvdConnectorConfig
from .link_client import ClientFactory
from .scheduler import KvdScheduler
from .scheduler_link import SchedulerLink
from .worker import KvdWorker
from .worker_link import DaemonLink

__all__ = ["kvd_connectors"]


def kvd_connectors(
    config: KvdConnectorConfig,
    engine_id: str,
    *,
    block_size: int,
    speculative: bool = False,
    client_factory: ClientFactory | None = None,
) -> tuple[KvdScheduler, Callable[[int, CacheGeometry], KvdWorker]]:
    """A scheduler half and a per-rank worker factory talking to the daemon at ``config.kvd_socket``.

    Pass them to ``ReferenceEngine(scheduler_connector=..., worker_connector_factory=...)``.
    """
    hold = SchedulerLink(config.target, rpc_timeout_s=config.rpc_timeout_s, client_factory=client_factory)
    scheduler = KvdScheduler(config, engine_id, block_size=block_size, hold_client=hold, speculative=speculative)

    def worker(tp_rank: int, geometry: CacheGeometry) -> KvdWorker:
        link = DaemonLink(
            config.target,
            engine_id,
            tp_rank,
            rpc_timeout_s=config.rpc_timeout_s,
            reconnect_initial_s=config.reconnect_initial_s,
            reconnect_max_s=config.reconnect_max_s,
            client_factory=client_factory,
        )
        return KvdWorker(config, engine_id, tp_rank, geometry=geometry, link=link)

    return scheduler, worker
