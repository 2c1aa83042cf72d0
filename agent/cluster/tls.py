"""TLS between agents: a cluster CA that every holder of the cluster key derives alike, a
certificate per node issued from it, and the ssl contexts of the peer port.

The CA's private key is derived from the cluster key (HKDF-SHA256), so every member has the
same CA without a ceremony and a new cluster key makes a new CA: a device that no longer
holds the key can neither get a certificate nor accept connections from members. Each agent
makes a fresh key pair and certificate at start. Both ends require the other's certificate
(mutual TLS); who a peer is, is still proven by the signed requests and answers on top.
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.local.files import write_private

# Valid from long ago to far ahead: devices without a real-time clock boot in 1970 or 2000.
NOT_BEFORE = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
NOT_AFTER = datetime.datetime(2200, 1, 1, tzinfo=datetime.timezone.utc)
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ncm cluster CA")])
TLS_DIR = "tls"


def _ca_key(cluster_key: bytes) -> ec.EllipticCurvePrivateKey:
    seed = HKDF(algorithm=hashes.SHA256(), length=48, salt=b"ncm", info=b"cluster CA key").derive(cluster_key)
    return ec.derive_private_key(int.from_bytes(seed, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())


def _certificate(subject: x509.Name, public_key: ec.EllipticCurvePublicKey, ca_key: ec.EllipticCurvePrivateKey, *,
                 ca: bool) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(CA_NAME).public_key(public_key)
        .serial_number(1 if ca else x509.random_serial_number())
        .not_valid_before(NOT_BEFORE).not_valid_after(NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
    else:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of this agent's TLS identity (private: 0600 in a 0700 directory)."""

    ca: Path
    certificate: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        """The peer port's context: only clients with a certificate of this cluster's CA."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        context.load_cert_chain(str(self.certificate), str(self.key))
        context.verify_mode = ssl.CERT_REQUIRED
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        return context

    def client_context(self) -> ssl.SSLContext:
        """Calls to peers: the server must show a certificate of this cluster's CA. Peers are
        reached by whatever address works on the LAN, so no host name is checked; the node
        is identified by the signed answers."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(str(self.certificate), str(self.key))
        return context


def issue_node_files(cluster_key: bytes, node_id: str, directory: Path) -> TlsFiles:
    """Derive the cluster CA, make a key pair and certificate for ``node_id``, write them."""
    ca_key = _ca_key(cluster_key)
    ca_cert = _certificate(CA_NAME, ca_key.public_key(), ca_key, ca=True)
    node_key = ec.generate_private_key(ec.SECP256R1())
    node_cert = _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]), node_key.public_key(),
                             ca_key, ca=False)
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    files = TlsFiles(directory / "cluster-ca.pem", directory / "node.pem", directory / "node-key.pem")
    for path, data in ((files.ca, ca_cert.public_bytes(serialization.Encoding.PEM)),
                       (files.certificate, node_cert.public_bytes(serialization.Encoding.PEM)),
                       (files.key, node_key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))):
        write_private(path, data)
    return files
