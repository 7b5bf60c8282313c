"""Real X.509 certificates for the TLS tests, made with `cryptography` (a dev dependency): a CA, role
certificates with SANs 127.0.0.1 and localhost (each serves and dials, so each is good for server and
client authentication), an expired one, one from an untrusted CA. EC P-256 keys: quick to make.

    pki = Pki(tmp_path)                 # a CA (ca.pem) in tmp_path
    role = pki.issue("buffer")          # Issued: .cert, .key (paths), signed by the CA, valid now
    expired = pki.issue("old", days=(-10, -1))
    rogue = Pki(tmp_path / "rogue").issue("buffer")   # a good-looking cert from another CA
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_SANS = ("127.0.0.1", "localhost")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Issued:
    """A certificate and its key as PEM files (`cert`, `key`), and the CA bundle that trusts it (`ca`)."""
    cert: Path
    key: Path
    ca: Path

    def tls(self, **overrides) -> dict:
        """The config's `tls` section for a process holding this certificate."""
        return {"enabled": True, "cert_file": str(self.cert), "key_file": str(self.key), "ca_file": str(self.ca),
                **overrides}


class Pki:
    """A CA whose certificate is `dir/ca.pem`; `issue` signs leaf certificates into `dir`."""

    def __init__(self, directory: Path, name: str = "kuberl test CA"):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = _key()
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(days=1))
                     .not_valid_after(now + datetime.timedelta(days=30))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca = self.dir / "ca.pem"
        self.ca.write_bytes(cert_pem(self.cert))

    def issue(self, name: str, sans: tuple[str, ...] = LOCAL_SANS, days: tuple[float, float] = (-1, 30),
              filename: str | None = None) -> Issued:
        """A leaf certificate for `name` valid from now + days[0] to now + days[1], written as
        `<filename or name>.pem` and `<filename or name>-key.pem`."""
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now + datetime.timedelta(days=days[0]))
                   .not_valid_after(now + datetime.timedelta(days=days[1]))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName([_san(s) for s in sans]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        stem = filename or name
        cert_path, key_path = self.dir / f"{stem}.pem", self.dir / f"{stem}-key.pem"
        cert_path.write_bytes(cert_pem(cert))
        key_path.write_bytes(key_pem(key))
        key_path.chmod(0o600)
        return Issued(cert_path, key_path, self.ca)
