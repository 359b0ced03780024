"""`fedtier provision fleet`: every node of a rollout's topology, its brokers and a ready rollout file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import require, system_user
from test_fleet_cli import allowed

from fedtier.rollout.config import RolloutConfig
from device_agent.config import DeviceConfig
from edge_broker.config import EdgeConfig
from fedtier.errors import ConfigError
from fedtier.runtime.config import load
from fedtier.transport import topics
from provisioning import broker_config
from provisioning.cli import provision
from provisioning.errors import NameConflictError
from provisioning.fleet import Fleet
from provisioning.rollout import provision_fleet, rebase_paths

ROLLOUT = """rollout = "r1"
rounds = 2
artifact_store = "store"
[model]
kind = "mlp"
hidden = [8]
[data]
dataset = "digits"
[topology.members]
{members}
[broker]
host = "cloud.example"
port = 8883
keepalive_s = 20
"""
TWO_CELLS = 'cell-a = ["d0", "d1"]\ncell-b = ["d2"]'


def rollout_file(directory: Path, members: str = TWO_CELLS, name: str = "rollout.toml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(ROLLOUT.format(members=members))
    return path


def rules(acl: str) -> list[str]:
    return [line for line in acl.splitlines() if line and not line.startswith("#")]


def test_one_shared_broker_serves_every_node_with_one_acl(tmp_path: Path) -> None:
    result = provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "site")
    assert sorted(result.brokers) == ["shared"]
    acl = (Path(result.brokers["shared"]["dir"]) / "fedtier.acl").read_text()
    demo = broker_config.combined_acl(["cell-a", "cell-b"], "cloud", {"d0": "cell-a", "d1": "cell-a", "d2": "cell-b"})
    assert rules(acl) == rules(demo)  # the same writer as `fedtier demo --secure`'s shared broker
    r = "r1"
    # The coordinator's topics, which a per-cell ACL lacks (what made one shared broker hang).
    assert allowed(acl, "cloud", "write", topics.manifest(r))
    assert allowed(acl, "cloud", "write", topics.cloud_down(r, "cell-b", "cell_task"))
    assert allowed(acl, "cloud", "read", topics.edge_up(r, "cell-a", "cell_update"))
    # Each edge on both of its sides, over its one connection; each device in its own cell only.
    for cell, device in (("cell-a", "d0"), ("cell-b", "d2")):
        assert allowed(acl, cell, "read", topics.manifest(r))
        assert allowed(acl, cell, "write", topics.edge_up(r, cell, "cell_update"))
        assert allowed(acl, cell, "write", topics.cell_down(r, cell, "device_task"))
        assert allowed(acl, device, "write", topics.cell_up(r, cell, device, "device_update"))
    assert not allowed(acl, "d0", "write", topics.cell_up(r, "cell-b", "d0", "device_update"))
    assert not allowed(acl, "d0", "read", topics.cell_down(r, "cell-b", "device_task"))
    assert allowed(acl, "d0", "read", topics.status("d0")) and not allowed(acl, "d0", "read", topics.status("d1"))
    conf = Path(result.brokers["shared"]["conf"]).read_text()
    assert "use_identity_as_username true" in conf and "use_username_as_clientid true" in conf
    assert "listener 8883 0.0.0.0" in conf
    # Every node's config points at the shared broker; an edge then uses one connection.
    edge = load(EdgeConfig, result.gateways["cell-a"] / "edge.toml")
    assert edge.cell_broker == edge.cloud_broker and edge.cell_broker.host == "cloud.example"
    assert load(DeviceConfig, result.devices["d2"] / "device.toml").cell == "cell-b"


def test_a_broker_per_gateway_gets_its_cell_and_the_cloud_broker_the_rest(tmp_path: Path) -> None:
    result = provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "site",
                             cell_brokers={"cell-a": ("10.0.0.5", 8883)})
    assert sorted(result.brokers) == ["cell-a", "cloud"]
    cell_acl = (Path(result.brokers["cell-a"]["dir"]) / "fedtier.acl").read_text()
    cloud_acl = (Path(result.brokers["cloud"]["dir"]) / "fedtier.acl").read_text()
    r = "r1"
    assert allowed(cell_acl, "d0", "write", topics.cell_up(r, "cell-a", "d0", "device_update"))
    assert not allowed(cell_acl, "cloud", "write", topics.manifest(r)) and "user d2" not in cell_acl
    assert allowed(cloud_acl, "cloud", "write", topics.manifest(r))
    assert allowed(cloud_acl, "cell-a", "write", topics.edge_up(r, "cell-a", "cell_update"))
    assert not allowed(cloud_acl, "cell-a", "write", topics.cell_down(r, "cell-a", "device_task"))
    assert allowed(cloud_acl, "d2", "write", topics.cell_up(r, "cell-b", "d2", "x"))  # cell-b has no broker of its own
    assert "user d0" not in cloud_acl
    edge = load(EdgeConfig, result.gateways["cell-a"] / "edge.toml")
    assert (edge.cell_broker.host, edge.cloud_broker.host) == ("10.0.0.5", "cloud.example")
    assert load(DeviceConfig, result.devices["d0"] / "device.toml").broker.host == "10.0.0.5"


def test_the_coordinators_rollout_file_is_ready_and_keeps_meaning_the_same_files(tmp_path: Path) -> None:
    source = rollout_file(tmp_path / "cfg")
    result = provision_fleet(source, tmp_path / "site")
    cfg = load(RolloutConfig, result.rollout_config)
    assert result.rollout_config == tmp_path / "site" / "coordinator" / "r1.toml"
    assert cfg.signing_key == result.fleet / "signing.key" and cfg.cloud_id == "cloud"
    assert cfg.broker.tls_cert == tmp_path / "site" / "coordinator" / "cert.pem"
    assert (cfg.broker.host, cfg.broker.port, cfg.broker.keepalive_s) == ("cloud.example", 8883, 20)
    assert cfg.artifact_store == tmp_path / "cfg" / "store"  # relative to the original file, as before
    assert cfg.state_dir == tmp_path / "site" / "coordinator" / "state"
    assert cfg.metrics_path == tmp_path / "site" / "coordinator" / "metrics" / "r1.json"


def test_rebase_paths_follows_nested_sections_and_lists() -> None:
    raw = {"state_dir": "s", "signing_key": "/abs/k", "broker": {"tls_ca": "ca.pem", "host": "h"}, "rounds": 3}
    out = rebase_paths(RolloutConfig, raw, Path("/base"))
    assert out == {"state_dir": "/base/s", "signing_key": "/abs/k", "broker": {"tls_ca": "/base/ca.pem", "host": "h"},
                   "rounds": 3}


def test_a_factory_file_and_a_sqlite_store_relative_to_the_rollout_file_keep_meaning_them(tmp_path: Path) -> None:
    # Issue 34: `factory = "mymodel.py:make_mlp"` was left relative, then resolved against site/coordinator/.
    source = rollout_file(tmp_path / "cfg")
    (tmp_path / "cfg" / "mymodel.py").write_text("def make_mlp():\n    raise NotImplementedError\n")
    text = source.read_text().replace('kind = "mlp"\nhidden = [8]', 'kind = "torch"\nfactory = "mymodel.py:make_mlp"')
    source.write_text('store = "sqlite:///db/coordinator.db"\n' + text)

    result = provision_fleet(source, tmp_path / "site")

    cfg = load(RolloutConfig, result.rollout_config)
    assert cfg.model.factory == f"{tmp_path / 'cfg' / 'mymodel.py'}:make_mlp"
    assert cfg.store == f"sqlite:///{tmp_path / 'cfg' / 'db' / 'coordinator.db'}"
    assert load(RolloutConfig, source).model.factory == cfg.model.factory  # as the original file means it
    raw = {"model": {"factory": "m.py:f"}, "store": "sqlite:///s.db"}
    assert rebase_paths(RolloutConfig, raw, Path("/base")) == {"model": {"factory": "/base/m.py:f"},
                                                               "store": "sqlite:////base/s.db"}
    kept = {"model": {"factory": "package.module:f"}, "store": "postgresql://u@h:5432/db"}
    assert rebase_paths(RolloutConfig, kept, Path("/base")) == kept


def test_running_it_again_keeps_every_identity_and_issues_only_what_is_new(tmp_path: Path) -> None:
    first = provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "site")
    assert len(first.issued) == 1 + 2 + 3 + 1  # coordinator, gateways, devices, broker
    serial = (first.devices["d0"] / "cert.pem").read_bytes()
    second = provision_fleet(rollout_file(tmp_path / "cfg", name="r2.toml"), tmp_path / "site")
    assert second.issued == [] and len(second.kept) == 7
    assert (second.devices["d0"] / "cert.pem").read_bytes() == serial
    third = provision_fleet(rollout_file(tmp_path / "cfg", 'cell-a = ["d0", "d1", "d3"]\ncell-b = ["d2"]'),
                            tmp_path / "site")
    assert third.issued == ["device d3"]
    assert "user d3" in (Path(third.brokers["shared"]["dir"]) / "fedtier.acl").read_text()
    fourth = provision_fleet(rollout_file(tmp_path / "cfg", 'cell-a = ["d0"]\ncell-b = ["d2"]'), tmp_path / "site")
    assert fourth.departed == ["d1", "d3"]  # listed, not revoked
    assert not any(r.revoked for r in Fleet(fourth.fleet).records())


def test_every_node_issued_or_reissued_is_named_with_its_reason(tmp_path: Path) -> None:
    source = rollout_file(tmp_path / "cfg")
    first = provision_fleet(source, tmp_path / "site")
    assert first.reasons["device d0"] == "new: the fleet has issued it nothing yet"
    assert first.reasons["broker shared"].startswith("new: no broker.pem and broker.key in ")
    (first.devices["d1"] / "cert.pem").unlink()
    runner = CliRunner()

    out = runner.invoke(provision, ["fleet", "--rollout", str(source), "--out", str(tmp_path / "site"),
                                    "--cell-broker", "cell-b=10.0.0.7:8883"])

    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert "issued 5, kept 3" in lines[0]  # kept: the coordinator, gateway cell-a, device d0
    reissued = "  reissued (a new key and certificate; install this bundle)"
    brokers = tmp_path / "site" / "brokers"
    assert lines[1:6] == [
        f"{reissued} device d1: its bundle in {tmp_path / 'site' / 'devices' / 'd1'} lacks cert.pem",
        f"{reissued} gateway cell-b: its broker changed (cloud.example:8883 -> 10.0.0.7:8883)",
        f"{reissued} device d2: its broker changed (cloud.example:8883 -> 10.0.0.7:8883)",
        f"  issued broker cloud: new: no broker.pem and broker.key in {brokers / 'cloud'} yet",
        f"  issued broker cell-b: new: no broker.pem and broker.key in {brokers / 'cell-b'} yet",
    ]
    doc = json.loads((tmp_path / "site" / "fleet.json").read_text())
    assert doc["reasons"]["device d2"] == "its broker changed (cloud.example:8883 -> 10.0.0.7:8883)"


def test_moving_an_active_device_to_another_cell_is_refused(tmp_path: Path) -> None:
    provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "site")
    with pytest.raises(NameConflictError, match="revoke it before moving"):
        provision_fleet(rollout_file(tmp_path / "cfg", 'cell-a = ["d1"]\ncell-b = ["d2", "d0"]'), tmp_path / "site")


def test_bad_cell_brokers_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cell-z"):
        provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "site", cell_brokers={"cell-z": ("h", 1)})
    with pytest.raises(ConfigError, match="share an address"):
        provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "site",
                        cell_brokers={"cell-a": ("cloud.example", 8883)})


def test_sample_data_is_each_devices_share_of_the_coordinators_split(tmp_path: Path) -> None:
    from fleet_data.datasets import make_federated

    source = rollout_file(tmp_path / "cfg")
    result = provision_fleet(source, tmp_path / "site", sample_data=True)
    cfg = load(RolloutConfig, source)
    cells = cfg.topology.layout()
    expected = make_federated(cfg.data, [d for ds in cells.values() for d in ds], cells)
    for device, directory in result.devices.items():
        with np.load(directory / "data" / "train.npz") as got:
            np.testing.assert_array_equal(got["y"], expected.train[device][1])
    assert sum(result.data.values()) == sum(len(y) for _, y in expected.train.values())


def split_csv(directory: Path, devices: int) -> Path:
    """A small CSV split by `fedtier data split` into ``devices`` shards (dev-00, ...); returns the split's folder."""
    from fleet_data.split import SplitOptions, split_table
    from fleet_data.tables import read_table

    rng = np.random.default_rng(1)
    x = rng.standard_normal((60, 4))
    rows = [",".join(f"{v:.4f}" for v in r) + f",{int(r[0] > 0)}" for r in x]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "table.csv").write_text("a,b,c,d,label\n" + "\n".join(rows) + "\n")
    split_table(read_table(directory / "table.csv", "label"), SplitOptions(devices=devices, holdout=0.25),
                directory / "shards")
    return directory / "shards"


def test_shards_go_each_to_the_bundle_of_its_device_and_names_must_match(tmp_path: Path) -> None:
    shards = split_csv(tmp_path / "data", 3)
    source = rollout_file(tmp_path / "cfg", 'cell-a = ["dev-00", "dev-01"]\ncell-b = ["dev-02"]')

    result = provision_fleet(source, tmp_path / "site", shards=shards)

    for device in ("dev-00", "dev-01", "dev-02"):
        data = result.devices[device] / "data"
        assert (data / "train.npz").read_bytes() == (shards / device / "train.npz").read_bytes()
        assert (data / "eval" / "eval.npz").read_bytes() == (shards / device / "eval" / "eval.npz").read_bytes()
        with np.load(shards / device / "train.npz") as z:
            assert result.data[device] == len(z["y"])
        assert result.held_out[device] > 0
    assert result.to_json()["shards"] == str(shards)
    # Again, over a stale file: data/ becomes the shard, nothing else.
    (result.devices["dev-00"] / "data" / "old.csv").write_text("1,2,3,4,0\n")
    provision_fleet(source, tmp_path / "site", shards=shards)
    assert not (result.devices["dev-00"] / "data" / "old.csv").exists()


def test_shards_that_do_not_match_the_topologys_names_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    shards = split_csv(tmp_path / "data", 3)
    padded = rollout_file(tmp_path / "cfg", 'cell-a = ["dev-0", "dev-1"]\ncell-b = ["dev-2"]')
    with pytest.raises(ConfigError, match=r"no shard for dev-0, dev-1, dev-2; no device in the topology for shards "
                                          r"dev-00, dev-01, dev-02\..*differ only in their zero padding") as padding:
        provision_fleet(padded, tmp_path / "site", shards=shards)
    assert padding.value.key == "--shards" and not (tmp_path / "site").exists()
    fewer = rollout_file(tmp_path / "cfg", 'cell-a = ["dev-00", "dev-01"]', name="two.toml")
    with pytest.raises(ConfigError, match=r"no device in the topology for shard dev-02\..*--devices 2"):
        provision_fleet(fewer, tmp_path / "site", shards=shards)
    with pytest.raises(ConfigError, match="give one"):
        provision_fleet(fewer, tmp_path / "site", shards=shards, sample_data=True)
    with pytest.raises(ConfigError, match="holds no shard"):
        provision_fleet(fewer, tmp_path / "site", shards=tmp_path / "cfg")
    assert not (tmp_path / "site").exists()


def test_the_command_prints_where_each_shard_went(tmp_path: Path) -> None:
    shards = split_csv(tmp_path / "data", 3)
    source = rollout_file(tmp_path / "cfg", 'cell-a = ["dev-00", "dev-01"]\ncell-b = ["dev-02"]')
    out = CliRunner().invoke(provision, ["fleet", "--rollout", str(source), "--out", str(tmp_path / "site"),
                                         "--shards", str(shards)])
    assert out.exit_code == 0, out.output
    assert f"shards of {shards}, each in the bundle of its device" in out.output
    assert f"-> {tmp_path / 'site' / 'devices' / 'dev-02' / 'data'}" in out.output
    bad = CliRunner().invoke(provision, ["fleet", "--rollout", str(source), "--out", str(tmp_path / "x"),
                                         "--shards", str(tmp_path / "nowhere")])
    assert bad.exit_code == 2 and "--shards" in bad.output and "directory not found" in bad.output


def test_the_command_prints_what_runs_where_and_json_for_machines(tmp_path: Path) -> None:
    source = rollout_file(tmp_path / "cfg")
    runner = CliRunner()
    out = runner.invoke(provision, ["fleet", "--rollout", str(source), "--out", str(tmp_path / "site"),
                                    "--cell-broker", "cell-a=10.0.0.5:8884"])
    assert out.exit_code == 0, out.output
    assert f"mosquitto -c {tmp_path / 'site' / 'brokers' / 'cell-a' / 'mosquitto.conf'}" in out.output
    assert f"fedtier coordinator run --config {tmp_path / 'site' / 'coordinator' / 'r1.toml'}" in out.output
    assert "BEGIN" not in out.output  # never key material
    doc = json.loads(runner.invoke(provision, ["fleet", "--rollout", str(source), "--out", str(tmp_path / "site"),
                                               "--cell-broker", "cell-a=10.0.0.5:8884", "--json"]).output)
    assert doc["issued"] == [] and doc == json.loads((tmp_path / "site" / "fleet.json").read_text())
    bad = runner.invoke(provision, ["fleet", "--rollout", str(source), "--out", str(tmp_path / "x"),
                                    "--cell-broker", "cell-a"])
    assert bad.exit_code == 2 and "CELL=HOST:PORT" in bad.output


def test_an_unknown_broker_user_is_refused_and_by_default_the_config_names_the_current_one(tmp_path: Path) -> None:
    from provisioning.errors import ProvisioningError

    with pytest.raises(ProvisioningError, match="no such user"):
        provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "bad", run_as="no-such-user-here")
    result = provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "site")
    conf = Path(result.brokers["shared"]["conf"]).read_text()
    assert f"user {broker_config.current_user()}\n" in conf  # works as written where it was generated


def test_a_broker_user_gets_its_0600_key(tmp_path: Path) -> None:
    import os
    import stat

    # handing a key to another user needs root (elsewhere the command says how instead)
    require(os.geteuid() == 0, "root (handing the broker's key to another user needs it)")
    mosquitto = system_user("mosquitto")
    require(mosquitto is not None, "the `mosquitto` user (Debian's mosquitto package makes it)")
    provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "site")  # a site, provisioned again with a user
    result = provision_fleet(rollout_file(tmp_path / "cfg"), tmp_path / "site", run_as="mosquitto")
    directory = Path(result.brokers["shared"]["dir"])
    assert "user mosquitto\n" in (directory / "mosquitto.conf").read_text()
    st = (directory / "broker.key").stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == mosquitto.pw_uid
