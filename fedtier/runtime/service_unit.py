"""systemd units for the three long-running roles (``fedtier agent|edge|coordinator install-service``).

A unit restarts its node when it fails (``Restart=on-failure``) but not when its credentials are
refused (exit code 77, ``mqtt_service.EXIT_UNAUTHORIZED``: retrying cannot help until an operator
acts), keeps its state in a directory systemd creates and owns (``StateDirectory=``, under
/var/lib), and stops it with SIGTERM, which every node handles by closing cleanly (publishing its
``offline`` presence). The node's own state directory (in its config) should be that directory.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

UNIT_DIR = Path("/etc/systemd/system")


@dataclass(frozen=True)
class ServiceUnit:
    name: str
    """The unit's file name (``fedtier-agent-dev-00.service``)."""
    text: str


def fedtier_command() -> list[str]:
    """How systemd runs fedtier: the ``fedtier`` script next to this interpreter, or ``python -m fedtier``."""
    script = Path(sys.executable).parent / "fedtier"
    if script.exists():
        return [str(script.absolute())]
    found = shutil.which("fedtier")
    return [found] if found else [str(Path(sys.executable).absolute()), "-m", "fedtier"]


def unit(*, role: str, node: str, args: Sequence[str], state_dir: str, user: str | None = None,
         description: str | None = None) -> ServiceUnit:
    """A systemd unit running ``fedtier <args>`` as node ``node`` of ``role``.

    Args:
        role: agent, edge or coordinator (names the unit and its state directory).
        node: the node's id (or another name that tells this unit apart on one machine).
        args: the fedtier arguments (``["agent", "run", "--config", "/etc/fedtier/dev-00.toml"]``).
        state_dir: ``StateDirectory=`` (relative to /var/lib).
        user: run as this user (default: root, systemd's default).
    """
    exec_start = " ".join(shlex.quote(a) for a in [*fedtier_command(), *args])
    lines = [
        "[Unit]",
        f"Description={description or f'fedtier {role} {node}'}",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={exec_start}",
        "Restart=on-failure",
        "RestartSec=5",
        "RestartPreventExitStatus=77",
        f"StateDirectory={state_dir}",
        "WorkingDirectory=%S/" + state_dir,
        "KillSignal=SIGTERM",
        "TimeoutStopSec=30",
        "Environment=PYTHONUNBUFFERED=1",
        *([f"User={user}"] if user else []),
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return ServiceUnit(name=f"fedtier-{role}-{node}.service", text="\n".join(lines))


def install(service: ServiceUnit, unit_dir: Path = UNIT_DIR) -> Path:
    """Write the unit file; the operator then runs ``systemctl daemon-reload && systemctl enable --now``."""
    unit_dir.mkdir(parents=True, exist_ok=True)
    path = unit_dir / service.name
    path.write_text(service.text)
    return path
