"""Why an MQTT connection, publish or subscription failed, in words an operator can act on.

paho reports a failed connection attempt without its cause (``on_connect_fail`` has no
argument) and a TLS refusal of our certificate as a lost connection ("Unspecified error"):
with TLS 1.3 the broker checks the client certificate after the handshake and its alert
arrives on the first read. ``fedtier.transport.mqtt`` keeps the exception behind each failure
and asks this module what it means. Pure functions, no I/O: each returns a ``Diagnosis``
with the cause (a stable key, also a metric label), what happened, the likely fix, and
whether retrying can help.

``credential`` failures will not heal by retrying: the broker refuses this node's
certificate (unknown CA, expired, revoked, none given), the node refuses the broker's
(another fleet's CA, a host name the certificate does not list), or the broker refuses
what the node may do (CONNACK or PUBACK "not authorized"). A node counts them and gives up
after ``[broker] max_auth_failures`` in a row (exit code 77, ``EXIT_UNAUTHORIZED`` in
``fedtier.runtime.mqtt_service``). Connection refused, an unknown host, a timeout or a lost
connection may heal (a broker restarting, a network coming back): the node retries forever.

``Throttle`` rate-limits the log lines: the first occurrence of a cause is logged at once,
repeats at most once per interval, with how many were left out in between (in bounded memory,
optionally within a budget of lines per interval; ``NodeBase.reject`` uses both).
"""

from __future__ import annotations

import errno
import math
import re
import socket
import ssl
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

AUTH_CONNACK_CODES = {134: "bad user name or password", 135: "not authorized", 138: "banned",
                      140: "bad authentication method", 4: "bad user name or password", 5: "not authorized"}
"""CONNACK reason codes (MQTT 5, and 4/5 of MQTT 3.1.1) that mean the broker refuses who we are."""
NOT_AUTHORIZED = 135


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """One failure, explained.

    Attributes:
        cause: a stable key (``refused``, ``dns``, ``tls_unknown_ca``, ``publish_refused``...).
        message: what happened, naming the broker (or topic).
        fix: the likely fix.
        credential: retrying will not help (counts towards ``max_auth_failures``).
    """

    cause: str
    message: str
    fix: str
    credential: bool = False

    def text(self) -> str:
        return f"{self.message}: {self.fix}"


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_SSL_REASON = re.compile(r"\[SSL: ([A-Z0-9_]+)\]")


def _ssl_reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason:
        return reason
    found = _SSL_REASON.search(str(exc))
    return found.group(1) if found else ""


def _broker_certificate(exc: ssl.SSLCertVerificationError | ssl.SSLError, where: str, host: str,
                        ca_file: str | None) -> Diagnosis:
    """The node refused the broker's certificate (the handshake's verification step)."""
    detail = str(getattr(exc, "verify_message", "") or exc)
    low = detail.lower()
    if "mismatch" in low or "hostname" in low:
        return Diagnosis("tls_name_mismatch",
                         f"the broker at {where} presented a certificate that is not valid for {host!r} ({detail})",
                         f"connect with a host name or address the broker's certificate lists, or reissue it with "
                         f"that name: fedtier provision broker NAME --host {host}", credential=True)
    if "expired" in low:
        return Diagnosis("tls_broker_expired", f"the broker at {where} presented an expired certificate",
                         "renew the broker's certificate (fedtier provision rotate BROKER --kind broker) and restart "
                         "Mosquitto", credential=True)
    if "not yet valid" in low:
        return Diagnosis("tls_clock", f"the broker's certificate at {where} is not valid yet by this node's clock",
                         "this node's clock is behind: set it (NTP)", credential=True)
    ca = f" ({ca_file})" if ca_file else ""
    return Diagnosis("tls_broker_untrusted",
                     f"the broker at {where} presented a certificate this node does not trust ({detail})",
                     f"the broker and this node belong to different fleets: tls_ca{ca} must be the CA that issued "
                     "the broker's certificate (the ca.pem of this node's bundle from the same fleet)", credential=True)


_OWN_CERTIFICATE = {
    "CERTIFICATE_EXPIRED": ("tls_expired", "the broker refused this node's certificate: it has expired",
                            "issue a new one (fedtier provision rotate NODE) and install the new bundle"),
    "CERTIFICATE_REVOKED": ("tls_revoked", "the broker refused this node's certificate: it has been revoked",
                            "this identity was revoked (fedtier provision revoke); issue a new certificate and bundle "
                            "if the node should rejoin"),
    "UNKNOWN_CA": ("tls_unknown_ca",
                   "the broker refused this node's certificate: it was not issued by the CA the broker trusts",
                   "use a bundle of the broker's fleet (its CA is the broker's cafile), or point the broker's "
                   "cafile at this fleet's ca.pem"),
    "CERTIFICATE_REQUIRED": ("tls_no_certificate",
                             "the broker requires a client certificate and this node sent none",
                             "set tls_cert and tls_key in the node's [broker] section (fedtier provision writes them "
                             "into every bundle)"),
    "BAD_CERTIFICATE": ("tls_bad_certificate", "the broker refused this node's certificate as bad",
                        "use the certificate of this node's bundle (a client certificate issued by the fleet CA)"),
    "UNSUPPORTED_CERTIFICATE": ("tls_bad_certificate",
                                "the broker refused this node's certificate: not a client certificate",
                                "use the node's own bundle (certificates with extended key usage clientAuth)"),
    "CERTIFICATE_UNKNOWN": ("tls_bad_certificate", "the broker could not verify this node's certificate",
                            "check that the broker's CRL (crlfile) is current (fedtier provision crl) and that the "
                            "certificate comes from the broker's fleet"),
}


def connect_failure(exc: BaseException | None, *, host: str, port: int, tls: bool,
                    ca_file: str | None = None, was_connected: bool = False) -> Diagnosis:
    """What a failed connection attempt (or a connection dropped while it was set up) means.

    Args:
        exc: the exception paho swallowed (from connecting, the TLS handshake, or the first
            read), or ``None`` when the broker simply closed the connection.
        host, port: where the node tried to connect.
        tls: whether the node connects with TLS.
        ca_file: the node's ``tls_ca`` (named in the advice).
        was_connected: the connection had been up (a live connection dropped), so a reset is the broker
            going away, not a handshake it refused.
    """
    where = _where(host, port)
    if exc is None:
        # Most likely first: a broker that restarted or stopped, a network that dropped. A second client
        # with this node's id is reported as an identity conflict when this node detects one, not guessed here.
        return Diagnosis("lost", f"connection to {where} lost: the broker restarted or stopped, or the network "
                                 "dropped",
                         "reconnecting; if it keeps happening while the broker runs, its log says why it closed the "
                         "connection")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return _broker_certificate(exc, where, host, ca_file)
    if isinstance(exc, ssl.CertificateError):  # pragma: no cover - older Pythons' host name check
        return _broker_certificate(ssl.SSLError(str(exc)), where, host, ca_file)
    if isinstance(exc, ssl.SSLError):
        reason = _ssl_reason(exc)
        for key, (cause, message, fix) in _OWN_CERTIFICATE.items():
            if reason.endswith(key):
                return Diagnosis(cause, f"{message} (broker {where})", fix, credential=True)
        if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
            return Diagnosis("tls_not_tls", f"{where} does not speak TLS",
                             "point [broker] port at the broker's TLS listener (8883 by default), or remove tls_* "
                             "for a plain listener")
        return Diagnosis("tls_error", f"TLS with {where} failed: {reason or exc}",
                         "check the broker's log for the other side of the handshake")
    if isinstance(exc, socket.gaierror):
        return Diagnosis("dns", f"cannot resolve the broker's host name {host!r} ({exc.strerror or exc})",
                         "check [broker] host for a typo, and this machine's DNS or /etc/hosts")
    if isinstance(exc, ConnectionRefusedError):
        return Diagnosis("refused", f"connection to {where} refused: nothing listens there",
                         "start the broker, or correct [broker] host/port (a firewall may also refuse it)")
    if isinstance(exc, ConnectionResetError):
        if was_connected:
            advice = "the broker restarted or stopped, or the network dropped: reconnecting (the broker's log says why)"
        elif not tls:
            advice = "the broker expects TLS? set tls_ca/tls_cert/tls_key in [broker]"
        else:
            advice = "the broker's log says why it closed the connection"
        return Diagnosis("reset", f"the broker at {where} reset the connection", advice)
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return Diagnosis("timeout", f"no answer from {where}",
                         "the host is down, or a firewall drops the packets; check [broker] host/port")
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL):
        return Diagnosis("unreachable", f"{where} is unreachable ({exc.strerror})",
                         "check the network route to the broker and [broker] host")
    return Diagnosis("connect_error", f"cannot connect to {where}: {type(exc).__name__}: {exc}",
                     "check [broker] host/port and the broker's log")


def connack_refused(code: int, reason: str, *, host: str, port: int, client_id: str) -> Diagnosis:
    """The broker answered CONNECT with a failure reason code."""
    where = _where(host, port)
    if code in AUTH_CONNACK_CODES:
        return Diagnosis("not_authorized",
                         f"the broker at {where} refused {client_id!r}: {reason} (reason code {code})",
                         "the broker does not accept this identity: check its certificate (fedtier provision list) "
                         "and the broker's ACL and authentication settings", credential=True)
    return Diagnosis("connack_refused", f"the broker at {where} refused the connection: {reason} (reason code {code})",
                     "the broker's log says why")


def publish_refused(topic: str, code: int, reason: str, *, client_id: str) -> Diagnosis:
    """The broker answered a PUBLISH with a failure (PUBACK reason code >= 128)."""
    if code == NOT_AUTHORIZED:
        return Diagnosis("publish_refused",
                         f"the broker refused {client_id!r} publishing on {topic}: not authorized (reason code 135)",
                         "the broker's ACL does not grant this node that topic: regenerate the broker configs with "
                         "fedtier provision fleet (one ACL for every node of a shared broker) and restart Mosquitto; "
                         "check that the certificate's name is the node id", credential=True)
    return Diagnosis("publish_failed", f"the broker did not accept a publish on {topic}: {reason} (reason code {code})",
                     "the broker's log says why")


def subscribe_refused(topic_filter: str, code: int, reason: str, *, client_id: str) -> Diagnosis:
    """The broker answered a SUBSCRIBE with a failure (SUBACK reason code >= 128)."""
    credential = code == NOT_AUTHORIZED
    what = f"the broker refused {client_id!r} a subscription to {topic_filter}: {reason} (reason code {code})"
    return Diagnosis("subscribe_refused", what,
                     "the broker's ACL does not let this node read that filter: regenerate the broker configs with "
                     "fedtier provision fleet and restart Mosquitto" if credential else "the broker's log says why",
                     credential=credential)


def identity_conflict(node: str, other: str) -> Diagnosis:
    """Another client announced itself online under this node's id while this node runs."""
    return Diagnosis("identity_conflict",
                     f"another client connected as {node!r} (instance {other}) while this one runs: two processes or "
                     "boards share this identity, and the broker disconnects one whenever the other connects",
                     "stop the other one; a copied bundle needs its own identity (fedtier provision device NAME, or "
                     "fedtier agent enroll on the second board)")


class Throttle:
    """First occurrence of each key at once, repeats at most once per ``interval_s``.

    Memory is bounded: it remembers the ``max_keys`` keys used last (an LRU), so a peer that
    invents a new key with every message (a new sender id, a new topic) cannot grow it; a key
    forgotten that way is reported again at once, as new. With a ``budget``, at most that many
    lines are let through per interval over all keys, so that many keys at once cannot flood
    the log either; what the budget holds back is counted for its key (reported with its next
    line) and in ``over_budget`` for the current interval.
    """

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic, *,
                 max_keys: int = 1024, budget: int | None = None) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.max_keys = max_keys
        self.budget = budget
        self._keys: OrderedDict[Hashable, list[float]] = OrderedDict()
        """key -> [when its last line was let through (-inf: never), repeats left out since]."""
        self._window = -math.inf
        self._lines = 0
        self.over_budget = 0
        """Occurrences the budget held back in the current interval."""
        self.exhausted = False
        """Whether the last call was the first one in its interval that the budget held back: a caller's cue to
        say that the log is being thinned."""

    def __call__(self, key: Hashable) -> int | None:
        """``None`` to stay quiet; else how many repeats were left out since the last line."""
        now = self.clock()
        self.exhausted = False
        if now - self._window >= self.interval_s:
            self._window, self._lines, self.over_budget = now, 0, 0
        entry = self._keys.get(key)
        if entry is None:
            entry = self._keys[key] = [-math.inf, 0]
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        if now - entry[0] < self.interval_s:
            entry[1] += 1
            return None
        if self.budget is not None and self._lines >= self.budget:
            entry[1] += 1
            self.over_budget += 1
            self.exhausted = self.over_budget == 1
            return None
        self._lines += 1
        skipped = int(entry[1])
        entry[0], entry[1] = now, 0
        return skipped

    def reset(self, key: Hashable) -> None:
        """Forget ``key`` (it healed): its next occurrence is logged at once."""
        self._keys.pop(key, None)
