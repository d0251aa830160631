"""A throwaway PKI for the security tests: one CA and a certificate per identity, with chosen SANs.

Made with ``cryptography`` (no openssl binary needed). Every certificate is valid for a day,
names localhost and 127.0.0.1 (so it can serve as well as authenticate) plus the identity's own
DNS / URI SANs (SPIFFE IDs are URI SANs).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Mapping, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_identities(directory: Path, identities: Mapping[str, Sequence[str]]) -> Path:
    """Write ca.pem and <name>.pem/<name>.key for each identity; its SANs are ``DNS:x`` / ``URI:x`` /
    ``IP:x`` strings (an IP SAN lets a daemon serve TLS on that address).

    A second, unrelated CA signs ``<name>`` when the name starts with ``foreign-`` (a certificate the
    daemon's CA never vouched for).
    """
    now = datetime.datetime.now(datetime.UTC)
    cas = {}
    for ca_name in ("ca", "foreign-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"kvd-test-{ca_name}"))
            .issuer_name(_name(f"kvd-test-{ca_name}"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        cas[ca_name] = (key, cert)
        (directory / f"{ca_name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    for name, sans in identities.items():
        ca_key, ca_cert = cas["foreign-ca" if name.startswith("foreign-") else "ca"]
        key = ec.generate_private_key(ec.SECP256R1())
        general: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        for san in sans:
            kind, _, value = san.partition(":")
            if kind == "URI":
                general.append(x509.UniformResourceIdentifier(value))
            elif kind == "IP":
                general.append(x509.IPAddress(ipaddress.ip_address(value)))
            else:
                general.append(x509.DNSName(value))
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(general), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return directory
