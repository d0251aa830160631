"""kvd: a per-node KV-cache transfer daemon for disaggregated LLM serving.

This package must stay light to import: the client library (``kvd_client``) imports the generated
wire code in ``kvd.v1`` and must not pull in torch or nixl. Heavy modules live in ``kvd.core``,
``kvd.server`` and ``kvd.layout`` and are imported only by the daemon.
"""

__version__ = "0.1.0"
