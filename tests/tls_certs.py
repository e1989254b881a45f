"""Test helper: a throwaway CA and the certificates it signs (server for 127.0.0.1, clients by name), as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class CA:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, cn: str, server: bool) -> tuple[bytes, bytes]:
        """-> (certificate PEM, private key PEM); a server's names 127.0.0.1 and localhost."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            usage = ExtendedKeyUsageOID.SERVER_AUTH
        else:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
            usage = ExtendedKeyUsageOID.CLIENT_AUTH
        cert = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).sign(self.key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def write_pki(folder: Path) -> dict[str, Path | bytes]:
    """ca.pem, server.pem / server.key, client certificates alice / bob from the CA and mallory from another CA."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, rogue = CA("dspark test CA"), CA("another CA")
    out: dict[str, Path | bytes] = {"ca": folder / "ca.pem"}
    out["ca"].write_bytes(ca.pem)
    cert, key = ca.issue("dspark test server", server=True)
    (folder / "server.pem").write_bytes(cert)
    (folder / "server.key").write_bytes(key)
    out["server_cert"], out["server_key"] = folder / "server.pem", folder / "server.key"
    for name, issuer in (("alice", ca), ("bob", ca), ("mallory", rogue)):
        cert, key = issuer.issue(name, server=False)
        (folder / f"{name}.pem").write_bytes(cert)
        (folder / f"{name}.key").write_bytes(key)
        out[name] = (key, cert)  # DSparkClient's private_key, certificate_chain
    return out
