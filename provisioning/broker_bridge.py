"""A gateway's Mosquitto bridged to the cloud broker: the edge then talks to its local broker alone.

Why: with a broker per gateway, the edge otherwise holds two connections (cell side to the
gateway's broker, cloud side across the WAN to the cloud's). A Mosquitto bridge carries the
cloud side instead: the gateway's broker keeps one TLS connection to the cloud broker, queues
the cell's uplink while the WAN is down (``cleansession false``: the cloud broker keeps the
bridge's session and its QoS 1 queue), and the edge connects to ``localhost`` for both sides
(one connection, as on a shared broker).

Only the cell's own edge topics cross, each in one direction (``topic PATTERN in|out 1``):

====  =====================================  =======================================================
dir   topic                                  why
====  =====================================  =======================================================
in    ``ft/v1/+/manifest``                   signed manifests the edge relays to its devices
in    ``ft/v1/+/cloud/down/<cell>/#``        the coordinator's tasks for this cell
in    ``ft/v1/status/<cloud id>``            the coordinator's presence
out   ``ft/v1/+/edge/<cell>/up/#``           the cell's aggregates and presence summaries (``cell_presence``)
out   ``ft/v1/status/<cell>``                the edge's presence (its last will included)
====  =====================================  =======================================================

Devices' uplink, downlink and presence (``ft/v1/status/<cell>/<device>``) never leave the gateway; the
edge's summary of who is online does, so the coordinator's ``fedtier_devices_online`` and ``rollout status``
count a bridged cell's devices. On the cloud broker the bridge
authenticates with the gateway's own certificate (CN = cell), so the cloud's ACL gives it
exactly the rights of that edge's cloud side (``broker_config.gateway_cloud_rules``); on the
local broker the gateway account gets both sides (``broker_acl(cell_side=[c], cloud_side=[c])``).
Messages the bridge brings in are published by the broker itself and are not checked against the
local ACL; the cloud broker's ACL checks them at their source.

``try_private true`` tells a Mosquitto peer that this client is a bridge, so it does not send a
message back to the bridge that published it (no loops on the two ``status`` topics).
``notifications false``: Mosquitto's bridge state messages would go to ``$SYS`` topics that the
ACLs refuse.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from fedtier.errors import ConfigError
from fedtier.security import pki
from fedtier.transport import topics
from provisioning import ca
from provisioning.fleet import Fleet

P = topics.PREFIX


@dataclass(frozen=True)
class Bridge:
    """One bridge from a gateway's broker to the cloud broker.

    Attributes:
        cell: the cell whose gateway runs the local broker (= the bridge's username on the cloud).
        remote: the cloud broker's ``(host, port)``; ``host`` must be in its certificate.
        cafile: the fleet CA (verifies the cloud broker's certificate).
        certfile, keyfile: the gateway's client certificate and key.
        cloud_id: the coordinator's id (whose presence is bridged in).
    """

    cell: str
    remote: tuple[str, int]
    cafile: Path
    certfile: Path
    keyfile: Path
    cloud_id: str = "cloud"


def bridge_topics(cell: str, cloud_id: str) -> list[tuple[str, str]]:
    """``(direction, topic filter)`` of everything that crosses the bridge of ``cell``."""
    ca.check_node_name(cell, "cell")
    ca.check_node_name(cloud_id, "cloud id")
    return [("in", f"{P}/+/manifest"), ("in", f"{P}/+/cloud/down/{cell}/#"), ("in", f"{P}/status/{cloud_id}"),
            ("out", f"{P}/+/edge/{cell}/up/#"), ("out", f"{P}/status/{cell}")]


def mosquitto_bridge(bridge: Bridge) -> str:
    """The ``connection`` block of a gateway's ``mosquitto.conf`` (goes after the listener)."""
    host, port = bridge.remote
    if not 1 <= port <= 65535:
        raise ValueError(f"bridge port must be 1..65535, got {port}")
    lines = [
        "",
        f"# Bridge to the cloud broker: only cell {bridge.cell}'s edge topics cross (see",
        "# provisioning/broker_bridge.py); the edge connects to this broker alone.",
        f"connection fedtier-{bridge.cell}",
        f"address {host}:{port}",
        "bridge_protocol_version mqttv311",
        "try_private true",
        "notifications false",
        "# The cloud broker keeps the bridge's session and QoS 1 queue while the WAN is down.",
        "cleansession false",
        f"remote_clientid {bridge.cell}",
        f"local_clientid {bridge.cell}.bridge",
        "start_type automatic",
        "restart_timeout 1 10",
        f"bridge_cafile {bridge.cafile}",
        f"bridge_certfile {bridge.certfile}",
        f"bridge_keyfile {bridge.keyfile}",
        "bridge_insecure false",
        "bridge_tls_version tlsv1.2",
    ]
    lines += [f"topic {pattern} {direction} 1" for direction, pattern in bridge_topics(bridge.cell, bridge.cloud_id)]
    return "\n".join(lines) + "\n"


def check_bridge_identity(fleet: Fleet, cell: str, cert_path: Path, key_path: Path) -> str | None:
    """Why ``cert_path``/``key_path`` cannot carry the bridge of ``cell``, or ``None``.

    The bridge must present the gateway's client certificate (CN = cell, EKU clientAuth,
    issued by this fleet): the cloud broker's ACL grants that name the edge's cloud side.
    """
    try:
        cert = pki.load_certificate(cert_path)
        key = pki.load_private_key(key_path)
    except ConfigError as exc:
        return str(exc)
    if not ca.verify_issued_by(cert, fleet.ca_cert):
        return f"{cert_path} was not issued by the fleet CA {fleet.ca_cert_path}"
    if not pki.same_public_key(key.public_key(), cert.public_key()):  # type: ignore[arg-type]
        return f"{key_path} does not belong to {cert_path}"
    name = pki.cert_common_name(cert)
    if name != cell:
        return (f"{cert_path} is the certificate of {name!r}, not of the gateway of cell {cell!r}: the bridge "
                "authenticates as the gateway (use its bundle's cert.pem and key.pem)")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return f"{cert_path} has no extended key usage"
    if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
        return f"{cert_path} is not a client certificate (EKU clientAuth)"
    if cert.not_valid_after_utc - ca.utcnow() < dt.timedelta(days=1):
        return f"{cert_path} expires within a day"
    return None
