"""``fedtier privacy plan`` and ``fedtier privacy report``, invoked on the group directly.

``report`` reads a real ledger: the real simulator runs the rollout once per module.
"""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from fedtier.rollout.config import RolloutConfig
from fleet_data.datasets import make_federated
from cloud_coordinator.privacy import accountant, ledger
from cloud_coordinator.privacy.calibrate import make_plan
from commands.privacy import privacy
from cloud_coordinator.store import CoordinatorStore
from fedtier.runtime.config import load

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rollout_toml(artifacts: Path, *, state_dir: str = "state", topology: str = "trusted = { cell-a = true }",
                 privacy_extra: str = "", privacy_section: bool = True) -> str:
    text = f"""
rollout = "dp"
algorithm = "fedavg"
rounds = 3
seed = 0
state_dir = "{state_dir}"
artifact_store = "{artifacts}"

[model]
hidden = [16]

[data]
dataset = "digits"

[topology]
cells = 2
devices_per_cell = 3
{topology}

[fedavg]
local_steps = 2
edge_rounds = 2
"""
    if privacy_section:
        text += f"""
[privacy]
epsilon = 8
clip = 1.0
require_tls = false
noise_seed = 1
{privacy_extra}
"""
    return text


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(privacy, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def run_json(*args: str | Path) -> Any:
    # stdout alone: a note on stderr (dp-accounting's convergence warnings, summarised) is not part of the JSON
    result = CliRunner().invoke(privacy, [str(a) for a in (*args, "--json")])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def samples(cfg: RolloutConfig) -> dict[str, int]:
    cells = cfg.topology.layout()
    devices = [d for m in cells.values() for d in m]
    data = make_federated(cfg.data, devices, cells)
    return {d: len(data.train[d][1]) for d in devices}


def node(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(n for n in doc["nodes"] if n["node"] == name)


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory, artifact_store: Path) -> dict[str, Any]:
    """Two real simulated rollouts: one that finishes, one the budget stops after its first round."""
    from local_fleet.simulate import simulate

    root = tmp_path_factory.mktemp("privacy-report")
    out: dict[str, Any] = {}
    for name, extra in (("finished", ""), ("stopped", "budget_epsilon = 5")):
        config = write(root / name / "rollout.toml", rollout_toml(artifact_store, privacy_extra=extra))
        cfg = load(RolloutConfig, config)
        result = simulate(cfg, workdir=cfg.state_dir)
        out[name] = {"config": config, "cfg": cfg, "rounds": result.rounds}
    out["root"] = root
    return out


# --- help -----------------------------------------------------------------------------------------


def test_help_of_the_group_and_its_commands_explains_every_option() -> None:
    code, out = run("--help")
    assert code == 0 and "plan" in out and "report" in out
    assert isinstance(privacy, click.Group)
    for name, command in privacy.commands.items():
        code, out = run(name, "--help")
        assert code == 0 and "--config" in out and "--json" in out, out
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                assert param.help and len(param.help) > 20, (name, param.name)


def test_the_plan_helps_example_runs_as_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 17 A6: the example names a config with a [privacy] section, from the repository root.
    root = Path(__file__).resolve().parents[3]
    code, out = run("plan", "--help")
    examples = [line.strip() for line in out.splitlines() if line.strip().startswith("fedtier privacy plan ")]
    assert examples
    monkeypatch.chdir(root)
    for example in examples:
        code, out = run(*example.split()[2:])
        assert code == 0, (example, out)
        assert "privacy plan of rollout" in out and "signal-to-noise" in out


# --- plan -----------------------------------------------------------------------------------------


def test_plan_shows_each_tiers_sigma_as_the_rollouts_noise_plan(tmp_path: Path, artifact_store: Path) -> None:
    config = write(tmp_path / "r.toml", rollout_toml(artifact_store))
    cfg = load(RolloutConfig, config)
    noise = make_plan(cfg, samples(cfg))
    doc = run_json("plan", "--config", config)

    assert doc["mode"] == "rdp" and doc["delta"] == 1e-5 and doc["budget_epsilon"] == 8
    assert doc["noise_plan"] == json.loads(json.dumps(noise.to_dict()))
    edge, device = node(doc, "cell-a"), node(doc, "dev-03")
    assert edge["injects"] and device["injects"]
    assert edge["sigma"] == pytest.approx(noise.edge_sigma("cell-a"), rel=1e-12)
    assert device["sigma"] == pytest.approx(noise.device_sigma("cell-b"), rel=1e-12)
    assert doc["tiers"]["edge"]["sigma_max"] == pytest.approx(noise.edge_sigma("cell-a"), rel=1e-12)
    assert doc["tiers"]["device"]["sigma_max"] == pytest.approx(noise.device_sigma("cell-b"), rel=1e-12)
    # Devices under the trusted cell send in clear; the untrusted cell adds nothing; nobody else does.
    assert [n["node"] for n in doc["nodes"] if n["injects"]] == ["cell-a", "dev-03", "dev-04", "dev-05"]
    assert not node(doc, "dev-00")["injects"] and node(doc, "dev-00")["sigma"] == 0
    # Releases per device by tier: tau * T under an untrusted cell, T from a trusted one.
    assert (device["releases"], edge["releases"]) == (2 * 3, 3)
    assert doc["tiers"]["device"]["epsilon"] == pytest.approx(
        accountant.epsilon([(noise.cells["cell-b"].device_z, 6)], 1e-5))
    assert doc["tiers"]["device"]["rounds_within_budget"] == 3 and not any("stop" in w for w in doc["warnings"])

    code, out = run("plan", "--config", config)
    assert code == 0, out
    assert f"{noise.edge_sigma('cell-a'):.6g}" in out and f"{noise.device_sigma('cell-b'):.6g}" in out
    assert "dev-00..dev-02 (3 devices)" in out and "dev-03..dev-05 (3 devices)" in out
    assert "dev-04" not in out.replace("dev-03..dev-05", "")  # collapsed, not listed one by one
    assert "not declared (untrusted by default)" in out and "require_tls = false" in out


def test_paper_mode_edge_sigma_is_device_sigma_over_members_and_warns_of_the_heuristic(
        tmp_path: Path, artifact_store: Path) -> None:
    config = write(tmp_path / "r.toml", rollout_toml(artifact_store, privacy_extra='calibration = "paper"'))
    doc = run_json("plan", "--config", config)

    edge, device = node(doc, "cell-a"), node(doc, "dev-03")
    assert edge["sigma"] == pytest.approx(device["sigma"] / 3, rel=1e-12)  # Lemma 1: 2C/n vs 2C
    # One multiplier for every tier in paper mode, but the edge's release is charged against the sound
    # sensitivity 2C (1/3 + 1) of a cell that syncs twice a round: z (1/3) / (1/3 + 1) = z / 4.
    assert edge["sensitivity"] == pytest.approx(2 * (1 / 3 + 1), rel=1e-12)
    assert edge["z"] == pytest.approx(device["z"] / 4, rel=1e-12)
    assert doc["tiers"]["edge"]["epsilon"] == pytest.approx(accountant.epsilon([(edge["z"], 3)], 1e-5))
    # The heuristic z gives a much larger RDP epsilon than its target: the budget stops the rollout at once.
    z = device["z"]
    assert doc["tiers"]["device"]["epsilon"] == pytest.approx(accountant.epsilon([(z, 6)], 1e-5))
    assert doc["tiers"]["device"]["epsilon"] > 8
    assert accountant.epsilon([(z, 2)], 1e-5) > 8 and doc["tiers"]["device"]["rounds_within_budget"] == 0

    code, out = run("plan", "--config", config)
    assert code == 0 and "HEURISTIC" in out and "will not run a single round" in out
    assert f"device tier {doc['tiers']['device']['epsilon']:.4g}" in out


def test_a_deeper_tree_is_planned_with_trust_by_closure(tmp_path: Path, artifact_store: Path) -> None:
    topology = ('trusted = { region = true, cell-a = true }\n'
                'parents = { cell-a = "region", cell-b = "region" }')
    config = write(tmp_path / "r.toml", rollout_toml(artifact_store, topology=topology))
    doc = run_json("plan", "--config", config)

    region, cell_a, cell_b = node(doc, "region"), node(doc, "cell-a"), node(doc, "cell-b")
    assert region["declared"] is True and region["trusted"] is False and "closure" in region["why"]
    assert not region["injects"] and region["layer"] == 1 and region["parent"] == "cloud"
    assert cell_a["trusted"] and cell_a["injects"] and cell_a["parent"] == "region" and cell_a["layer"] == 2
    assert cell_b["declared"] is None and not cell_b["trusted"] and not cell_b["injects"]
    assert all(node(doc, d)["injects"] for d in ("dev-03", "dev-04", "dev-05"))
    assert doc["noise_plan"] is None  # rollouts run two tiers; the rows are the plan

    code, out = run("plan", "--config", config)
    assert code == 0 and "untrusted by closure (child 'cell-b' is)" in out and "intermediate servers" in out


def test_plan_predicts_the_budget_stop(ran: dict[str, Any]) -> None:
    doc = run_json("plan", "--config", ran["stopped"]["config"])
    assert doc["tiers"]["device"]["rounds_within_budget"] == 1 == len(ran["stopped"]["rounds"])
    assert any("will stop before round 1 (1 of 3 rounds run)" in w for w in doc["warnings"])


def test_plan_without_a_privacy_section_is_a_usage_error_naming_it(tmp_path: Path, artifact_store: Path) -> None:
    config = write(tmp_path / "r.toml", rollout_toml(artifact_store, privacy_section=False))
    code, out = run("plan", "--config", config)
    assert code == 2 and "[privacy]" in out and str(config) in out


def test_a_bad_config_is_a_usage_error_naming_the_key(tmp_path: Path, artifact_store: Path) -> None:
    config = write(tmp_path / "r.toml", rollout_toml(artifact_store, topology="trusted = { cloud = true }"))
    code, out = run("plan", "--config", config)
    assert code == 2 and "topology.trusted.cloud" in out and "never trusted" in out


# --- report ---------------------------------------------------------------------------------------


def test_report_recomputes_every_devices_epsilon_as_the_live_ledger(ran: dict[str, Any]) -> None:
    cfg, rounds = ran["finished"]["cfg"], ran["finished"]["rounds"]
    doc = run_json("report", "--config", ran["finished"]["config"], "--out", ran["root"] / "a.png")

    live = rounds[-1]["privacy"]["epsilon"]
    assert {d["device"]: d["live_epsilon"] for d in doc["devices"]} == live
    assert {d["device"]: d["epsilon"] for d in doc["devices"]} == pytest.approx(live, rel=1e-9)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    try:
        assert {d["device"]: d["epsilon"] for d in doc["devices"]} == ledger.recompute(store, "dp", 1e-5)
    finally:
        store.close()
    assert all(d["agrees"] for d in doc["devices"]) and doc["warnings"] == []
    # Round by round, from the rows alone, equal to what the coordinator reported live.
    assert [p["round"] for p in doc["rounds"]] == [0, 1, 2]
    assert [p["epsilon_max"] for p in doc["rounds"]] == pytest.approx(
        [r["privacy"]["epsilon_max"] for r in rounds], rel=1e-9)
    assert doc["rounds"][0]["epsilon_max"] < doc["rounds"][1]["epsilon_max"] < doc["rounds"][2]["epsilon_max"]
    assert doc["rounds"][-1]["epsilon_max"] <= 8 * (1 + 1e-9)


def test_report_tiers_clear_hops_and_status(ran: dict[str, Any]) -> None:
    doc = run_json("report", "--config", ran["finished"]["config"], "--out", ran["root"] / "b.png")

    tiers = {t["tier"]: t for t in doc["tiers"]}
    assert tiers["device"]["cells"] == ["cell-b"] and tiers["device"]["devices"] == 3
    assert tiers["device"]["releases"] == 3 * 2 * 3 and tiers["device"]["releases_per_device_max"] == 6
    assert tiers["edge"]["cells"] == ["cell-a"] and tiers["edge"]["devices"] == 3 and tiers["edge"]["releases"] == 3
    assert doc["releases"] == {"total": 21, "observed": 21, "unobserved": 0}
    # Each device of the trusted cell sends one clear update per edge round, all to cell-a.
    assert doc["clear_hops"]["total"] == 3 * 2 * 3 and doc["clear_hops"]["all_to_trusted"]
    assert doc["clear_hops"]["receivers"] == ["cell-a"]
    assert doc["status"] == "finished" and doc["rounds_closed"] == doc["rounds_planned"] == 3
    assert doc["stopped"] is None

    code, out = run("report", "--config", ran["finished"]["config"], "--out", ran["root"] / "b.png")
    assert code == 0 and "finished: 3 of 3 rounds closed" in out and "all to trusted cells" in out
    assert "MISMATCH" not in out and "warnings" not in out


def test_report_shows_accuracy_beside_epsilon_per_round(ran: dict[str, Any]) -> None:
    # Issue 17 A6: what each round's privacy bought.
    rounds = ran["finished"]["rounds"]
    doc = run_json("report", "--config", ran["finished"]["config"], "--out", ran["root"] / "acc.png")
    assert [p["accuracy"] for p in doc["rounds"]] == [r["accuracy"] for r in rounds]
    code, out = run("report", "--config", ran["finished"]["config"], "--out", ran["root"] / "acc.png")
    table = out[out.index("epsilon after each round"):]
    header = table.splitlines()[1].split()
    assert header[:3] == ["round", "accuracy", "releases"]
    first = table.splitlines()[2].split()
    assert first[:2] == ["0", f"{rounds[0]['accuracy']:.4f}"]  # rounds from 0


def test_report_writes_the_epsilon_plot(ran: dict[str, Any]) -> None:
    cfg = ran["finished"]["cfg"]
    default = cfg.state_dir / "privacy_epsilon.png"
    code, out = run("report", "--config", ran["finished"]["config"])
    assert code == 0 and f"plot: {default}" in out
    data = default.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_report_from_the_database_alone(ran: dict[str, Any]) -> None:
    cfg = ran["finished"]["cfg"]
    db = cfg.state_dir / "coordinator.db"
    by_config = run_json("report", "--config", ran["finished"]["config"], "--out", ran["root"] / "c.png")
    by_db = run_json("report", "--db", db, "--rollout", "dp", "--out", ran["root"] / "d.png")
    for key in ("devices", "tiers", "rounds", "releases", "clear_hops", "status", "delta", "budget_epsilon"):
        assert by_db[key] == by_config[key], key


def test_report_of_a_rollout_the_budget_stopped(ran: dict[str, Any]) -> None:
    doc = run_json("report", "--config", ran["stopped"]["config"])
    assert doc["status"] == "stopped" and doc["rounds_closed"] == 1 and doc["budget_epsilon"] == 5
    assert doc["stopped"].startswith("privacy budget") and "> budget 5" in doc["stopped"]
    assert doc["epsilon_max"] <= 5
    code, out = run("report", "--config", ran["stopped"]["config"])
    assert code == 0 and "STOPPED early after 1 of 3 rounds: privacy budget" in out


def copy_db(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(src)) as a, closing(sqlite3.connect(dst)) as b:
        a.backup(b)
    return dst


def test_a_tampered_ledger_is_flagged(ran: dict[str, Any], tmp_path: Path) -> None:
    db = copy_db(ran["finished"]["cfg"].state_dir / "coordinator.db", tmp_path / "coordinator.db")
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE privacy_releases SET noise_multiplier = noise_multiplier * 2 "
                     "WHERE node = 'dev-04' AND round = 1")
    doc = run_json("report", "--db", db, "--rollout", "dp")
    flagged = [d["device"] for d in doc["devices"] if not d["agrees"]]
    assert flagged == ["dev-04"] and any("dev-04" in w for w in doc["warnings"])
    assert (tmp_path / "privacy_epsilon.png").read_bytes().startswith(PNG_MAGIC)  # default: next to the db
    code, out = run("report", "--db", db, "--rollout", "dp")
    assert code == 0 and "MISMATCH" in out


def test_report_errors_name_the_path(ran: dict[str, Any], tmp_path: Path, artifact_store: Path) -> None:
    config = write(tmp_path / "r.toml", rollout_toml(artifact_store, state_dir="never-ran"))
    code, out = run("report", "--config", config)
    assert code == 2 and str(tmp_path / "never-ran" / "coordinator.db") in out

    code, out = run("report", "--db", tmp_path / "missing.db", "--rollout", "dp")
    assert code == 2 and str(tmp_path / "missing.db") in out

    code, out = run("report", "--db", config, "--rollout", "dp")
    assert code == 2 and "not a coordinator database" in out
    assert config.read_text().startswith("\nrollout")  # untouched

    db = ran["finished"]["cfg"].state_dir / "coordinator.db"
    code, out = run("report", "--db", db, "--rollout", "other")
    assert code == 2 and "'other'" in out and str(db) in out

    code, out = run("report", "--db", db)
    assert code == 2 and "--rollout" in out

    empty = copy_db(db, tmp_path / "empty" / "coordinator.db")
    with closing(sqlite3.connect(empty)) as conn, conn:
        conn.execute("DELETE FROM privacy_releases")
    code, out = run("report", "--db", empty, "--rollout", "dp")
    assert code == 2 and "no privacy-ledger rows" in out and str(empty) in out


def test_a_trusted_cell_device_that_never_reported_is_listed_alike_by_ledger_and_live(
        tmp_path: Path, artifact_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 17 A4: dev-00 of the trusted cell never takes part (its cell closes on a quorum). The live ledger lists
    # every member, so the offline recomputation must too: the trusted cell's release is charged to every member,
    # reported or not (as untrusted cells' planned releases are), and nothing is flagged.
    from local_fleet.simulate import simulate
    from device_agent.node import DeviceNode

    run_task = DeviceNode._run_task
    monkeypatch.setattr(DeviceNode, "_run_task",
                        lambda self, task, now: None if self.device_id == "dev-00" else run_task(self, task, now))
    # quorum 0.6: 2 of a cell's 3 devices, and both cells at the cloud (so cell-a's release is observed).
    text = rollout_toml(artifact_store).replace("edge_rounds = 2", "edge_rounds = 2\nquorum = 0.6\ndeadline_s = 5")
    config = write(tmp_path / "r.toml", text)
    cfg = load(RolloutConfig, config)
    result = simulate(cfg, workdir=cfg.state_dir)
    assert len(result.rounds) == 3 and all(r["missing"] == ["dev-00"] for r in result.rounds)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    edge_rows = [r for r in store.privacy_releases("dp") if r["event"] == "edge"]
    store.close()
    assert len(edge_rows) == 3 and all(r["observed"] for r in edge_rows)

    doc = run_json("report", "--config", config)
    by_device = {d["device"]: d for d in doc["devices"]}
    assert set(by_device) == {f"dev-0{i}" for i in range(6)}
    assert by_device["dev-00"]["epsilon"] == pytest.approx(by_device["dev-01"]["epsilon"], rel=1e-12)
    assert by_device["dev-00"]["epsilon"] > 0
    assert all(d["agrees"] for d in doc["devices"]) and all(p["agrees"] for p in doc["rounds"])
    assert doc["warnings"] == []
    code, out = run("report", "--config", config)
    assert code == 0 and "MISMATCH" not in out


def test_a_secure_cell_that_aborts_below_s_min_charges_no_device_and_the_report_agrees(
        tmp_path: Path, artifact_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 31: distributed DP under secure aggregation, cells of 3 with s_min 3. dev-00 sits out round 1, so
    # cell-a's keys phase closes with 2 < 3 and the cell aborts: no sum exists, and its abort report reaches the
    # cloud within the round. The ledger charges nobody for cell-a's round 1 — its devices' epsilon stays where
    # round 0 left it, cell-b's grows — and the report, recomputed from the rows, agrees with the live ledger.
    from local_fleet.simulate import simulate
    from device_agent.node import DeviceNode

    run_task = DeviceNode._run_task
    monkeypatch.setattr(DeviceNode, "_run_task", lambda self, task, now: None if (
        self.device_id == "dev-00" and task.round == 1) else run_task(self, task, now))
    text = rollout_toml(artifact_store, topology="").replace(
        "edge_rounds = 2", "edge_rounds = 1\nquorum = 0.5\ndeadline_s = 5\nsecure_aggregation = true\n"
        "secagg_min_survivors = 3\nsecagg_clip = 100.0")
    config = write(tmp_path / "r.toml", text)
    cfg = load(RolloutConfig, config)
    result = simulate(cfg, workdir=cfg.state_dir)
    assert [sorted(r["cells"]["cell-a"]["reported"]) for r in result.rounds] == [
        ["dev-00", "dev-01", "dev-02"], [], ["dev-00", "dev-01", "dev-02"]]
    assert result.rounds[1]["cells"]["cell-a"]["secagg"] == {
        "waited": {"keys": ["dev-00"]}, "aborted": {"phase": "keys", "reason": "too_few_keys", "have": 2, "need": 3}}
    eps = [r["privacy"]["epsilon"] for r in result.rounds]
    cell_a, cell_b = ["dev-00", "dev-01", "dev-02"], ["dev-03", "dev-04", "dev-05"]
    assert all(eps[1][d] == eps[0][d] > 0 for d in cell_a)  # round 1 released nothing of cell-a: unchanged
    assert all(eps[1][d] > eps[0][d] for d in cell_b)
    assert all(eps[2][d] > eps[1][d] for d in cell_a + cell_b)
    assert all(eps[2][a] < eps[2][b] for a in cell_a for b in cell_b)
    store = CoordinatorStore(cfg.state_dir / "coordinator.db")
    try:
        rows = store.privacy_releases("dp")
    finally:
        store.close()
    assert sorted((r["round"], r["node"]) for r in rows) == [(0, "cell-a"), (0, "cell-b"), (1, "cell-b"),
                                                             (2, "cell-a"), (2, "cell-b")]
    doc = run_json("report", "--config", config, "--out", tmp_path / "eps.png")
    assert {d["device"]: d["epsilon"] for d in doc["devices"]} == pytest.approx(eps[-1], rel=1e-9)
    assert all(d["agrees"] for d in doc["devices"]) and all(p["agrees"] for p in doc["rounds"])
    assert doc["warnings"] == []


def test_plan_warns_when_the_noise_will_destroy_the_rollout(tmp_path: Path, artifact_store: Path) -> None:
    # Issue 17 A6, tried as a new user would: 2 devices under an untrusted cell, epsilon 8, clip 1, 15 rounds. The
    # plan's sigma is 4.94; on the digits MLP (M = 64*64+64 + 64*10+10 = 4810 parameters) the cell's mean carries
    # noise of norm ~4.94 sqrt(4810 / 2) = 242 against a clipped signal of at most 1 per round.
    text = rollout_toml(artifact_store, topology="").replace("rounds = 3", "rounds = 15") \
        .replace("cells = 2\ndevices_per_cell = 3", "cells = 1\ndevices_per_cell = 2") \
        .replace("local_steps = 2\nedge_rounds = 2", "local_steps = 2\nedge_rounds = 1") \
        .replace("[model]\nhidden = [16]", "[model]\nhidden = [64]")
    config = write(tmp_path / "r.toml", text)
    doc = run_json("plan", "--config", config)
    assert doc["tiers"]["device"]["sigma_max"] == pytest.approx(4.94, abs=0.005)
    snr = doc["signal_to_noise"]
    assert snr["parameters"] == 4810 and snr["edge"] is None
    assert snr["cloud"]["signal"] == 1.0
    assert snr["cloud"]["noise"] == pytest.approx(doc["tiers"]["device"]["sigma_max"] * math.sqrt(4810 / 2), rel=1e-9)
    assert snr["device"]["snr"] == pytest.approx(snr["cloud"]["snr"]) and snr["dominant"] == "device"
    assert snr["rollout_snr"] == pytest.approx(snr["cloud"]["snr"] * math.sqrt(15))
    (warning,) = [w for w in doc["warnings"] if "noise dominates" in w]
    assert "will likely not learn" in warning
    for remedy in ("more devices per untrusted cell", "trusted edges", "a larger epsilon (now 8)", "sampling"):
        assert remedy in warning
    code, out = run("plan", "--config", config)
    assert code == 0 and "WARNING: noise dominates" in out and "signal-to-noise" in out


def test_plan_names_the_sync_when_trusted_cells_dominate_and_is_quiet_when_the_noise_is_small(
        tmp_path: Path, artifact_store: Path) -> None:
    both = "trusted = { cell-a = true, cell-b = true }"
    doc = run_json("plan", "--config", write(tmp_path / "a.toml", rollout_toml(artifact_store, topology=both)))
    (warning,) = [w for w in doc["warnings"] if "noise dominates" in w]
    assert doc["signal_to_noise"]["dominant"] == "edge" and "edge_rounds = 1" in warning
    assert "more devices per untrusted cell" not in warning
    generous = rollout_toml(artifact_store, topology=both, privacy_extra="").replace("epsilon = 8", "epsilon = 1e5")
    doc = run_json("plan", "--config", write(tmp_path / "b.toml", generous))
    assert doc["signal_to_noise"]["rollout_snr"] > 5 and not any("noise dominates" in w for w in doc["warnings"])
