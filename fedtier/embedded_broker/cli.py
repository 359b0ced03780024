"""``python -m fedtier.embedded_broker``: run the embedded broker in the foreground.

For a machine without Mosquitto (``fedtier demo`` starts it this way in a subprocess).
Runs until SIGINT or SIGTERM; everything it says goes through ``logging`` on stderr.
Every limit of :class:`~fedtier.embedded_broker.limits.BrokerLimits` has an option with the
same name; the defaults are the safe ones documented in docs/broker.md.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from dataclasses import fields
from types import FrameType

from fedtier.embedded_broker.acl import AccessList
from fedtier.embedded_broker.limits import DEFAULT_LIMITS, BrokerLimits
from fedtier.embedded_broker.passwords import PasswordFile
from fedtier.embedded_broker.server import EmbeddedBroker
from fedtier.errors import ConfigError

logger = logging.getLogger("fedtier.embedded_broker")

_HELP = {
    "max_packet_size": "largest packet accepted, bytes; 0 = no limit",
    "max_connect_size": "largest packet accepted before CONNECT, bytes",
    "max_buffered_bytes": "total bytes held for clients (partial packets, queued and retained messages)",
    "max_queued_messages": "QoS 1/2 messages queued per session",
    "max_queued_bytes": "bytes of QoS 1/2 messages queued per session",
    "max_output_backlog": "unsent bytes per connection before its QoS 0 traffic is dropped",
    "max_connections": "open sockets in total",
    "max_connections_per_address": "open sockets per client address",
    "max_input_bytes": "bytes of partial packets held in total beyond each connection's allowance",
    "input_allowance": "bytes of a partial packet each connection may hold without drawing on the total",
    "stall_timeout": "seconds after which a partial packet may be closed when the input total runs out",
    "max_keepalive": ("keep-alive (seconds) imposed on clients that ask for none: told to v5 clients "
                      "(and to those asking more), 3.1.1 ones closed after 1.5 x it of silence"),
}


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fedtier.embedded_broker",
        description="Pure-Python MQTT 3.1.1/5.0 broker (QoS 0/1/2, retained, wills, sessions, ACL).",
        epilog="example: python -m fedtier.embedded_broker --port 1883 --max-packet-size 262144",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=1883,
                        help="TCP port; 0 picks a free one (default %(default)s)")
    for spec in fields(BrokerLimits):
        default = getattr(DEFAULT_LIMITS, spec.name)
        parser.add_argument(f"--{spec.name.replace('_', '-')}", dest=spec.name, type=_non_negative_int,
                            default=default, help=f"{_HELP[spec.name]} (default %(default)s)")
    parser.add_argument("--acl-file", default=None,
                        help="Mosquitto-format ACL (user/topic/pattern lines); default: no ACL")
    parser.add_argument("--password-file", default=None,
                        help="Mosquitto-format password file ($7$/$6$ hashes, as mosquitto_passwd or "
                             "'fedtier broker passwd' write it): only its users may connect; "
                             "default: anyone may")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default %(default)s)")
    return parser


def limits_from(args: argparse.Namespace) -> BrokerLimits:
    """The :class:`BrokerLimits` named by parsed options (``--max-packet-size 0`` = no limit)."""
    values = {spec.name: getattr(args, spec.name) for spec in fields(BrokerLimits)}
    if values["max_packet_size"] == 0:
        values["max_packet_size"] = None
    return BrokerLimits(**values)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM. Returns the process exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        limits = limits_from(args)
        acl = AccessList.load(args.acl_file) if args.acl_file else None
        passwords = PasswordFile.load(args.password_file) if args.password_file else None
    except ConfigError as exc:
        logger.error("invalid option: %s", exc)
        return 2
    if passwords is not None:
        logger.info("password file %s: %d users; clients without valid credentials are refused",
                    args.password_file, len(passwords.users))
    broker = EmbeddedBroker(args.host, args.port, limits=limits, acl=acl, passwords=passwords)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            broker.start()
        except OSError as exc:
            logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
            return 1
        # A timed wait keeps the main thread responsive to signals on every platform.
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        broker.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
