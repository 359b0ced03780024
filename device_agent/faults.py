"""TESTS ONLY: make an agent's training runtime fail on purpose, to test how the fleet contains it.

Never active unless the environment variable ``FEDTIER_TEST_TRAINING_FAULT`` is set (no config file
key turns it on); an agent that finds it logs a warning at start-up. Its value is a comma-separated
list of ``DEVICE:HOW@ROUND``: the agent whose id is DEVICE fails, right before its trainer runs any
work of round ROUND (every time: after a restart too), in one of these ways:

* ``segv`` — the process kills itself with SIGSEGV, as a native crash inside onnxruntime does (no
  Python exception, no log line, no cleanup);
* ``abort`` — ``os.abort()`` (SIGABRT), as a failed assertion in native code does;
* ``raise`` — the trainer raises ``RuntimeError``, as onnxruntime does for an error it catches.

``tests/integration/test_training_failures.py`` uses it; ``device_agent.node`` calls ``Fault.before``
in front of every trainer call.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Mapping

from fedtier.errors import ConfigError

log = logging.getLogger("fedtier.agent")

ENV = "FEDTIER_TEST_TRAINING_FAULT"
HOWS = ("segv", "abort", "raise")


class InjectedFault(RuntimeError):
    """What ``raise`` raises: a trainer error, as the runtime's own would be."""


@dataclass(frozen=True)
class Fault:
    """Fail ``how`` before the trainer runs work of round ``round``."""

    how: str
    round: int

    def before(self, round: int) -> None:
        """Called right before the trainer runs work of ``round``."""
        if round != self.round:
            return
        log.warning("TEST FAULT: %s before training round %d (%s)", self.how, round, ENV)
        if self.how == "segv":
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGSEGV)
        elif self.how == "abort":
            os.abort()
        else:
            raise InjectedFault(f"injected trainer error in round {round} ({ENV})")


def from_env(device_id: str, environ: Mapping[str, str] | None = None) -> Fault | None:
    """The fault ``FEDTIER_TEST_TRAINING_FAULT`` names for ``device_id``, or ``None`` (the normal case).

    Raises:
        ConfigError: the variable is set but not a list of ``DEVICE:HOW@ROUND``.
    """
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not value:
        return None
    for item in value.split(","):
        device, _, spec = item.strip().partition(":")
        how, _, at = spec.partition("@")
        if how not in HOWS or not at.strip().isdigit():
            raise ConfigError(f"{ENV}={value!r}: each item is DEVICE:HOW@ROUND with HOW one of {', '.join(HOWS)}",
                              key=ENV)
        if device == device_id:
            return Fault(how=how, round=int(at))
    return None
