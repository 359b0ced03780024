#!/usr/bin/env bash
# Install fedtier for development on this machine: Mosquitto, Chromium, PostgreSQL, promtool and
# systemd-analyze (if missing, via apt-get),
# the CPU build of torch 2.13.0 (any other torch pulls several GB of CUDA packages),
# then fedtier with every extra; and .venv-portable/, a small second environment set up as
# a board without onnxruntime-training has it (stock onnxruntime, no torch), in which tests
# run the portable trainer and demo agents. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  echo "install.sh: installing Mosquitto with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q mosquitto
fi

# Headless Chromium for the dashboard's browser test (driven by Playwright at /usr/bin/chromium).
if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
  echo "install.sh: installing Chromium with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
fi

# A PostgreSQL server for the store tests: they start their own (initdb + pg_ctl in a temporary
# directory, on a free port), so only the binaries are needed; nothing here configures a cluster.
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "install.sh: installing PostgreSQL with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q postgresql
fi

# promtool (Debian's prometheus package) checks and unit-tests the alerting rules in deploy/prometheus/;
# systemd-analyze rates the sandbox of the units `install-service` writes. Only the binaries are
# used (on a machine run by systemd the package also starts a Prometheus server; nothing here uses it).
if ! command -v promtool >/dev/null 2>&1; then
  echo "install.sh: installing promtool (Prometheus) with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends prometheus
fi
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "install.sh: installing systemd-analyze (systemd) with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q systemd
fi

PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install -q torch==2.13.0
"$PYTHON" -m pip install -q -e ".[all,dev]"

# The device environment of a board without an onnxruntime-training wheel (Linux aarch64,
# Python 3.13+), on this machine: the stock onnxruntime and the agent's other dependencies
# (what `pip install fedtier[agent]` resolves to there; tests/unit/device_agent/test_portable_env.py
# checks that against pyproject.toml), fedtier itself without dependencies. Never torch,
# never onnxruntime-training (both provide the `onnxruntime` package).
PORTABLE_VENV=.venv-portable
if [ ! -x "$PORTABLE_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$PORTABLE_VENV"
fi
"$PORTABLE_VENV/bin/python" -m pip install -q "onnxruntime>=1.17" "numpy>=1.24" "msgpack>=1.0" "click>=8.1" \
  "cryptography>=42" "paho-mqtt>=2.1,<3" "prometheus-client>=0.18"
"$PORTABLE_VENV/bin/python" -m pip install -q --no-deps -e .
echo "install.sh: done ($("$PYTHON" -c 'import fedtier; print("fedtier", fedtier.__version__)'))" >&2
