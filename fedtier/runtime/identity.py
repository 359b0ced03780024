"""A node checks its own certificate before it connects.

A broker that refuses a certificate says little (a TLS alert, or nothing at all with TLS
1.2), so every ``run`` command looks at its own ``tls_cert``/``tls_key`` first and says what
is wrong, in the node's log, before the first connection attempt:

* expired, not belonging to ``tls_key``, or issued for another node id: the broker will
  refuse it (or, for another id, its ACL will deny every topic) — the process ends with
  exit code 77 (``fedtier.runtime.mqtt_service.EXIT_UNAUTHORIZED``) at once;
* not valid yet: this node's clock is probably behind (an ERROR; the node still tries, the
  broker judges by its own clock);
* expiring within ``WARN_DAYS``: a WARNING with the command that renews it.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Sequence

from fedtier.errors import ConfigError
from fedtier.runtime.config import BrokerConfig

log = logging.getLogger("fedtier.runtime.identity")

WARN_DAYS = 30.0
"""Warn this many days before the certificate expires (``fedtier provision list --expiring-days``)."""


@dataclass(frozen=True)
class Finding:
    """One problem with the node's own certificate; ``fatal``: connecting cannot work."""

    level: int
    message: str
    fatal: bool = False


def check_certificate(broker: BrokerConfig, node_id: str, *, now: dt.datetime | None = None,
                      warn_days: float = WARN_DAYS) -> list[Finding]:
    """Problems with ``broker``'s client certificate for node ``node_id`` (empty: none, or no TLS)."""
    if broker.tls_cert is None or broker.tls_key is None:
        return []
    from fedtier.security import pki  # with TLS only: cryptography costs an agent 6 MB (docs/benchmarks.md)

    now = now or dt.datetime.now(dt.timezone.utc)
    try:
        cert = pki.load_certificate(broker.tls_cert)
        key = pki.load_private_key(broker.tls_key)
    except ConfigError as exc:
        return [Finding(logging.ERROR, str(exc), fatal=True)]
    found: list[Finding] = []
    if not pki.same_public_key(key.public_key(), cert.public_key()):  # type: ignore[arg-type]
        found.append(Finding(logging.ERROR, f"{broker.tls_key} is not the key of {broker.tls_cert}: use the key.pem "
                                            "that came with this certificate (the same bundle)", fatal=True))
    try:
        name = pki.cert_common_name(cert)
    except ValueError:
        name = ""
    if name != node_id:
        found.append(Finding(logging.ERROR, f"{broker.tls_cert} is the certificate of {name!r}, but this node is "
                                            f"{node_id!r}: the broker knows nodes by their certificate's name, so use "
                                            "this node's own bundle", fatal=True))
    if cert.not_valid_after_utc <= now:
        found.append(Finding(logging.ERROR, f"{broker.tls_cert} ({name}) expired on "
                                            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: the broker will refuse "
                                            f"it; issue a new one (fedtier provision rotate {name}) and install the "
                                            "new bundle (or, if it should still be valid, set this machine's clock)",
                             fatal=True))
    elif cert.not_valid_before_utc > now:
        found.append(Finding(logging.ERROR, f"{broker.tls_cert} ({name}) is valid only from "
                                            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: this machine's clock "
                                            "is probably behind (set it, e.g. with NTP)"))
    elif cert.not_valid_after_utc - now <= dt.timedelta(days=warn_days):
        days = (cert.not_valid_after_utc - now).total_seconds() / 86400
        found.append(Finding(logging.WARNING, f"{broker.tls_cert} ({name}) expires on "
                                              f"{cert.not_valid_after_utc:%Y-%m-%d} (in {days:.0f} days): renew it "
                                              f"before then (fedtier provision rotate {name})"))
    return found


def preflight(node_id: str, brokers: Sequence[BrokerConfig], *, now: dt.datetime | None = None) -> bool:
    """Log every problem of the node's certificates; ``False`` if the node cannot work with them."""
    ok = True
    seen: set[tuple[object, object]] = set()
    for broker in brokers:
        if (broker.tls_cert, broker.tls_key) in seen:
            continue
        seen.add((broker.tls_cert, broker.tls_key))
        for finding in check_certificate(broker, node_id, now=now):
            log.log(finding.level, "%s", finding.message)
            ok = ok and not finding.fatal
    return ok
