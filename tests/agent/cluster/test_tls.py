"""agent.cluster.tls: the cluster CA every holder of the cluster key derives alike, the node
certificates issued from it (files private to this user), and the contexts of the peer port,
checked by real TLS 1.3 handshakes on loopback."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import assume, given
from hypothesis import strategies as st

from agent.cluster.tls import _P256_ORDER, CA_NAME, NOT_AFTER, NOT_BEFORE, TlsFiles, _ca_key, issue_node_files

KEY = b"test-cluster-key-0123456789"
OTHER_KEY = b"another-cluster-key-9876543210"
TIMEOUT_S = 10.0


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def public_bytes(certificate: x509.Certificate) -> bytes:
    return certificate.public_key().public_bytes(serialization.Encoding.DER,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)


def common_name(peercert: dict) -> str:
    return dict(item for rdn in peercert["subject"] for item in rdn)["commonName"]


def test_the_files_are_private_to_this_user_in_a_private_directory(tmp_path: Path) -> None:
    directory = tmp_path / "state" / "tls"
    directory.mkdir(parents=True, mode=0o755)
    directory.chmod(0o755)
    files = issue_node_files(KEY, "node-1", directory)
    assert files == TlsFiles(directory / "cluster-ca.pem", directory / "node.pem", directory / "node-key.pem")
    assert directory.stat().st_mode & 0o777 == 0o700
    for path in (files.ca, files.certificate, files.key):
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert sorted(p.name for p in directory.iterdir()) == ["cluster-ca.pem", "node-key.pem", "node.pem"]
    # Issued again (every agent start): the files are replaced whole, still private, no leftovers.
    before = files.key.read_bytes()
    again = issue_node_files(KEY, "node-1", directory)
    assert again == files and files.key.read_bytes() != before
    assert files.key.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in directory.iterdir()) == ["cluster-ca.pem", "node-key.pem", "node.pem"]


def test_every_holder_of_the_key_derives_the_same_ca_and_a_new_key_a_new_one(tmp_path: Path) -> None:
    first = load(issue_node_files(KEY, "node-1", tmp_path / "a").ca)
    second = load(issue_node_files(KEY, "node-2", tmp_path / "b").ca)
    other = load(issue_node_files(OTHER_KEY, "node-1", tmp_path / "c").ca)
    assert public_bytes(first) == public_bytes(second)
    assert public_bytes(first) != public_bytes(other)
    for ca in (first, other):
        assert ca.subject == ca.issuer == CA_NAME
        assert ca.serial_number == 1
        ca.verify_directly_issued_by(ca)  # self-signed with the derived key
        constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
        assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
        usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
        assert usage.key_cert_sign and usage.crl_sign and not usage.digital_signature
    # A node of the old cluster is not issued by the new CA.
    node = load(tmp_path / "a" / "node.pem")
    with pytest.raises(InvalidSignature):
        node.verify_directly_issued_by(other)


@given(st.binary(min_size=1, max_size=256), st.binary(min_size=1, max_size=256))
def test_the_ca_key_is_a_valid_p256_scalar_fixed_by_the_cluster_key(key: bytes, other: bytes) -> None:
    assume(key != other)
    derived = _ca_key(key)
    assert isinstance(derived.curve, ec.SECP256R1)
    value = derived.private_numbers().private_value
    assert 1 <= value < _P256_ORDER
    assert _ca_key(key).private_numbers().private_value == value
    assert _ca_key(other).private_numbers().private_value != value


def test_a_node_certificate_names_the_node_and_serves_both_ends(tmp_path: Path) -> None:
    files = issue_node_files(KEY, "0123abcd0123abcd", tmp_path / "tls")
    ca, node = load(files.ca), load(files.certificate)
    node.verify_directly_issued_by(ca)
    assert node.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "0123abcd0123abcd"
    assert node.issuer == CA_NAME
    assert node.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    usages = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    authority = node.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert authority.key_identifier == ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
    # Valid on devices whose clock is far off (no real-time clock), for as long as a cluster lives.
    assert (node.not_valid_before_utc, node.not_valid_after_utc) == (NOT_BEFORE, NOT_AFTER)
    assert (ca.not_valid_before_utc, ca.not_valid_after_utc) == (NOT_BEFORE, NOT_AFTER)
    # The private key file holds the key of that certificate, unencrypted PKCS#8.
    text = files.key.read_bytes()
    assert text.startswith(b"-----BEGIN PRIVATE KEY-----")
    private = serialization.load_pem_private_key(text, password=None)
    assert private.public_key().public_numbers() == node.public_key().public_numbers()
    # Each issue makes a fresh key pair and serial number.
    again = load(issue_node_files(KEY, "0123abcd0123abcd", tmp_path / "tls2").certificate)
    assert public_bytes(again) != public_bytes(node) and again.serial_number != node.serial_number


def test_the_contexts_require_tls_1_3_and_a_certificate_but_no_host_name(tmp_path: Path) -> None:
    files = issue_node_files(KEY, "node-1", tmp_path / "tls")
    server, client = files.server_context(), files.client_context()
    for context in (server, client):
        assert context.verify_mode == ssl.CERT_REQUIRED
        assert context.minimum_version == ssl.TLSVersion.TLSv1_3
    assert client.check_hostname is False
    assert len(client.get_ca_certs()) == 1 and len(server.get_ca_certs()) == 1
    assert common_name({"subject": client.get_ca_certs()[0]["subject"]}) == "ncm cluster CA"


class PeerPort:
    """A TLS server on a loopback port with ``context``: it tells each client the name on the
    client's certificate and the TLS version, and records every connection it accepted."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self.context = context
        self.accepted: list[tuple[str, str]] = []

    async def __aenter__(self) -> PeerPort:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await asyncio.wait_for(self.server.wait_closed(), TIMEOUT_S)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        name = common_name(writer.get_extra_info("peercert"))
        version = writer.get_extra_info("ssl_object").version()
        self.accepted.append((name, version))
        writer.write(f"{name} {version}\n".encode())
        await writer.drain()
        writer.close()

    async def ask(self, context: ssl.SSLContext) -> tuple[bytes, dict]:
        """What the server tells a client with ``context``, and the server's certificate."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port, ssl=context),
                                                TIMEOUT_S)
        try:
            return await asyncio.wait_for(reader.read(), TIMEOUT_S), writer.get_extra_info("peercert")
        finally:
            writer.close()


def test_two_members_talk_tls_1_3_and_see_each_others_node(tmp_path: Path) -> None:
    server_files = issue_node_files(KEY, "server-node", tmp_path / "server")
    client_files = issue_node_files(KEY, "client-node", tmp_path / "client")

    async def scenario() -> None:
        async with PeerPort(server_files.server_context()) as port:
            said, server_certificate = await port.ask(client_files.client_context())
            assert said == b"client-node TLSv1.3\n"
            assert common_name(server_certificate) == "server-node"  # reached by IP, no host name checked
            assert port.accepted == [("client-node", "TLSv1.3")]

    asyncio.run(scenario())


def test_the_peer_port_refuses_clients_without_a_certificate_of_the_cluster(tmp_path: Path) -> None:
    server_files = issue_node_files(KEY, "server-node", tmp_path / "server")
    member = issue_node_files(KEY, "member", tmp_path / "member")
    stranger = issue_node_files(OTHER_KEY, "stranger", tmp_path / "stranger")

    def trusting_the_server(certificate_of: TlsFiles | None, tls_1_2: bool = False) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.load_verify_locations(str(server_files.ca))
        if certificate_of is not None:
            context.load_cert_chain(str(certificate_of.certificate), str(certificate_of.key))
        if tls_1_2:
            context.maximum_version = ssl.TLSVersion.TLSv1_2
        return context

    async def scenario() -> None:
        async with PeerPort(server_files.server_context()) as port:
            for context in (trusting_the_server(None), trusting_the_server(stranger),
                            trusting_the_server(member, tls_1_2=True)):
                try:
                    said, _ = await port.ask(context)
                except (ssl.SSLError, ConnectionError):
                    said = b""
                assert said == b""
            assert port.accepted == []
            # The same member's certificate over TLS 1.3 is let in.
            said, _ = await port.ask(trusting_the_server(member))
            assert said == b"member TLSv1.3\n" and port.accepted == [("member", "TLSv1.3")]

    asyncio.run(scenario())


def test_a_member_refuses_a_server_of_another_cluster(tmp_path: Path) -> None:
    stranger = issue_node_files(OTHER_KEY, "stranger", tmp_path / "stranger")
    member = issue_node_files(KEY, "member", tmp_path / "member")

    async def scenario() -> None:
        async with PeerPort(stranger.server_context()) as port:
            with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
                await port.ask(member.client_context())
            assert port.accepted == []

    asyncio.run(scenario())
