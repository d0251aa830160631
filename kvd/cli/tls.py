"""The TLS flags of the operator commands that call daemons over TCP (`kvd status`, `kvd selftest`).

One definition, so that an operator who checks a production daemon that serves only mTLS passes
the same three flags to every command.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvd_client.channel import TlsConfig


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", default="", help="PEM CA of the daemon's certificate (TCP with TLS)")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", default="", help="PEM client key (mTLS)")


class TlsFlagsError(ValueError):
    """The TLS flags cannot be used: the message says which file or pair, for the operator."""


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The client TLS config the flags name; None for plaintext (no ``--tls-ca`` nor ``--tls-cert``).

    Raises :class:`TlsFlagsError` for a file it cannot read, or a certificate without its key or
    the reverse.
    """
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None

    def read(path: str) -> bytes | None:
        try:
            return Path(path).read_bytes() if path else None
        except OSError as exc:
            raise TlsFlagsError(f"cannot read {exc.filename}: {exc.strerror}") from exc

    try:
        return TlsConfig(
            root_certificates=read(args.tls_ca), certificate_chain=read(args.tls_cert), private_key=read(args.tls_key)
        )
    except TlsFlagsError:
        raise
    except ValueError as exc:
        raise TlsFlagsError(f"{exc} (--tls-cert and --tls-key go together)") from exc


def tls_flags(args: argparse.Namespace) -> list[str]:
    """The same files as `kvd serve` flags, for a daemon a command starts (it then speaks mTLS to its peers)."""
    flags: list[str] = []
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path:
            flags += [flag, str(Path(path).resolve())]
    return flags
