"""Which clients are older than this daemon supports: each such version is logged, once.

Every kvd channel sends ``kvd-client/<version>`` at the head of its ``user-agent``
(``kvd_client.channel.USER_AGENT_OPTION``): the sync and asyncio clients, the engine connector
and peer daemons alike. This interceptor reads it from each call's metadata before authorization
(a refused too-old client is worth naming too) and never changes the call. A caller without the
token (grpcurl, a kubelet probe, a kvd-client older than 0.2.0, which sent none) is not judged.

Cost per call: one scan of a few metadata entries and a set lookup; a user-agent is parsed only
the first time it is seen. Both sets are bounded, so a caller inventing user-agents can neither
grow the daemon's memory nor flood its log.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
import grpc.aio

from kvd_client.version import USER_AGENT_PRODUCT, __version__, is_older

logger = logging.getLogger(__name__)

MIN_CLIENT_VERSION = "0.1.0"
"""The oldest kvd-client this daemon works with. Every wire change so far only added fields, so
every release is still served; raise this (and say so in CHANGELOG.md) when a change is not."""

MAX_AGENTS_REMEMBERED = 1024
"""User-agent strings judged already (skipped on later calls); beyond this, new ones are parsed per call."""

MAX_VERSIONS_LOGGED = 64
"""Distinct too-old versions logged; beyond this one last line says that no more are."""

_TOKEN = re.compile(rf"(?:^|\s){re.escape(USER_AGENT_PRODUCT)}/(\S+)")


def user_agent(metadata: Iterable[Any] | None) -> str | None:
    """The call's ``user-agent`` value (None without one)."""
    for item in metadata or ():
        if item[0] == "user-agent":
            value = item[1]
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None


def client_version(agent: str) -> str | None:
    """The version in a ``kvd-client/<version>`` token of ``agent``; None when it has none."""
    match = _TOKEN.search(agent)
    return match.group(1) if match else None


class ClientVersionLog:
    """Logs, once per version, a kvd-client older than ``minimum``."""

    def __init__(self, minimum: str = MIN_CLIENT_VERSION, own_version: str = __version__) -> None:
        self.minimum = minimum
        self.own_version = own_version
        self._agents: set[str] = set()
        self.logged: set[str] = set()
        """Versions logged as too old (tests read it)."""
        self._saturated = False

    def note(self, metadata: Iterable[Any] | None, method: str) -> None:
        agent = user_agent(metadata)
        if agent is None or agent in self._agents:
            return
        if len(self._agents) < MAX_AGENTS_REMEMBERED:
            self._agents.add(agent)
        version = client_version(agent)
        if version is None or version in self.logged or not is_older(version, self.minimum):
            return
        if len(self.logged) >= MAX_VERSIONS_LOGGED:
            if not self._saturated:
                self._saturated = True
                logger.warning("more kvd-client versions older than %s call; no more are logged", self.minimum)
            return
        self.logged.add(version)
        logger.warning(
            "a kvd-client %s called %s; this daemon (kvd %s) supports kvd-client %s or newer: upgrade that "
            "client (CHANGELOG.md says what changed). Logged once per client version.",
            version[:64],
            method[:128],
            self.own_version,
            self.minimum,
        )


class ClientVersionInterceptor(grpc.aio.ServerInterceptor):
    """Feeds every call's metadata to a :class:`ClientVersionLog`; the call itself goes on unchanged."""

    def __init__(self, log: ClientVersionLog | None = None) -> None:
        self.log = log if log is not None else ClientVersionLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        self.log.note(handler_call_details.invocation_metadata, handler_call_details.method)
        return await continuation(handler_call_details)
