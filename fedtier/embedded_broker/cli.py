"""``python -m fedtier.embedded_broker``: run the embedded broker in the foreground.

For a machine without Mosquitto (``fedtier demo`` starts it this way in a subprocess).
Runs until SIGINT or SIGTERM; everything it says goes through ``logging`` on stderr.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from fedtier.embedded_broker.server import EmbeddedBroker

logger = logging.getLogger("fedtier.embedded_broker")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fedtier.embedded_broker",
        description="Pure-Python MQTT 3.1.1/5.0 broker (QoS 0/1, retained, wills, sessions).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=1883,
                        help="TCP port; 0 picks a free one (default %(default)s)")
    parser.add_argument("--max-packet-size", type=_positive_int, default=None,
                        help="largest packet accepted, in bytes (default: no limit)")
    parser.add_argument("--max-queued-messages", type=_positive_int, default=10_000,
                        help="QoS 1 messages queued per session (default %(default)s)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM. Returns the process exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    broker = EmbeddedBroker(args.host, args.port, max_packet_size=args.max_packet_size,
                            max_queued_messages=args.max_queued_messages)
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
