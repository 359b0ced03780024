#!/usr/bin/env bash
# Install fedtier for development on this machine: Mosquitto (if missing, via apt-get),
# the CPU build of torch 2.13.0 (any other torch pulls several GB of CUDA packages),
# then fedtier with every extra. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
  echo "install.sh: installing Mosquitto with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q mosquitto
fi

PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install -q torch==2.13.0
"$PYTHON" -m pip install -q -e ".[all,dev]"
echo "install.sh: done ($("$PYTHON" -c 'import fedtier; print("fedtier", fedtier.__version__)'))" >&2
