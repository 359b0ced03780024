"""What an agent process loads: an agent of an unsigned, untrusted-noise-free fleet without TLS (the demo's)
imports neither cryptography (about 6 MB) nor torch (nor scikit-learn: a device ranks its held-out rows with numpy),
and loads cryptography as soon as a feature needs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

AGENT = """
import json, sys
from fedtier.cli import main  # the `fedtier agent run` path: the CLI, then the agent's own modules
import device_agent.run
from device_agent.trainers.ort_runtime import training_api
from fedtier.runtime import identity
from fedtier.runtime.config import BrokerConfig
from fedtier.security.signing import load_trusted_keys
training_api()
assert load_trusted_keys(()) == {{}} and identity.preflight("dev-0", [BrokerConfig(host="127.0.0.1", port=1883)])
import device_agent.node  # evaluates held-out rows, AUROC included (numpy only)
before = {{m: m in sys.modules for m in ("cryptography", "torch", "sklearn", "prometheus_client")}}
{use}
print(json.dumps({{"before": before, "after": "cryptography" in sys.modules}}))
"""


def _run(use: str) -> dict:
    out = subprocess.run([sys.executable, "-c", AGENT.format(use=use)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_agent_stack_imports_no_cryptography_until_a_feature_needs_it() -> None:
    hardened_noise = _run("from fedtier.privacy.mechanism import NoiseSource\n"
                          "NoiseSource().secure_normal((3,), 'label')")
    secure_aggregation = _run("from fedtier.secagg import crypto\ncrypto.public_key(crypto.new_private_key())")

    assert hardened_noise["before"] == {"cryptography": False, "torch": False, "sklearn": False,
                                        "prometheus_client": False}
    assert hardened_noise["after"] and secure_aggregation["after"]  # and they still work when needed


def test_prometheus_client_loads_only_to_render_or_serve_the_metrics() -> None:
    served = _run("from fedtier.runtime.metrics import Metrics\n"
                  "m = Metrics(node='dev-0')\nm.inc('fedtier_rejected_total', reason='x')\n"
                  "assert m.get('fedtier_rejected_total', reason='x') == 1.0\n"
                  "before['counted'] = 'prometheus_client' in sys.modules\n"
                  "assert 'fedtier_rejected_total{node=\"dev-0\",reason=\"x\"} 1.0' in m.render()\n"
                  "before['rendered'] = 'prometheus_client' in sys.modules")

    assert served["before"]["counted"] is False and served["before"]["rendered"] is True


MALLOC = """
import json, os, sys
from device_agent.run import share_one_malloc_arena
print(json.dumps(share_one_malloc_arena()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.parametrize("env_value, expected", [(None, True), ("4", False)])
def test_the_agent_shares_one_malloc_arena_unless_the_operator_set_one(env_value: str | None, expected: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if env_value is not None:
        env["MALLOC_ARENA_MAX"] = env_value
    out = subprocess.run([sys.executable, "-c", MALLOC], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=60, check=True)

    assert json.loads(out.stdout.strip().splitlines()[-1]) is expected
