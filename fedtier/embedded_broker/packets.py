"""The MQTT data model: packet dataclasses, properties, reason codes and protocol errors.

Plain immutable data, shared by the wire codec (:mod:`.codec`), the broker core and test
clients. Field names follow the MQTT 5.0 specification; a 3.1.1 packet is the same object
with the 5.0-only fields left at their defaults.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias

from fedtier.errors import RemoteProtocolError

MQTT_311 = 4
"""Protocol level of MQTT 3.1.1."""
MQTT_5 = 5
"""Protocol level of MQTT 5.0."""
SUPPORTED_PROTOCOL_LEVELS = (MQTT_311, MQTT_5)

MAX_REMAINING_LENGTH = 268_435_455
"""Largest value a four-byte Variable Byte Integer can hold (§1.5.5)."""
SESSION_EXPIRY_NEVER = 0xFFFF_FFFF
"""Session Expiry Interval meaning "the session does not expire" (§3.1.2.11.2)."""


class PacketType(enum.IntEnum):
    """MQTT control packet types (§2.1.2)."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


class ReasonCode(enum.IntEnum):
    """The MQTT 5 reason codes this broker sends or interprets (§2.4)."""

    SUCCESS = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    NOT_AUTHORIZED = 0x87
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    QUOTA_EXCEEDED = 0x97
    QOS_NOT_SUPPORTED = 0x9B
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E


class ConnectReturnCode(enum.IntEnum):
    """MQTT 3.1.1 CONNACK return codes (§3.2.2.3 of 3.1.1)."""

    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USERNAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


SUBACK_FAILURE_V311 = 0x80
"""The single failure return code of a 3.1.1 SUBACK."""


# --- errors ----------------------------------------------------------------------------------


class MqttProtocolError(RemoteProtocolError):
    """A peer broke the MQTT protocol. ``reason_code`` is what a v5 DISCONNECT should say."""

    reason = "mqtt_protocol_error"
    default_reason_code: int = ReasonCode.PROTOCOL_ERROR

    def __init__(self, message: str, reason_code: int | None = None) -> None:
        super().__init__(message)
        self.reason_code = self.default_reason_code if reason_code is None else reason_code


class MalformedPacketError(MqttProtocolError):
    """The bytes cannot be parsed as the packet they claim to be (§1.5, §2, §4.13)."""

    reason = "mqtt_malformed"
    default_reason_code = ReasonCode.MALFORMED_PACKET


class ProtocolViolationError(MqttProtocolError):
    """The packet parses but is forbidden where it appears (a "Protocol Error" in MQTT 5)."""

    reason = "mqtt_protocol_violation"
    default_reason_code = ReasonCode.PROTOCOL_ERROR


class PacketTooLargeError(MqttProtocolError):
    """The packet exceeds the size limit the receiver announced (§3.1.2.11.4, §3.2.2.3.6)."""

    reason = "mqtt_packet_too_large"
    default_reason_code = ReasonCode.PACKET_TOO_LARGE


class QuotaExceededError(MqttProtocolError):
    """The peer would make the broker hold more than its byte budget allows (MQTT 5 0x97)."""

    reason = "mqtt_quota_exceeded"
    default_reason_code = ReasonCode.QUOTA_EXCEEDED


class UnsupportedProtocolVersionError(MqttProtocolError):
    """A CONNECT names a protocol level this codec does not speak (§3.1.2.2)."""

    reason = "mqtt_unsupported_version"
    default_reason_code = ReasonCode.UNSUPPORTED_PROTOCOL_VERSION

    def __init__(self, protocol_name: str, protocol_level: int) -> None:
        super().__init__(f"unsupported protocol {protocol_name!r} level {protocol_level}")
        self.protocol_name = protocol_name
        self.protocol_level = protocol_level



@dataclass(frozen=True, slots=True)
class Properties:
    """MQTT 5 properties of one packet. ``None`` / empty means "absent".

    User Properties keep their order and may repeat a name (§3.3.2.3.7). A PUBLISH may carry
    several Subscription Identifiers; a SUBSCRIBE at most one (§3.8.2.1.2).
    """

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: tuple[int, ...] = ()
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None


NO_PROPERTIES = Properties()


# --- packets -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Will:
    """The Will Message carried by a CONNECT (§3.1.2.5, §3.1.3.2-3.1.3.4)."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Connect:
    """CONNECT (§3.1). ``clean_start`` is "Clean Session" in 3.1.1."""

    client_id: str
    protocol_level: int = MQTT_5
    clean_start: bool = True
    keep_alive: int = 60
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None
    properties: Properties = NO_PROPERTIES
    protocol_name: str = "MQTT"


@dataclass(frozen=True, slots=True)
class ConnAck:
    """CONNACK (§3.2). ``reason_code`` is the 3.1.1 return code for protocol level 4."""

    reason_code: int = 0
    session_present: bool = False
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Publish:
    """PUBLISH (§3.3). ``packet_id`` is set exactly when ``qos`` > 0."""

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Acknowledgement:
    """Shared shape of PUBACK, PUBREC, PUBREL and PUBCOMP (§3.4-§3.7)."""

    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class PubAck(Acknowledgement):
    """PUBACK (§3.4)."""


@dataclass(frozen=True, slots=True)
class PubRec(Acknowledgement):
    """PUBREC (§3.5)."""


@dataclass(frozen=True, slots=True)
class PubRel(Acknowledgement):
    """PUBREL (§3.6)."""


@dataclass(frozen=True, slots=True)
class PubComp(Acknowledgement):
    """PUBCOMP (§3.7)."""


@dataclass(frozen=True, slots=True)
class SubscriptionOptions:
    """The options byte of one SUBSCRIBE entry (§3.8.3.1). Only ``qos`` exists in 3.1.1."""

    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(frozen=True, slots=True)
class Subscribe:
    """SUBSCRIBE (§3.8)."""

    packet_id: int
    subscriptions: tuple[tuple[str, SubscriptionOptions], ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class SubAck:
    """SUBACK (§3.9): one reason code per requested filter, in order."""

    packet_id: int
    reason_codes: tuple[int, ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    """UNSUBSCRIBE (§3.10)."""

    packet_id: int
    topic_filters: tuple[str, ...]
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class UnsubAck:
    """UNSUBACK (§3.11). 3.1.1 has no reason codes: ``reason_codes`` is then empty."""

    packet_id: int
    reason_codes: tuple[int, ...] = ()
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class PingReq:
    """PINGREQ (§3.12)."""


@dataclass(frozen=True, slots=True)
class PingResp:
    """PINGRESP (§3.13)."""


@dataclass(frozen=True, slots=True)
class Disconnect:
    """DISCONNECT (§3.14). Reason and properties exist in MQTT 5 only."""

    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Auth:
    """AUTH (§3.15, MQTT 5 only). Decoded so it can be refused cleanly; never acted upon."""

    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


Packet: TypeAlias = (
    Connect | ConnAck | Publish | PubAck | PubRec | PubRel | PubComp | Subscribe | SubAck
    | Unsubscribe | UnsubAck | PingReq | PingResp | Disconnect | Auth
)
"""Any MQTT control packet."""

