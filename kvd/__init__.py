"""kvd: a per-node KV-cache transfer daemon for disaggregated LLM serving.

The daemon sits above the client library: it imports ``kvd_client`` (the generated wire code in
``kvd_client.v1``, the error hierarchy in ``kvd_client.errors``), never the reverse. Heavy
modules live in ``kvd.core``, ``kvd.server`` and ``kvd.layout`` and are imported only by the
daemon; ``kvd.core`` and ``kvd.layout`` load no grpc (a test checks ``sys.modules``).

``__version__`` is the client library's (``kvd_client.version``): one version for both
distributions, so a daemon and a client of the same release always agree on it.
"""

from kvd_client.version import __version__

__all__ = ["__version__"]
