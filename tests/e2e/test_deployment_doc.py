"""docs/deployment.md, run as written: its commands are read from the page, not copied here.

The page's conventions (an HTML comment at its top says the same): a ```toml or ```python block
whose first line is ``# file: NAME`` is written to NAME; each line of a ```bash block is a command, run in
one working directory — ``mosquitto -c``, ``fedtier edge run`` and ``fedtier agent run`` keep
running in the background, every other command must finish with exit code 0 (``fedtier
coordinator run`` when its rollout ended); ```text blocks are illustrations. The only change
made to the page's text is its broker ports, replaced by free ones so the test cannot collide
with anything else on the machine.

Asserted: your own data, split by ``fedtier data split``, reaches each device's bundle through
``provision fleet --shards``; every rollout the page runs (the built-in MLP, then your own model
from your own file) finishes with every device in every round, with the devices' federated
evaluation, and prints its summary; the models export as files that take the data's rows and say
so beside them, and the page's own script runs one on the CSV; the edge and the agents log the end
of each rollout and go idle; no node logs a WARNING or an ERROR in the whole healthy run, a clean
stop included; and no retained message of either rollout is left on either broker.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import free_port, mosquitto_binary, require, wait_port
from fleet_helpers import Procs, retained

pytestmark = [pytest.mark.slow, pytest.mark.broker]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment.md"
SERVICES = ("mosquitto -c ", "fedtier edge run ", "fedtier agent run ")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Step:
    kind: str  # "file" | "run"
    text: str
    name: str = ""


def steps(markdown: str) -> list[Step]:
    """The page's files and commands, in order."""
    out: list[Step] = []
    for lang, body in BLOCK.findall(markdown):
        if lang in ("toml", "python") and body.startswith("# file: "):
            first, _, rest = body.partition("\n")
            out.append(Step("file", rest, first.removeprefix("# file: ").strip()))
        elif lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    out.append(Step("run", line))
    return out


def with_free_ports(markdown: str) -> tuple[str, dict[int, int]]:
    """The page with each broker port it uses replaced by a free one."""
    # Brokers are what `--cell-broker CELL=127.0.0.1:PORT` and `[broker] port = PORT` name (not,
    # say, the dashboard's `--http 127.0.0.1:8080`).
    ports = sorted({int(p) for p in re.findall(r"=127\.0\.0\.1:(\d{4,5})\b", markdown)}
                   | {int(p) for p in re.findall(r"^port = (\d+)", markdown, re.M)})
    mapping = {p: free_port() for p in ports}
    for old, new in mapping.items():
        markdown = re.sub(rf"\b{old}\b", str(new), markdown)
    return markdown, mapping


def test_the_page_has_the_steps_a_deployment_needs() -> None:
    """Guards the parser: a page that lost its blocks would make the run below test nothing."""
    found = steps(DOC.read_text())
    commands = [s.text for s in found if s.kind == "run"]
    assert [s.name for s in found if s.kind == "file"] == ["rollout.toml", "mymodel.py", "rollout2.toml", "predict.py"]
    assert sum(c.startswith("fedtier data split ") for c in commands) == 1
    assert sum(c.startswith("fedtier provision fleet ") for c in commands) == 2
    assert "--shards shards" in next(c for c in commands if c.startswith("fedtier provision fleet "))
    assert sum(c.startswith("mosquitto -c ") for c in commands) == 2
    assert sum(c.startswith("fedtier agent run ") for c in commands) == 3
    assert sum(c.startswith("fedtier coordinator run ") for c in commands) == 2
    assert sum(c.startswith("fedtier coordinator export ") for c in commands) == 2
    assert 'factory = "mymodel.py:make_cnn"' in next(s.text for s in found if s.name == "rollout2.toml")


def test_the_deployment_page_runs_as_written(tmp_path: Path) -> None:
    require(mosquitto_binary() is not None, "Mosquitto (apt-get install mosquitto)")
    page, ports = with_free_ports(DOC.read_text())
    procs = Procs(tmp_path)
    outputs: dict[str, str] = {}  # command -> stdout
    logs: dict[str, str] = {}  # command -> stderr (the services' log lines)
    try:
        for n, step in enumerate(steps(page)):
            if step.kind == "file":
                (tmp_path / step.name).write_text(step.text)
                continue
            command = step.text
            if command.startswith(SERVICES):
                role = command.split()[1] if command.startswith("fedtier") else "broker"
                name = f"{role}-{sum(p.name.startswith(role) for p in procs.started)}"
                procs.start(name, command)
                if role == "broker":
                    wait_port(_port_of(tmp_path, command))
                continue
            procs.check_alive()
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=procs.env, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, f"step {n}: {command}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
            outputs[command] = done.stdout
            logs[command] = done.stderr
            (tmp_path / "logs").mkdir(exist_ok=True)
            (tmp_path / "logs" / f"step-{n:02d}.out").write_text(f"$ {command}\n{done.stdout}\n{done.stderr}")

        # Each device's bundle holds its shard of the split.
        for device in ("dev-00", "dev-01", "dev-02"):
            for part in ("train.npz", "eval/eval.npz"):
                placed = tmp_path / "site" / "devices" / device / "data" / part
                assert placed.read_bytes() == (tmp_path / "shards" / device / part).read_bytes(), placed
        # Every rollout finished with every device in every round, and said so.
        summaries = [out for cmd, out in outputs.items() if cmd.startswith("fedtier coordinator run ")]
        assert len(summaries) == 2
        for summary in summaries:
            rows = summary_rows(summary)
            assert [int(r["round"]) for r in rows] == list(range(5)), summary
            assert all(int(r["devices"]) == 3 for r in rows), summary
            assert all(0 <= float(r["fed acc"]) <= 1 for r in rows), summary  # the devices' held-out rows
            assert re.search(r"final accuracy\s+0\.\d+", summary) and "export the model" in summary
        final = float(re.findall(r"final accuracy\s+(\d\.\d+)", summaries[0])[0])
        assert final > 0.8, summaries[0]  # digits, 10 classes: chance is 0.1
        assert (tmp_path / "hand1.onnx").stat().st_size > 0
        # The second provisioning kept every identity.
        second = [out for cmd, out in outputs.items() if cmd.startswith("fedtier provision fleet ")][-1]
        assert "issued 0, kept 7" in second, second
        # Your own model's export takes the CSV's rows (it reshapes them to its (1, 64)) and says so.
        described = json.loads((tmp_path / "hand2.onnx.json").read_text())
        assert described["inputs"] == [{"name": "input", "shape": ["batch", 64], "dtype": "float32"}]
        assert described["example_shape"] == [1, 64] and described["rollout"] == "hand2"
        predicted = next(out for cmd, out in outputs.items() if cmd.startswith("python3 predict.py "))
        right = int(re.findall(r"1797 rows of 64 features; the label predicted right for (\d+)", predicted)[0])
        assert right > 0.8 * 1797, predicted

        edge = next(p for p in procs.started if p.name.startswith("edge"))
        agents = [p for p in procs.started if p.name.startswith("agent")]
        for rollout in ("hand1", "hand2"):
            assert f"rollout {rollout} ended: cleared its manifest in cell cell-a" in edge.text()
            for agent in agents:
                assert f"rollout {rollout} ended; idle until the next rollout" in agent.text(), agent.text()

        # A clean stop: every node exits 0.
        for p in [*agents, edge]:
            assert p.stop(signal.SIGINT) == 0, p.text()[-3000:]
        texts = {p.name: p.text() for p in procs.started if not p.name.startswith("broker")}
        texts |= {cmd: err for cmd, err in logs.items() if cmd.startswith("fedtier coordinator run ")}
        for name, text in texts.items():
            bad = [line for line in text.splitlines() if any(w in line for w in (" WARNING ", " ERROR ", "Traceback"))]
            assert bad == [], f"{name}:\n" + "\n".join(bad)

        # No retained message of either rollout is left on either broker (read with the stopped
        # edge's identity, which may read both its cell's downlink and the manifests).
        gateway = tmp_path / "site" / "gateways" / "cell-a"
        for port in ports.values():
            left = [t for t, _ in retained("127.0.0.1", port, gateway, "ft/v1/#") if not t.startswith("ft/v1/status/")]
            assert left == [], (port, left)
    finally:
        procs.close()


def summary_rows(summary: str) -> list[dict[str, str]]:
    """The per-round table of a coordinator's summary, as column -> cell (columns named as printed)."""
    lines = summary.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["round", "accuracy"])
    names = re.split(r"\s{2,}", lines[head].strip())
    rows = []
    for line in lines[head + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(names) or not cells[0].isdigit():
            break
        rows.append(dict(zip(names, cells, strict=True)))
    return rows


def _port_of(workdir: Path, command: str) -> int:
    conf = workdir / command.split("mosquitto -c ", 1)[1].strip()
    return int(re.search(r"^listener (\d+)", conf.read_text(), re.M).group(1))  # type: ignore[union-attr]
