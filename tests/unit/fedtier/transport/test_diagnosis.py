"""What a failed connection, publish or subscription means, from the exceptions paho swallows."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import pytest

from fedtier.transport import diagnosis
from fedtier.transport.diagnosis import Throttle, connect_failure


def verify_error(message: str) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, f"[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: {message}")
    exc.verify_message = message
    exc.reason = "CERTIFICATE_VERIFY_FAILED"
    return exc


def alert(reason: str) -> ssl.SSLError:
    """An SSLError as the ssl module raises it for an alert (the reason only in the text, as on a read)."""
    return ssl.SSLError(1, f"[SSL: {reason}] {reason.lower().replace('_', ' ')} (_ssl.c:2580)")


CASES = [
    (ConnectionRefusedError(111, "Connection refused"), "refused", False, "start the broker"),
    (socket.gaierror(-2, "Name or service not known"), "dns", False, "DNS"),
    (TimeoutError("timed out"), "timeout", False, "firewall"),
    (None, "lost", False, "the broker restarted or stopped, or the network dropped"),
    (alert("SSLV3_ALERT_CERTIFICATE_EXPIRED"), "tls_expired", True, "fedtier provision rotate"),
    (alert("SSLV3_ALERT_CERTIFICATE_REVOKED"), "tls_revoked", True, "revoked"),
    (alert("TLSV1_ALERT_UNKNOWN_CA"), "tls_unknown_ca", True, "bundle of the broker's fleet"),
    (alert("TLSV13_ALERT_CERTIFICATE_REQUIRED"), "tls_no_certificate", True, "tls_cert"),
    (alert("WRONG_VERSION_NUMBER"), "tls_not_tls", False, "TLS listener"),
    (verify_error("self-signed certificate in certificate chain"), "tls_broker_untrusted", True, "tls_ca (/ca.pem)"),
    (verify_error("IP address mismatch, certificate is not valid for '10.0.0.9'."), "tls_name_mismatch", True,
     "--host 10.0.0.9"),
    (verify_error("certificate has expired"), "tls_broker_expired", True, "--kind broker"),
]


@pytest.mark.parametrize(("exc", "cause", "credential", "fix"), CASES, ids=[c[1] for c in CASES])
def test_each_failure_is_named_with_its_fix(exc: BaseException | None, cause: str, credential: bool,
                                            fix: str) -> None:
    d = connect_failure(exc, host="10.0.0.9", port=8883, tls=True, ca_file="/ca.pem")
    assert (d.cause, d.credential) == (cause, credential)
    assert fix in d.text() and "10.0.0.9" in d.text()


def test_a_lost_connection_names_the_likely_causes_and_suspects_no_second_client() -> None:
    # After a broker restart every node logs this: another client with its identity is only named when the
    # identity-conflict detection finds one (``diagnosis.identity_conflict``).
    lost = connect_failure(None, host="h", port=1, tls=True)
    assert lost.text().index("broker restarted") < lost.text().index("network")
    assert "another client" not in lost.text() and "identity" not in lost.text()
    assert "another client connected as 'd0'" in diagnosis.identity_conflict("d0", "x1").text()


def test_plain_tcp_to_a_tls_broker_suggests_tls() -> None:
    d = connect_failure(ConnectionResetError(104, "reset"), host="h", port=1, tls=False)
    assert d.cause == "reset" and "tls_ca" in d.fix
    # A live connection that drops with a reset: the broker went away (a restart), no handshake to blame.
    dropped = connect_failure(ConnectionResetError(104, "reset"), host="h", port=1, tls=False, was_connected=True)
    assert dropped.cause == "reset" and "tls" not in dropped.fix.lower() and "restarted" in dropped.fix


def test_authorization_refusals_are_credential_failures() -> None:
    assert diagnosis.connack_refused(135, "Not authorized", host="h", port=1, client_id="d0").credential
    assert not diagnosis.connack_refused(137, "Server busy", host="h", port=1, client_id="d0").credential
    refused = diagnosis.publish_refused("ft/v1/r/manifest", 135, "Not authorized", client_id="cloud")
    assert refused.credential and "ACL" in refused.fix and "ft/v1/r/manifest" in refused.message
    assert not diagnosis.publish_refused("t", 151, "Quota exceeded", client_id="cloud").credential
    assert diagnosis.subscribe_refused("ft/#", 135, "Not authorized", client_id="d0").credential


def test_the_throttle_reports_first_then_once_per_interval_with_what_it_left_out() -> None:
    now = [0.0]
    throttle = Throttle(60.0, clock=lambda: now[0])
    assert throttle("refused") == 0
    for t in (1.0, 2.0, 30.0):
        now[0] = t
        assert throttle("refused") is None
    assert throttle("dns") == 0  # another cause is reported at once
    now[0] = 61.0
    assert throttle("refused") == 3
    throttle.reset("refused")
    assert throttle("refused") == 0


def test_the_throttle_remembers_a_bounded_number_of_keys() -> None:
    now = [0.0]
    throttle = Throttle(60.0, clock=lambda: now[0], max_keys=3)
    for key in ("a", "b", "c"):
        assert throttle(key) == 0
    assert throttle("a") is None  # "a" is the newest now; "b" the oldest
    for i in range(10_000):
        throttle(f"spray-{i}")
    assert len(throttle._keys) == 3  # a key per message did not grow it
    assert throttle("a") == 0  # forgotten: reported again, as new


def test_the_throttle_lets_through_at_most_its_budget_per_interval_and_counts_the_rest() -> None:
    now = [0.0]
    throttle = Throttle(60.0, clock=lambda: now[0], budget=2)
    assert [(throttle(k), throttle.exhausted) for k in ("a", "b", "c", "d")] == [(0, False), (0, False), (None, True),
                                                                                (None, False)]
    assert throttle.over_budget == 2
    assert throttle("a") is None and throttle.over_budget == 2  # within its own interval: not the budget's doing
    assert not throttle.exhausted
    now[0] = 60.0
    assert throttle("c") == 1 and throttle.over_budget == 0  # the held-back one comes with its count
    assert throttle("a") == 1


def test_diagnosis_is_sans_io(tmp_path: Path) -> None:
    source = Path(diagnosis.__file__).read_text()
    assert "import paho" not in source and "open(" not in source
