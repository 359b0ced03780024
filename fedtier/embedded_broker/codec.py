"""MQTT 3.1.1 / 5.0 wire codec: pure functions between bytes and the packets of :mod:`.packets`.

The codec knows the wire format and nothing else — no sockets, no sessions, no routing —
so it can be tested byte for byte and reused by test clients. It is symmetric: every packet
type can be encoded and decoded, whichever side normally sends it.

Two pieces:

* :class:`PacketFramer` splits an incoming byte stream into frames (first byte + body). It
  checks the first byte at once, and the Remaining Length and the size limit as soon as the
  fixed header is complete, so garbage or an oversize packet is rejected before its body is
  buffered.
* :func:`decode_packet` / :func:`encode_packet` turn one frame into a packet dataclass and
  back. The protocol level (4 = 3.1.1, 5 = 5.0) selects the variant; CONNECT carries its own.

Decoding is strict: anything the specification calls a Malformed Packet raises
:class:`~.packets.MalformedPacketError`, anything it calls a Protocol Error raises
:class:`~.packets.ProtocolViolationError`. Both carry the MQTT 5 reason code the server
should use when it disconnects the peer. Semantic checks that need broker state (topic name
wildcards, QoS support, session rules) are the broker's job, not the codec's.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from fedtier.embedded_broker.packets import (
    MAX_REMAINING_LENGTH,
    MQTT_5,
    NO_PROPERTIES,
    SUPPORTED_PROTOCOL_LEVELS,
    Acknowledgement,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    MalformedPacketError,
    Packet,
    PacketTooLargeError,
    PacketType,
    PingReq,
    PingResp,
    Properties,
    ProtocolViolationError,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    SubscriptionOptions,
    UnsubAck,
    Unsubscribe,
    UnsupportedProtocolVersionError,
    Will,
)
from fedtier.errors import LocalProtocolError

# --- properties (MQTT 5 §2.2.2) -------------------------------------------------------------

_WILL = 0
"""Pseudo packet type for the Will Properties of a CONNECT (§3.1.3.2)."""

_BYTE, _U16, _U32, _VARINT, _UTF8, _BINARY, _PAIR = range(7)


@dataclass(frozen=True, slots=True)
class _PropertySpec:
    ident: int
    name: str
    kind: int
    allowed_in: frozenset[int]
    boolean: bool = False
    """Byte properties whose only legal values are 0 and 1 (anything else: Protocol Error)."""
    non_zero: bool = False
    """Integer properties for which 0 is a Protocol Error."""


def _in(*kinds: int) -> frozenset[int]:
    return frozenset(kinds)


_P = PacketType
_EVERY_PACKET_WITH_PROPERTIES = _in(
    _P.CONNECT, _P.CONNACK, _P.PUBLISH, _WILL, _P.PUBACK, _P.PUBREC, _P.PUBREL, _P.PUBCOMP,
    _P.SUBSCRIBE, _P.SUBACK, _P.UNSUBSCRIBE, _P.UNSUBACK, _P.DISCONNECT, _P.AUTH,
)
_ACKS_WITH_REASON_STRING = _in(
    _P.CONNACK, _P.PUBACK, _P.PUBREC, _P.PUBREL, _P.PUBCOMP, _P.SUBACK, _P.UNSUBACK,
    _P.DISCONNECT, _P.AUTH,
)

# Table 2-4 of MQTT 5. The order here is also the order properties are encoded in.
_PROPERTY_SPECS: tuple[_PropertySpec, ...] = (
    _PropertySpec(0x01, "payload_format_indicator", _BYTE, _in(_P.PUBLISH, _WILL), boolean=True),
    _PropertySpec(0x02, "message_expiry_interval", _U32, _in(_P.PUBLISH, _WILL)),
    _PropertySpec(0x03, "content_type", _UTF8, _in(_P.PUBLISH, _WILL)),
    _PropertySpec(0x08, "response_topic", _UTF8, _in(_P.PUBLISH, _WILL)),
    _PropertySpec(0x09, "correlation_data", _BINARY, _in(_P.PUBLISH, _WILL)),
    _PropertySpec(0x0B, "subscription_identifiers", _VARINT, _in(_P.PUBLISH, _P.SUBSCRIBE),
                  non_zero=True),
    _PropertySpec(0x11, "session_expiry_interval", _U32,
                  _in(_P.CONNECT, _P.CONNACK, _P.DISCONNECT)),
    _PropertySpec(0x12, "assigned_client_identifier", _UTF8, _in(_P.CONNACK)),
    _PropertySpec(0x13, "server_keep_alive", _U16, _in(_P.CONNACK)),
    _PropertySpec(0x15, "authentication_method", _UTF8, _in(_P.CONNECT, _P.CONNACK, _P.AUTH)),
    _PropertySpec(0x16, "authentication_data", _BINARY, _in(_P.CONNECT, _P.CONNACK, _P.AUTH)),
    _PropertySpec(0x17, "request_problem_information", _BYTE, _in(_P.CONNECT), boolean=True),
    _PropertySpec(0x18, "will_delay_interval", _U32, _in(_WILL)),
    _PropertySpec(0x19, "request_response_information", _BYTE, _in(_P.CONNECT), boolean=True),
    _PropertySpec(0x1A, "response_information", _UTF8, _in(_P.CONNACK)),
    _PropertySpec(0x1C, "server_reference", _UTF8, _in(_P.CONNACK, _P.DISCONNECT)),
    _PropertySpec(0x1F, "reason_string", _UTF8, _ACKS_WITH_REASON_STRING),
    _PropertySpec(0x21, "receive_maximum", _U16, _in(_P.CONNECT, _P.CONNACK), non_zero=True),
    _PropertySpec(0x22, "topic_alias_maximum", _U16, _in(_P.CONNECT, _P.CONNACK)),
    _PropertySpec(0x23, "topic_alias", _U16, _in(_P.PUBLISH), non_zero=True),
    _PropertySpec(0x24, "maximum_qos", _BYTE, _in(_P.CONNACK), boolean=True),
    _PropertySpec(0x25, "retain_available", _BYTE, _in(_P.CONNACK), boolean=True),
    _PropertySpec(0x26, "user_properties", _PAIR, _EVERY_PACKET_WITH_PROPERTIES),
    _PropertySpec(0x27, "maximum_packet_size", _U32, _in(_P.CONNECT, _P.CONNACK), non_zero=True),
    _PropertySpec(0x28, "wildcard_subscription_available", _BYTE, _in(_P.CONNACK), boolean=True),
    _PropertySpec(0x29, "subscription_identifier_available", _BYTE, _in(_P.CONNACK),
                  boolean=True),
    _PropertySpec(0x2A, "shared_subscription_available", _BYTE, _in(_P.CONNACK), boolean=True),
)
_PROPERTY_BY_ID = {spec.ident: spec for spec in _PROPERTY_SPECS}
_REPEATABLE = {"user_properties", "subscription_identifiers"}


# --- framing ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    """One complete control packet as split off the stream, not yet decoded."""

    first_byte: int
    body: bytes


class PacketFramer:
    """Incremental splitter of a byte stream into :class:`Frame` objects.

    Feed it whatever the socket returns; pull frames until it returns ``None``. A frame is
    only cut once all its bytes are in, but the size check happens as soon as the fixed
    header is complete, so a peer cannot make us buffer an oversize body.
    """

    def __init__(self, max_packet_size: int | None = None) -> None:
        self.max_packet_size = max_packet_size
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes received from the peer."""
        self._buffer += data

    def clear(self) -> None:
        """Drop everything buffered (the connection is closing: nothing more is framed)."""
        self._buffer = bytearray()

    def peek_packet_type(self) -> int | None:
        """Type nibble of the next (possibly incomplete) packet, ``None`` if nothing buffered."""
        return self._buffer[0] >> 4 if self._buffer else None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buffer)

    def next_frame(self) -> Frame | None:
        """The next complete frame, or ``None`` if more bytes are needed.

        Raises :class:`MalformedPacketError` for a Remaining Length longer than four bytes
        (§1.5.5) and :class:`PacketTooLargeError` if the announced packet exceeds the limit.
        """
        buf = self._buffer
        if not buf:
            return None
        check_first_byte(buf[0])  # reject garbage now, not once its "body" has arrived
        if len(buf) < 2:
            return None
        remaining = 0
        multiplier = 1
        index = 1
        while True:
            if index >= len(buf):
                return None  # the Remaining Length itself is still incomplete
            byte = buf[index]
            remaining += (byte & 0x7F) * multiplier
            index += 1
            if not byte & 0x80:
                break
            if index == 5:
                raise MalformedPacketError("remaining length longer than four bytes")
            multiplier *= 128
        total = index + remaining
        if self.max_packet_size is not None and total > self.max_packet_size:
            raise PacketTooLargeError(
                f"packet of {total} bytes exceeds the maximum packet size {self.max_packet_size}"
            )
        if len(buf) < total:
            return None
        frame = Frame(buf[0], bytes(buf[index:total]))
        del buf[:total]
        return frame


# --- primitive readers / writers ---------------------------------------------------------------


class _Reader:
    """A bounded cursor over a packet body. Running off the end is a Malformed Packet."""

    __slots__ = ("_data", "_end", "_pos")

    def __init__(self, data: bytes, pos: int = 0, end: int | None = None) -> None:
        self._data = data
        self._pos = pos
        self._end = len(data) if end is None else end

    def at_end(self) -> bool:
        return self._pos >= self._end

    def _take(self, n: int, what: str) -> bytes:
        if self._pos + n > self._end:
            raise MalformedPacketError(f"truncated {what}")
        chunk = self._data[self._pos:self._pos + n]
        self._pos += n
        return chunk

    def u8(self, what: str = "byte") -> int:
        return self._take(1, what)[0]

    def u16(self, what: str = "two byte integer") -> int:
        return int.from_bytes(self._take(2, what), "big")

    def u32(self, what: str = "four byte integer") -> int:
        return int.from_bytes(self._take(4, what), "big")

    def varint(self, what: str = "variable byte integer") -> int:
        value = 0
        for shift in range(0, 28, 7):
            byte = self.u8(what)
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
        raise MalformedPacketError(f"{what} longer than four bytes")

    def binary(self, what: str = "binary data") -> bytes:
        return self._take(self.u16(what), what)

    def utf8(self, what: str = "string") -> str:
        raw = self.binary(what)
        try:
            text = raw.decode("utf-8")  # strict: rejects overlong forms and surrogates (§1.5.4)
        except UnicodeDecodeError as exc:
            raise MalformedPacketError(f"{what} is not valid UTF-8") from exc
        if "\x00" in text:
            raise MalformedPacketError(f"{what} contains U+0000")  # §1.5.4 [MQTT-1.5.4-2]
        return text

    def sub_reader(self, length: int, what: str) -> _Reader:
        """A reader over the next ``length`` bytes; this reader skips past them."""
        if self._pos + length > self._end:
            raise MalformedPacketError(f"{what} exceeds the packet")
        sub = _Reader(self._data, self._pos, self._pos + length)
        self._pos += length
        return sub

    def rest(self) -> bytes:
        chunk = self._data[self._pos:self._end]
        self._pos = self._end
        return chunk

    def expect_end(self, what: str) -> None:
        if self._pos != self._end:
            raise MalformedPacketError(f"{self._end - self._pos} unexpected bytes after {what}")


def _encode_varint(value: int) -> bytes:
    if not 0 <= value <= MAX_REMAINING_LENGTH:
        raise LocalProtocolError(f"variable byte integer out of range: {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _encode_binary(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise LocalProtocolError(f"binary field of {len(data)} bytes exceeds 65535")
    return struct.pack("!H", len(data)) + data


def _encode_utf8(text: str) -> bytes:
    return _encode_binary(text.encode("utf-8"))


# --- properties codec -------------------------------------------------------------------------


def _read_properties(reader: _Reader, packet_kind: int) -> Properties:
    """Read a Property Length and the properties it covers (§2.2.2)."""
    sub = reader.sub_reader(reader.varint("property length"), "property length")
    values: dict[str, object] = {}
    user_properties: list[tuple[str, str]] = []
    subscription_ids: list[int] = []
    while not sub.at_end():
        ident = sub.varint("property identifier")
        spec = _PROPERTY_BY_ID.get(ident)
        if spec is None:
            raise MalformedPacketError(f"unknown property identifier 0x{ident:02x}")
        if packet_kind not in spec.allowed_in:
            # §2.2.2.2: an identifier not valid for the packet type is a Malformed Packet.
            raise MalformedPacketError(f"property {spec.name} not allowed in this packet")
        value = _read_property_value(sub, spec)
        if spec.boolean and value not in (0, 1):
            raise ProtocolViolationError(f"property {spec.name} must be 0 or 1, got {value}")
        if spec.non_zero and value == 0:
            raise ProtocolViolationError(f"property {spec.name} must not be 0")
        if spec.name == "user_properties":
            assert isinstance(value, tuple)
            user_properties.append(value)
        elif spec.name == "subscription_identifiers":
            assert isinstance(value, int)
            if packet_kind == PacketType.SUBSCRIBE and subscription_ids:
                raise ProtocolViolationError("more than one subscription identifier")
            subscription_ids.append(value)
        elif spec.name in values:
            raise ProtocolViolationError(f"property {spec.name} included more than once")
        else:
            values[spec.name] = value
    return Properties(
        **values,  # type: ignore[arg-type]
        user_properties=tuple(user_properties),
        subscription_identifiers=tuple(subscription_ids),
    )


def _read_property_value(reader: _Reader, spec: _PropertySpec) -> object:
    what = f"property {spec.name}"
    if spec.kind == _BYTE:
        return reader.u8(what)
    if spec.kind == _U16:
        return reader.u16(what)
    if spec.kind == _U32:
        return reader.u32(what)
    if spec.kind == _VARINT:
        return reader.varint(what)
    if spec.kind == _UTF8:
        return reader.utf8(what)
    if spec.kind == _BINARY:
        return reader.binary(what)
    return (reader.utf8(what), reader.utf8(what))


def _encode_properties(props: Properties, packet_kind: int) -> bytes:
    """Encode the properties present in ``props``, each checked against Table 2-4."""
    out = bytearray()
    for spec in _PROPERTY_SPECS:
        value = getattr(props, spec.name)
        if value is None or (spec.name in _REPEATABLE and not value):
            continue
        if packet_kind not in spec.allowed_in:
            raise LocalProtocolError(f"property {spec.name} not allowed in packet {packet_kind}")
        items = value if spec.name in _REPEATABLE else (value,)
        for item in items:
            out += _encode_varint(spec.ident)
            out += _encode_property_value(spec.kind, item)
    return _encode_varint(len(out)) + bytes(out)


def _encode_property_value(kind: int, value: object) -> bytes:
    if kind == _BYTE:
        return struct.pack("!B", value)
    if kind == _U16:
        return struct.pack("!H", value)
    if kind == _U32:
        return struct.pack("!I", value)
    if kind == _VARINT:
        assert isinstance(value, int)
        return _encode_varint(value)
    if kind == _UTF8:
        assert isinstance(value, str)
        return _encode_utf8(value)
    if kind == _BINARY:
        assert isinstance(value, bytes)
        return _encode_binary(value)
    assert isinstance(value, tuple)
    name, val = value
    return _encode_utf8(name) + _encode_utf8(val)


# --- decoding -----------------------------------------------------------------------------------

# Fixed-header flags every packet type must carry (§2.1.3); PUBLISH is checked separately.
_REQUIRED_FLAGS = {
    PacketType.PUBREL: 0b0010,
    PacketType.SUBSCRIBE: 0b0010,
    PacketType.UNSUBSCRIBE: 0b0010,
}


def check_first_byte(first_byte: int) -> PacketType:
    """Validate packet type and fixed-header flags (§2.1.2, §2.1.3); return the type.

    Version-independent: AUTH in 3.1.1 and PUBLISH flag combinations are left to
    :func:`decode_packet`.
    """
    type_value = first_byte >> 4
    flags = first_byte & 0x0F
    if type_value == 0:
        raise MalformedPacketError("reserved packet type 0")
    ptype = PacketType(type_value)
    if ptype != PacketType.PUBLISH and flags != _REQUIRED_FLAGS.get(ptype, 0):
        raise MalformedPacketError(f"invalid fixed header flags 0x{flags:x} for {ptype.name}")
    return ptype


def decode_packet(frame: Frame, protocol_level: int) -> Packet:
    """Decode one frame. ``protocol_level`` is that of the connection (ignored for CONNECT).

    Raises :class:`MalformedPacketError`, :class:`ProtocolViolationError` or, for a CONNECT
    with an unknown protocol level, :class:`UnsupportedProtocolVersionError`.
    """
    ptype = check_first_byte(frame.first_byte)
    flags = frame.first_byte & 0x0F
    if ptype == PacketType.AUTH and protocol_level != MQTT_5:
        raise MalformedPacketError("reserved packet type 15 in MQTT 3.1.1")
    reader = _Reader(frame.body)
    v5 = protocol_level == MQTT_5
    decoder = _DECODERS[ptype]
    return decoder(reader, flags, v5)


def _packet_id(reader: _Reader) -> int:
    packet_id = reader.u16("packet identifier")
    if packet_id == 0:
        raise MalformedPacketError("packet identifier 0")  # §2.2.1 [MQTT-2.2.1-3]
    return packet_id


def _decode_connect(reader: _Reader, flags: int, v5: bool) -> Connect:
    name = reader.utf8("protocol name")
    level = reader.u8("protocol level")
    if name not in ("MQTT", "MQIsdp"):
        # §3.1.2.1: the Server MAY disconnect without CONNACK; the caller just closes.
        raise ProtocolViolationError(f"unknown protocol name {name!r}")
    if name != "MQTT" or level not in SUPPORTED_PROTOCOL_LEVELS:
        raise UnsupportedProtocolVersionError(name, level)
    v5 = level == MQTT_5
    connect_flags = reader.u8("connect flags")
    if connect_flags & 0x01:
        raise MalformedPacketError("reserved connect flag set")  # [MQTT-3.1.2-3]
    will_flag = bool(connect_flags & 0x04)
    will_qos = (connect_flags >> 3) & 0x03
    will_retain = bool(connect_flags & 0x20)
    has_password = bool(connect_flags & 0x40)
    has_username = bool(connect_flags & 0x80)
    if will_qos == 3:
        raise MalformedPacketError("will QoS 3")  # [MQTT-3.1.2-14]
    if not will_flag and (will_qos or will_retain):
        raise MalformedPacketError("will QoS/retain set without will flag")  # [MQTT-3.1.2-13]
    if not v5 and has_password and not has_username:
        raise MalformedPacketError("password without user name")  # 3.1.1 [MQTT-3.1.2-22]
    keep_alive = reader.u16("keep alive")
    properties = _read_properties(reader, PacketType.CONNECT) if v5 else NO_PROPERTIES
    client_id = reader.utf8("client identifier")
    will = None
    if will_flag:
        will_props = _read_properties(reader, _WILL) if v5 else NO_PROPERTIES
        will_topic = reader.utf8("will topic")
        will_payload = reader.binary("will payload")
        will = Will(will_topic, will_payload, will_qos, will_retain, will_props)
    username = reader.utf8("user name") if has_username else None
    password = reader.binary("password") if has_password else None
    reader.expect_end("CONNECT")
    return Connect(
        client_id=client_id, protocol_level=level, clean_start=bool(connect_flags & 0x02),
        keep_alive=keep_alive, will=will, username=username, password=password,
        properties=properties, protocol_name=name,
    )


def _decode_connack(reader: _Reader, flags: int, v5: bool) -> ConnAck:
    ack_flags = reader.u8("connect acknowledge flags")
    if ack_flags & 0xFE:
        raise MalformedPacketError("reserved CONNACK flags set")
    code = reader.u8("connect reason code")
    properties = _read_properties(reader, PacketType.CONNACK) if v5 else NO_PROPERTIES
    reader.expect_end("CONNACK")
    return ConnAck(code, bool(ack_flags & 0x01), properties)


def _decode_publish(reader: _Reader, flags: int, v5: bool) -> Publish:
    dup = bool(flags & 0x08)
    qos = (flags >> 1) & 0x03
    retain = bool(flags & 0x01)
    if qos == 3:
        raise MalformedPacketError("PUBLISH with QoS 3")  # [MQTT-3.3.1-4]
    if qos == 0 and dup:
        raise MalformedPacketError("DUP set on a QoS 0 PUBLISH")  # [MQTT-3.3.1-2]
    topic = reader.utf8("topic name")
    packet_id = _packet_id(reader) if qos else None
    properties = _read_properties(reader, PacketType.PUBLISH) if v5 else NO_PROPERTIES
    return Publish(topic, reader.rest(), qos, retain, dup, packet_id, properties)


def _ack_decoder(cls: type[Acknowledgement], ptype: PacketType) -> Callable[[_Reader, int, bool], Packet]:
    def decode(reader: _Reader, flags: int, v5: bool) -> Packet:
        packet_id = reader.u16("packet identifier")
        reason = 0
        properties = NO_PROPERTIES
        # §3.4.2.1: in MQTT 5 the reason code and property length may be omitted.
        if v5 and not reader.at_end():
            reason = reader.u8("reason code")
            if not reader.at_end():
                properties = _read_properties(reader, ptype)
        reader.expect_end(ptype.name)
        return cls(packet_id, reason, properties)  # type: ignore[return-value]

    return decode


def _decode_subscribe(reader: _Reader, flags: int, v5: bool) -> Subscribe:
    packet_id = _packet_id(reader)
    properties = _read_properties(reader, PacketType.SUBSCRIBE) if v5 else NO_PROPERTIES
    entries: list[tuple[str, SubscriptionOptions]] = []
    while not reader.at_end():
        topic_filter = reader.utf8("topic filter")
        options = reader.u8("subscription options")
        reserved_mask = 0xC0 if v5 else 0xFC  # [MQTT-3.8.3-5] / 3.1.1 [MQTT-3.8.3-4]
        if options & reserved_mask:
            raise MalformedPacketError("reserved subscription option bits set")
        qos = options & 0x03
        retain_handling = (options >> 4) & 0x03
        if qos == 3 or retain_handling == 3:
            raise MalformedPacketError("invalid QoS or retain handling in subscription options")
        entries.append((topic_filter, SubscriptionOptions(
            qos=qos, no_local=bool(options & 0x04), retain_as_published=bool(options & 0x08),
            retain_handling=retain_handling,
        )))
    if not entries:
        raise ProtocolViolationError("SUBSCRIBE without topic filters")  # [MQTT-3.8.3-2]
    return Subscribe(packet_id, tuple(entries), properties)


def _decode_suback(reader: _Reader, flags: int, v5: bool) -> SubAck:
    packet_id = reader.u16("packet identifier")
    properties = _read_properties(reader, PacketType.SUBACK) if v5 else NO_PROPERTIES
    return SubAck(packet_id, tuple(reader.rest()), properties)


def _decode_unsubscribe(reader: _Reader, flags: int, v5: bool) -> Unsubscribe:
    packet_id = _packet_id(reader)
    properties = _read_properties(reader, PacketType.UNSUBSCRIBE) if v5 else NO_PROPERTIES
    filters: list[str] = []
    while not reader.at_end():
        filters.append(reader.utf8("topic filter"))
    if not filters:
        raise ProtocolViolationError("UNSUBSCRIBE without topic filters")  # [MQTT-3.10.3-2]
    return Unsubscribe(packet_id, tuple(filters), properties)


def _decode_unsuback(reader: _Reader, flags: int, v5: bool) -> UnsubAck:
    packet_id = reader.u16("packet identifier")
    if not v5:
        reader.expect_end("UNSUBACK")
        return UnsubAck(packet_id)
    properties = _read_properties(reader, PacketType.UNSUBACK)
    return UnsubAck(packet_id, tuple(reader.rest()), properties)


def _empty_decoder(cls: type[PingReq] | type[PingResp]) -> Callable[[_Reader, int, bool], Packet]:
    def decode(reader: _Reader, flags: int, v5: bool) -> Packet:
        reader.expect_end(cls.__name__.upper())
        return cls()

    return decode


def _reason_and_properties_decoder(
    cls: type[Disconnect] | type[Auth], ptype: PacketType
) -> Callable[[_Reader, int, bool], Packet]:
    def decode(reader: _Reader, flags: int, v5: bool) -> Packet:
        reason = 0
        properties = NO_PROPERTIES
        # §3.14.2.1: an absent reason code means 0x00; absent properties mean none.
        if v5 and not reader.at_end():
            reason = reader.u8("reason code")
            if not reader.at_end():
                properties = _read_properties(reader, ptype)
        reader.expect_end(ptype.name)
        return cls(reason, properties)

    return decode


_DECODERS: dict[PacketType, Callable[[_Reader, int, bool], Packet]] = {
    PacketType.CONNECT: _decode_connect,
    PacketType.CONNACK: _decode_connack,
    PacketType.PUBLISH: _decode_publish,
    PacketType.PUBACK: _ack_decoder(PubAck, PacketType.PUBACK),
    PacketType.PUBREC: _ack_decoder(PubRec, PacketType.PUBREC),
    PacketType.PUBREL: _ack_decoder(PubRel, PacketType.PUBREL),
    PacketType.PUBCOMP: _ack_decoder(PubComp, PacketType.PUBCOMP),
    PacketType.SUBSCRIBE: _decode_subscribe,
    PacketType.SUBACK: _decode_suback,
    PacketType.UNSUBSCRIBE: _decode_unsubscribe,
    PacketType.UNSUBACK: _decode_unsuback,
    PacketType.PINGREQ: _empty_decoder(PingReq),
    PacketType.PINGRESP: _empty_decoder(PingResp),
    PacketType.DISCONNECT: _reason_and_properties_decoder(Disconnect, PacketType.DISCONNECT),
    PacketType.AUTH: _reason_and_properties_decoder(Auth, PacketType.AUTH),
}


# --- encoding -----------------------------------------------------------------------------------


def encode_packet(packet: Packet, protocol_level: int) -> bytes:
    """Encode ``packet`` for a connection at ``protocol_level`` (CONNECT uses its own).

    For protocol level 4 all MQTT 5 fields (properties, reason codes other than the 3.1.1
    return codes) are simply not written. Raises :class:`LocalProtocolError` for values that
    cannot be represented (a string over 65535 bytes, a property in the wrong packet).
    """
    v5 = protocol_level == MQTT_5
    ptype, flags, body = _encode_body(packet, v5)
    return bytes([(ptype << 4) | flags]) + _encode_varint(len(body)) + body


def _encode_body(packet: Packet, v5: bool) -> tuple[PacketType, int, bytes]:
    if isinstance(packet, Publish):
        return PacketType.PUBLISH, _publish_flags(packet), _encode_publish(packet, v5)
    if isinstance(packet, PubAck | PubRec | PubRel | PubComp):
        ptype = _ACK_TYPES[type(packet)]
        return ptype, _REQUIRED_FLAGS.get(ptype, 0), _encode_ack(packet, ptype, v5)
    if isinstance(packet, Connect):
        return PacketType.CONNECT, 0, _encode_connect(packet)
    if isinstance(packet, ConnAck):
        body = bytes([int(packet.session_present), packet.reason_code])
        if v5:
            body += _encode_properties(packet.properties, PacketType.CONNACK)
        return PacketType.CONNACK, 0, body
    if isinstance(packet, Subscribe):
        return PacketType.SUBSCRIBE, 0b0010, _encode_subscribe(packet, v5)
    if isinstance(packet, SubAck):
        body = struct.pack("!H", packet.packet_id)
        if v5:
            body += _encode_properties(packet.properties, PacketType.SUBACK)
        return PacketType.SUBACK, 0, body + bytes(packet.reason_codes)
    if isinstance(packet, Unsubscribe):
        body = struct.pack("!H", packet.packet_id)
        if v5:
            body += _encode_properties(packet.properties, PacketType.UNSUBSCRIBE)
        body += b"".join(_encode_utf8(f) for f in packet.topic_filters)
        return PacketType.UNSUBSCRIBE, 0b0010, body
    if isinstance(packet, UnsubAck):
        body = struct.pack("!H", packet.packet_id)
        if v5:
            body += _encode_properties(packet.properties, PacketType.UNSUBACK)
            body += bytes(packet.reason_codes)
        return PacketType.UNSUBACK, 0, body
    if isinstance(packet, PingReq):
        return PacketType.PINGREQ, 0, b""
    if isinstance(packet, PingResp):
        return PacketType.PINGRESP, 0, b""
    if isinstance(packet, Disconnect | Auth):
        ptype = PacketType.DISCONNECT if isinstance(packet, Disconnect) else PacketType.AUTH
        return ptype, 0, _encode_reason_and_properties(packet, ptype, v5)
    raise LocalProtocolError(f"cannot encode {packet!r}")


_ACK_TYPES: dict[type, PacketType] = {
    PubAck: PacketType.PUBACK,
    PubRec: PacketType.PUBREC,
    PubRel: PacketType.PUBREL,
    PubComp: PacketType.PUBCOMP,
}


def _publish_flags(packet: Publish) -> int:
    if not 0 <= packet.qos <= 2 or (packet.qos > 0) != (packet.packet_id is not None):
        raise LocalProtocolError("PUBLISH needs a packet id exactly when QoS > 0")
    return (int(packet.dup) << 3) | (packet.qos << 1) | int(packet.retain)


def _encode_publish(packet: Publish, v5: bool) -> bytes:
    parts = [_encode_utf8(packet.topic)]
    if packet.packet_id is not None:
        parts.append(struct.pack("!H", packet.packet_id))
    if v5:
        parts.append(_encode_properties(packet.properties, PacketType.PUBLISH))
    parts.append(packet.payload)
    return b"".join(parts)


def _encode_ack(packet: Acknowledgement, ptype: PacketType, v5: bool) -> bytes:
    body = struct.pack("!H", packet.packet_id)
    if not v5:
        return body
    if packet.properties != NO_PROPERTIES:
        return body + bytes([packet.reason_code]) + _encode_properties(packet.properties, ptype)
    if packet.reason_code != 0:
        return body + bytes([packet.reason_code])
    return body  # §3.4.2.1: reason 0x00 without properties may be omitted


def _encode_connect(packet: Connect) -> bytes:
    v5 = packet.protocol_level == MQTT_5
    will = packet.will
    flags = 0
    if packet.clean_start:
        flags |= 0x02
    if will is not None:
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
    if packet.password is not None:
        flags |= 0x40
    if packet.username is not None:
        flags |= 0x80
    parts = [
        _encode_utf8(packet.protocol_name),
        bytes([packet.protocol_level, flags]),
        struct.pack("!H", packet.keep_alive),
    ]
    if v5:
        parts.append(_encode_properties(packet.properties, PacketType.CONNECT))
    parts.append(_encode_utf8(packet.client_id))
    if will is not None:
        if v5:
            parts.append(_encode_properties(will.properties, _WILL))
        parts.append(_encode_utf8(will.topic))
        parts.append(_encode_binary(will.payload))
    if packet.username is not None:
        parts.append(_encode_utf8(packet.username))
    if packet.password is not None:
        parts.append(_encode_binary(packet.password))
    return b"".join(parts)


def _encode_subscribe(packet: Subscribe, v5: bool) -> bytes:
    parts = [struct.pack("!H", packet.packet_id)]
    if v5:
        parts.append(_encode_properties(packet.properties, PacketType.SUBSCRIBE))
    for topic_filter, opts in packet.subscriptions:
        options = opts.qos
        if v5:
            options |= (
                (0x04 if opts.no_local else 0)
                | (0x08 if opts.retain_as_published else 0)
                | (opts.retain_handling << 4)
            )
        parts.append(_encode_utf8(topic_filter) + bytes([options]))
    return b"".join(parts)


def _encode_reason_and_properties(
    packet: Disconnect | Auth, ptype: PacketType, v5: bool
) -> bytes:
    if not v5:
        return b""
    if packet.properties != NO_PROPERTIES:
        return bytes([packet.reason_code]) + _encode_properties(packet.properties, ptype)
    if packet.reason_code != 0:
        return bytes([packet.reason_code])
    return b""
