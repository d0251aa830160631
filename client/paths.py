"""Where an engine finds its node's daemon when nobody said: one answer for both sides.

`kvd serve` listens here by default and the engine connector connects here by default, so a
fresh machine where one user runs both needs no configuration. Deployments set both explicitly
(``/run/kvd/engine.sock`` in the systemd unit and the DaemonSet).
"""

from __future__ import annotations

import os


def default_engine_socket(uid: int | None = None) -> str:
    """``/tmp/kvd-<uid>/engine.sock``: a per-user directory, so two users never collide."""
    return f"/tmp/kvd-{os.getuid() if uid is None else uid}/engine.sock"
