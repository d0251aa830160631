"""The one version of kvd: the daemon (``kvd``) and the client library (``kvd-client``) share it.

Both pyprojects read ``__version__`` from this file (setuptools' dynamic version), ``kvd`` re-exports
it, the daemon reports it (``kvd --version``, ``GetStatus.version``, the ``kvd_build_info`` metric),
and every client channel sends it in its ``user-agent`` (:data:`USER_AGENT`), so a daemon can name
clients too old for it. A release changes this line and CHANGELOG.md, nothing else.

Imports nothing: ``import kvd_client.version`` must stay free of grpc (setuptools reads the file
statically, and the daemon's core may import it).
"""

__version__ = "0.2.0"

USER_AGENT_PRODUCT = "kvd-client"
"""The product token of the ``user-agent`` every kvd channel sends: ``kvd-client/<version>``
(grpc appends its own tokens after it)."""

USER_AGENT = f"{USER_AGENT_PRODUCT}/{__version__}"


def version_tuple(version: str) -> tuple[int, ...] | None:
    """The numeric release of ``version`` (``"0.2.0"`` -> ``(0, 2, 0)``, ``"1.3rc1"`` -> ``(1, 3)``);
    None when it does not start with a number.

    Enough to order kvd's own versions (plain ``MAJOR.MINOR.PATCH``) without the ``packaging``
    distribution, which the client library does not depend on. Pre-release suffixes are dropped,
    so ``0.3.0rc1`` compares equal to ``0.3.0``: a release candidate is not "too old" for its release.
    """
    parts: list[int] = []
    for piece in version.strip().split("."):
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts) if parts else None


def is_older(version: str, minimum: str) -> bool | None:
    """Whether ``version`` is older than ``minimum`` (missing parts count as 0: ``0.2`` == ``0.2.0``);
    None when either cannot be read as a version."""
    mine, floor = version_tuple(version), version_tuple(minimum)
    if mine is None or floor is None:
        return None
    width = max(len(mine), len(floor))
    return mine + (0,) * (width - len(mine)) < floor + (0,) * (width - len(floor))
