"""The ``kv_transfer_params`` dict kvd's connector puts in request outputs and reads back.

A router forwards it untouched from the engine that holds KV to the engine that needs it,
as with vLLM's NIXL connector. Its shape::

    {"do_remote_prefill": bool,   # the receiver must pull (P -> D): this was a remote prefill
     "do_remote_decode": bool,    # the receiver will also hand its KV on (D -> P, next turn)
     "kvd": {the kvd.v1.KvTransferParams fields, by name},
     "kvd_block_size": int}       # the holder's block size (to skip a local prefix hit)

A request sent to a prefill engine with just ``{"do_remote_decode": true}`` asks it to hold
its KV at the end; one sent to a decode engine with ``do_remote_prefill`` and ``kvd`` makes
it pull. Everything here is plain data: no grpc, no torch. The field list is the generated
record's (:class:`kvd_client.v1.schema.KvTransferParams`), never spelled out here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from kvd_client.records import as_fields, field_names, from_fields
from kvd_client.v1.schema import KvTransferParams

__all__ = ["KVD_KEY", "RemoteKv", "make_params", "remote_kv"]

KVD_KEY = "kvd"
BLOCK_SIZE_KEY = "kvd_block_size"

_FIELDS = field_names(KvTransferParams)

logger = logging.getLogger(__name__)

_U32 = (0, 2**32 - 1)
_U64 = (0, 2**64 - 1)
_I64 = (-(2**63), 2**63 - 1)
# The wire range of each integer field (common.proto): a value outside it could never be sent,
# and Python's int() takes any size, so each is checked here rather than fail later in a pull.
_RANGES: dict[str, tuple[int, int]] = {
    "tp_size": _U32,
    "block_ids": _U32,
    "num_tokens": _U64,
    "lease_expires_unix_ms": _I64,
    "registration_ids": _U64,
    "group_block_ids": _U32,
    "group_block_counts": _U32,
}
_MAX_BLOCK_SIZE = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class RemoteKv:
    """KV held by another engine, as named in kv_transfer_params."""

    fields: Mapping[str, Any]  # the KvTransferParams fields
    block_size: int  # 0: unknown

    @property
    def num_tokens(self) -> int:
        return int(self.fields.get("num_tokens", 0))

    @property
    def block_ids(self) -> list[int]:
        return [int(b) for b in self.fields.get("block_ids", ())]

    def skipping(self, num_tokens: int) -> RemoteKv | None:
        """The same KV without its first ``num_tokens`` tokens (already held locally).

        Only whole remote blocks can be skipped; None when ``num_tokens`` does not fall on a
        remote block boundary (the caller then recomputes rather than overwrite shared blocks).
        """
        if num_tokens == 0:
            return self
        if self.block_size <= 0 or num_tokens % self.block_size:
            return None
        skip = num_tokens // self.block_size
        fields = dict(self.fields)
        fields["block_ids"] = self.block_ids[skip:]
        fields["num_tokens"] = self.num_tokens - num_tokens
        return RemoteKv(fields, self.block_size)


def remote_kv(params: Mapping[str, Any] | None, *, warn: bool = False) -> RemoteKv | None:
    """The remote KV named by ``params``, or None when there is none (or it is malformed).

    Never raises: ``params`` come from a client over the API (JSON allows ``1e400``, i.e.
    infinity), and an exception here would escape into vLLM's scheduler and kill the engine
    core. Malformed params (a non-finite or out-of-range number, a wrong type) mean "no remote
    KV": the request is recomputed. ``warn`` logs why (once per request: the caller that first
    sees the request asks for it).
    """
    if not params:
        return None
    raw = params.get(KVD_KEY)
    if not isinstance(raw, Mapping):
        return None
    if not raw.get("daemon_address") or not raw.get("lease_id") or not raw.get("block_ids"):
        return None
    try:
        given = {name: raw[name] for name in _FIELDS if name in raw}
        typed = as_fields(from_fields(KvTransferParams, given))  # each value as its wire type
        block_size = int(params.get(BLOCK_SIZE_KEY, 0) or 0)
        problem = _range_problem(typed, block_size)
    except (TypeError, ValueError, OverflowError, AttributeError) as err:  # OverflowError: int(float("inf"))
        problem = f"{type(err).__name__}: {err}"
    if problem:
        if warn:
            logger.warning("ignoring malformed kvd kv_transfer_params (%s); the request is recomputed", problem)
        return None
    fields = {name: typed[name] for name in given}
    fields["num_tokens"] = typed["num_tokens"]
    if fields["num_tokens"] <= 0:
        return None
    return RemoteKv(fields, block_size)


def _range_problem(typed: Mapping[str, Any], block_size: int) -> str:
    """Why a converted value cannot be what it claims ("" when every value fits its wire type)."""
    if not 0 <= block_size <= _MAX_BLOCK_SIZE:
        return f"{BLOCK_SIZE_KEY} {block_size} out of range"
    for name, (low, high) in _RANGES.items():
        value = typed.get(name)
        values = value if isinstance(value, (list, tuple)) else () if value is None else (value,)
        for v in values:
            if not low <= v <= high:
                return f"{name} {v} out of range"
    return ""


def make_params(held: Mapping[str, Any], *, block_size: int, receiver_pulls_prefill: bool) -> dict[str, Any]:
    """kv_transfer_params for a hold: ``held`` are the daemon's KvTransferParams fields.

    ``receiver_pulls_prefill``: True on a prefill engine (the decode engine pulls), False on a
    decode engine (the next turn's prefill may pull).
    """
    return {
        "do_remote_prefill": receiver_pulls_prefill,
        "do_remote_decode": not receiver_pulls_prefill,
        KVD_KEY: {name: held[name] for name in _FIELDS if name in held},
        BLOCK_SIZE_KEY: block_size,
    }
