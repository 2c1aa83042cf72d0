"""What a public error may show: the real reason, without the addresses of nodes or what they answered."""

from agent.cluster.peer_client import PeerError
from agent.core.errors import ClusterError, without_addresses
from agent.orchestration.public_errors import public_reason
from agent.stage.weights import WeightTransferError


def test_public_reasons_carry_no_address_or_peer_answer():
    raw = '{"error": {"message": "no model gone", "type": "invalid_request_error"}}'
    for error in (PeerError("https://127.0.0.1:41234", f"HTTP 404: {raw}", 404),
                  WeightTransferError(f"no peer could provide model 'gone': https://10.0.0.7:40123: HTTP 404: {raw}")):
        reason = public_reason(error)
        assert "://" not in reason and "127.0.0.1" not in reason and "10.0.0.7" not in reason and "{" not in reason
        assert "log" in reason
    assert public_reason(ClusterError("node x at https://10.0.0.7:4000 left")) == "node x at (a node) left"
    assert public_reason(ClusterError("context 4096 is beyond what gamma was trained for (2048)")) == \
        "context 4096 is beyond what gamma was trained for (2048)"
    assert public_reason(RuntimeError("boom at 10.0.0.7:4000")) == \
        "internal error (RuntimeError; the orchestrator's log has the details)"


def test_connection_errors_lose_their_addresses_and_tls_context():
    text = ("node node-0 is unreachable: ClientConnectorError: Cannot connect to host 127.0.0.1:45391 "
            "ssl:<ssl.SSLContext object at 0x7f12> [Connect call failed ('127.0.0.1', 45391)] via [::1]:80")
    assert without_addresses(text) == ("node node-0 is unreachable: ClientConnectorError: Cannot connect to host "
                                       "(a node) [Connect call failed (a node)] via (a node)")
