"""systemd units for the three long-running roles (``fedtier agent|edge|coordinator install-service``).

A unit restarts its node when it fails (``Restart=on-failure``) but not when its credentials are
refused (exit code 77, ``mqtt_service.EXIT_UNAUTHORIZED``: retrying cannot help until an operator
acts), keeps its state in a directory systemd creates and owns (``StateDirectory=``, under
/var/lib), and stops it with SIGTERM, which every node handles by closing cleanly (publishing its
``offline`` presence). The node's own state directory (in its config) should be that directory.

A node is a network client with one state directory: it needs its config (and certificates),
outbound TCP (the broker, a PostgreSQL store), one listening TCP port at most (metrics, the
dashboard) and write access to its state directory, nothing else. So the unit runs it as a
dedicated unprivileged user (``DynamicUser=yes`` with ``User=fedtier``: systemd allocates the user
when the unit starts, or uses a static ``fedtier`` user if one exists, which is how the node reads
a key only root and that group may read) and in a sandbox (``HARDENING``): no capabilities, no new
privileges, the file system read-only but for the state directory, private /tmp and /dev, only
IPv4, IPv6 and Unix sockets, the system calls of an ordinary service. ``systemd-analyze security
--offline=yes`` rates the units 1.x ("OK"; was 9.6 "UNSAFE" as root without a sandbox); the
suite checks it stays at or below ``MAX_EXPOSURE``.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

UNIT_DIR = Path("/etc/systemd/system")
DEFAULT_USER = "fedtier"
"""The service user (and group) of every unit unless ``--user`` says otherwise."""
MAX_EXPOSURE = 4.0
"""The highest ``systemd-analyze security`` exposure a generated unit may have (tested)."""
HOME_DIRS = ("/home", "/root", "/run/user")

HARDENING = (
    "NoNewPrivileges=yes",
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    "UMask=0077",
    "ProtectSystem=strict",
    "PrivateTmp=yes",
    "PrivateDevices=yes",
    "PrivateIPC=yes",
    "ProtectHostname=yes",
    "ProtectClock=yes",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectProc=invisible",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
    "RestrictNamespaces=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "LockPersonality=yes",
    "RemoveIPC=yes",
    "KeyringMode=private",
    "SystemCallArchitectures=native",
    "SystemCallFilter=@system-service",
    "SystemCallFilter=~@privileged",
    "SystemCallErrorNumber=EPERM",
)
"""The sandbox of every unit. Left out on purpose: ``MemoryDenyWriteExecute`` (libffi's closures,
used through cffi by ``cryptography``, and ONNX Runtime's kernels may need writable executable
memory), ``~@resources`` (ONNX Runtime and OpenMP pin threads with ``sched_setaffinity``),
``ProcSubset=pid`` (ONNX Runtime reads /proc/cpuinfo), ``PrivateNetwork``/``IPAddressDeny`` (a
node's broker and store may be anywhere) and ``PrivateUsers`` (a static ``fedtier`` group's read
access to the keys must keep working)."""


@dataclass(frozen=True)
class ServiceUnit:
    name: str
    """The unit's file name (``fedtier-agent-dev-00.service``)."""
    text: str
    user: str | None = None
    """The user the unit runs as (``None``: root)."""


def fedtier_command() -> list[str]:
    """How systemd runs fedtier: the ``fedtier`` script next to this interpreter, or ``python -m fedtier``."""
    script = Path(sys.executable).parent / "fedtier"
    if script.exists():
        return [str(script.absolute())]
    found = shutil.which("fedtier")
    return [found] if found else [str(Path(sys.executable).absolute()), "-m", "fedtier"]


def unit(*, role: str, node: str, args: Sequence[str], state_dir: str, user: str | None = DEFAULT_USER,
         description: str | None = None, command: Sequence[str] | None = None,
         writable: Sequence[str] = ()) -> ServiceUnit:
    """A systemd unit running ``fedtier <args>`` as node ``node`` of ``role``.

    Args:
        role: agent, edge or coordinator (names the unit and its state directory).
        node: the node's id (or another name that tells this unit apart on one machine).
        args: the fedtier arguments (``["agent", "run", "--config", "/etc/fedtier/dev-00.toml"]``).
        state_dir: ``StateDirectory=`` (relative to /var/lib).
        user: run as this user (``DynamicUser=yes``: allocated at start unless a static user of that
            name exists); ``None`` or ``"root"``: as root, still sandboxed.
        command: how to run fedtier (default ``fedtier_command()``).
        writable: directories beyond the state directory the node writes (``ReadWritePaths=``; the
            rest of the file system is read-only to it).
    """
    argv = [*(command or fedtier_command()), *args]
    exec_start = " ".join(shlex.quote(a) for a in argv)
    as_root = user in (None, "root")
    # A fedtier installed or configured under a home directory must stay visible (read-only).
    under_home = any(a.startswith(HOME_DIRS) for a in argv)
    header = [] if as_root else [
        f"# Runs as user {user} (DynamicUser=yes; a static user {user} is used if one exists), sandboxed: the",
        f"# files it reads (config, bundle, keys) must be readable by that user or group {user}",
        "# (docs/operations.md, \"Deploy the coordinator as a service\").",
    ]
    lines = [
        *header,
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
        *([] if as_root else [f"User={user}", f"Group={user}", "DynamicUser=yes"]),
        f"StateDirectory={state_dir}",
        "StateDirectoryMode=0700",
        "WorkingDirectory=%S/" + state_dir,
        f"Environment=HOME=%S/{state_dir}",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=30",
        "Environment=PYTHONUNBUFFERED=1",
        f"ProtectHome={'read-only' if under_home else 'yes'}",
        *([f"ReadWritePaths={' '.join(writable)}"] if writable else []),
        *HARDENING,
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return ServiceUnit(name=f"fedtier-{role}-{node}.service", text="\n".join(lines), user=None if as_root else user)


def install(service: ServiceUnit, unit_dir: Path = UNIT_DIR) -> Path:
    """Write the unit file; the operator then runs ``systemctl daemon-reload && systemctl enable --now``."""
    unit_dir.mkdir(parents=True, exist_ok=True)
    path = unit_dir / service.name
    path.write_text(service.text)
    return path


def readable_note(service: ServiceUnit, paths: Sequence[Path]) -> str:
    """What the operator must do so that the unit's user reads ``paths`` (a config, a bundle) and the
    files they name (keys, certificates, data); empty for a unit that runs as root."""
    if service.user is None:
        return ""
    user = service.user
    shown = " ".join(shlex.quote(str(p)) for p in paths) or "/etc/fedtier"
    exec_start = shlex.split(service.text.split("\nExecStart=", 1)[1].split("\n", 1)[0])
    home = [a for a in exec_start if a.startswith("/root")]
    lines = [f"the service runs as user {user} (DynamicUser=yes) in a sandbox; for it to read keys that only root "
             f"reads, create the user once and give its group read access to {shown} and the files it names:",
             f"  useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {user}",
             f"  chgrp -R {user} {shown} && chmod -R g+rX {shown}",
             "(--user root runs it as root, still sandboxed)"]
    if home:
        lines.append(f"warning: {home[0]} is under /root, which user {user} cannot enter: install fedtier elsewhere "
                     "(e.g. a venv in /opt/fedtier) or use --user root")
    return "\n".join(lines)
