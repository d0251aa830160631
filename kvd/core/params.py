"""The kv_transfer_params a router forwards from the holder's engine to the puller's.

``TransferParams`` is the wire's ``kvd.v1.KvTransferParams`` record, generated from the proto
(:mod:`kvd_client.v1.schema`): the core, the server edge and the engine patch share one field list.
"""

from __future__ import annotations

from kvd_client.v1.schema import KvTransferParams as TransferParams

__all__ = ["TransferParams"]
