"""The fleet directory, bundles, revocation/rotation/listing and broker configs, through `fedtier provision`."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import require, system_user
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedtier.rollout.config import RolloutConfig
from device_agent.config import DeviceConfig
from device_agent.enroll import enroll
from edge_broker.config import EdgeConfig
from fedtier.runtime.config import load
from fedtier.security import pki
from fedtier.transport import topics
from fedtier.transport.topic_filters import topic_matches
from fedtier.wire.messages import MESSAGE_TYPES
from provisioning import broker_config, bundles, ca
from provisioning.cli import provision
from provisioning.errors import NameConflictError
from provisioning.fleet import Fleet

BROKER = "gw.example:8883"


class Cli:
    """Runs `provision` commands and keeps every output, to check none shows key material."""

    def __init__(self) -> None:
        self.runner = CliRunner()
        self.outputs: list[str] = []

    def __call__(self, *args: object, ok: bool = True) -> Result:
        result = self.runner.invoke(provision, [str(a) for a in args])
        self.outputs.append(result.output)
        if ok:
            assert result.exit_code == 0, result.output
        else:
            assert result.exit_code != 0, result.output
        return result


@pytest.fixture
def cli() -> Cli:
    return Cli()


@pytest.fixture
def fleet_dir(tmp_path: Path, cli: Cli) -> Path:
    cli("init", "--fleet", tmp_path / "fleet")
    return tmp_path / "fleet"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def no_private_keys(cli: Cli) -> None:
    for out in cli.outputs:
        assert "PRIVATE KEY" not in out


# --- init ------------------------------------------------------------------------------------------


def test_init_writes_ca_and_signing_key_with_private_files_0600(fleet_dir: Path, cli: Cli) -> None:
    for name, want in (("ca.key", 0o600), ("signing.key", 0o600), ("ca.pem", 0o644), ("signing.pub", 0o644),
                       ("crl.pem", 0o644)):
        assert mode(fleet_dir / name) == want, name
    assert mode(fleet_dir) == 0o700
    fleet = Fleet(fleet_dir)
    assert fleet.signing_key_id in cli.outputs[-1]
    crl = fleet.crl()
    assert len(crl) == 0 and crl.is_signature_valid(fleet.ca_cert.public_key())  # type: ignore[arg-type]
    no_private_keys(cli)


def test_init_refuses_to_overwrite_a_fleet_without_force(fleet_dir: Path, cli: Cli) -> None:
    ca_before = (fleet_dir / "ca.key").read_bytes()
    result = cli("init", "--fleet", fleet_dir, ok=False)
    assert result.exit_code == 2 and "--force" in result.output and "refusing to overwrite" in result.output
    assert (fleet_dir / "ca.key").read_bytes() == ca_before
    cli("init", "--fleet", fleet_dir, "--force")
    assert (fleet_dir / "ca.key").read_bytes() != ca_before
    assert mode(fleet_dir / "ca.key") == 0o600 and mode(fleet_dir / "signing.key") == 0o600


def test_a_missing_fleet_is_named(tmp_path: Path, cli: Cli) -> None:
    result = cli("list", "--fleet", tmp_path / "nowhere", ok=False)
    assert "--fleet" in result.output and "provision init" in result.output


# --- bundles ---------------------------------------------------------------------------------------


def check_node_cert(bundle: Path, fleet_dir: Path, name: str) -> x509.Certificate:
    cert = pki.load_certificate(bundle / "cert.pem")
    ca_cert = pki.load_certificate(fleet_dir / "ca.pem")
    assert pki.cert_common_name(cert) == name
    assert ca.verify_issued_by(cert, ca_cert)
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
    assert (bundle / "ca.pem").read_bytes() == (fleet_dir / "ca.pem").read_bytes()
    kid = Fleet(fleet_dir).signing_key_id
    assert (bundle / "trusted_keys" / f"{kid}.pub").read_bytes() == (fleet_dir / "signing.pub").read_bytes()
    return cert


def test_device_bundle_is_self_contained_and_loads(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    out = tmp_path / "dev1"
    cli("device", "dev1", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", out, "--days", 90)
    assert mode(out / "key.pem") == 0o600
    cert = check_node_cert(out, fleet_dir, "dev1")
    assert pki.same_public_key(cert.public_key(), pki.load_private_key(out / "key.pem").public_key())  # type: ignore[arg-type]
    assert 89.9 < (cert.not_valid_after_utc - ca.utcnow()).total_seconds() / 86400 <= 90
    moved = shutil.copytree(out, tmp_path / "elsewhere" / "bundle")  # relative paths: it works anywhere
    cfg = load(DeviceConfig, moved / "device.toml")
    assert (cfg.device_id, cfg.cell) == ("dev1", "c0")
    assert cfg.data_dir == moved / "data" and cfg.state_dir == moved / "state"
    assert (cfg.broker.host, cfg.broker.port, cfg.broker.protocol) == ("gw.example", 8883, 5)
    assert cfg.broker.tls_key == moved / "key.pem" and cfg.broker.tls_cert == moved / "cert.pem"
    assert cfg.broker.tls_ca == moved / "ca.pem"
    assert [p.name for p in cfg.trusted_keys] == [f"{Fleet(fleet_dir).signing_key_id}.pub"]
    assert str(out / "key.pem") in cli.outputs[-1]
    no_private_keys(cli)


def test_device_data_dir_and_existing_bundle(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    out = tmp_path / "dev2"
    cli("device", "dev2", "--cell", "c0", "--fleet", fleet_dir, "--broker", "10.0.0.1", "--out", out,
        "--data-dir", "/srv/data")
    cfg = load(DeviceConfig, out / "device.toml")
    assert cfg.data_dir == Path("/srv/data") and cfg.broker.port == 8883
    key_before = (out / "key.pem").read_bytes()
    result = cli("device", "dev2", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", out, ok=False)
    assert "--out" in result.output and (out / "key.pem").read_bytes() == key_before
    cli("device", "dev2", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", out, "--force")
    assert (out / "key.pem").read_bytes() != key_before and mode(out / "key.pem") == 0o600


def test_gateway_bundle_serves_both_brokers(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    out = tmp_path / "gw"
    cli("gateway", "c0", "--fleet", fleet_dir, "--broker", "127.0.0.1:1883", "--cloud-broker", "cloud.example:8884",
        "--out", out)
    assert mode(out / "key.pem") == 0o600
    check_node_cert(out, fleet_dir, "c0")
    cfg = load(EdgeConfig, out / "edge.toml")
    assert cfg.cell == "c0" and cfg.parent == "cloud" and cfg.state_dir == out / "state"
    assert (cfg.cell_broker.host, cfg.cell_broker.port) == ("127.0.0.1", 1883)
    assert (cfg.cloud_broker.host, cfg.cloud_broker.port) == ("cloud.example", 8884)
    for b in (cfg.cell_broker, cfg.cloud_broker):
        assert (b.tls_ca, b.tls_cert, b.tls_key) == (out / "ca.pem", out / "cert.pem", out / "key.pem")
    assert len(cfg.trusted_keys) == 1
    same = tmp_path / "gw1"
    cli("gateway", "c1", "--fleet", fleet_dir, "--broker", BROKER, "--out", same)
    cfg1 = load(EdgeConfig, same / "edge.toml")
    assert (cfg1.cloud_broker.host, cfg1.cloud_broker.port) == ("gw.example", 8883)  # default: same broker


def test_coordinator_bundle_points_at_the_fleet_signing_key(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    out = tmp_path / "coord"
    cli("coordinator", "--fleet", fleet_dir, "--broker", BROKER, "--out", out, "--cloud-id", "hq")
    check_node_cert(out, fleet_dir, "hq")
    cfg = load(RolloutConfig, out / "coordinator.toml")
    assert cfg.cloud_id == "hq" and cfg.signing_key == fleet_dir.resolve() / "signing.key"
    assert cfg.broker.tls_key == out / "key.pem"
    signing = (fleet_dir / "signing.key").read_bytes()
    for f in out.rglob("*"):
        if f.is_file():
            assert f.read_bytes() != signing, f"{f} is a copy of the signing key"
    no_private_keys(cli)


def test_broker_certificate_has_the_hosts_as_sans(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    out = tmp_path / "b"
    cli("broker", "gw0", "--fleet", fleet_dir, "--host", "192.168.0.10", "--host", "gw0.lan", "--out", out)
    assert mode(out / "broker.key") == 0o600
    cert = pki.load_certificate(out / "broker.pem")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gw0.lan"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["192.168.0.10"]
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]
    no_private_keys(cli)


def test_names_that_would_alias_another_role_are_refused(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    cli("gateway", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "gw")
    cli("coordinator", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "co")
    cli("device", "d1", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "d1")
    for args in (("device", "c0", "--cell", "c1"),      # a device named like a cell
                 ("device", "cloud", "--cell", "c0"),   # ... like the coordinator
                 ("device", "d2", "--cell", "d1"),      # a cell named like a device
                 ("device", "d1", "--cell", "c1")):     # one device, two cells
        result = cli(*args, "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "x", ok=False)
        assert result.exit_code == 2 and "NAME" in result.output, result.output
    result = cli("device", "bad/name", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out",
                 tmp_path / "y", ok=False)
    assert "invalid" in result.output
    assert not (tmp_path / "x" / "key.pem").exists(), "a refused node leaves no key behind"
    result = cli("device", "d3", "--cell", "c0", "--fleet", fleet_dir, "--broker", "h:99999", "--out", tmp_path / "z",
                 ok=False)
    assert "--broker" in result.output


# --- CSR flow --------------------------------------------------------------------------------------


def test_csr_flow_keeps_the_key_on_the_device(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    device_dir = tmp_path / "device"
    csr_path = enroll("dev-9", device_dir)
    out = tmp_path / "returned"
    result = cli("sign", csr_path, "--cell", "c3", "--fleet", fleet_dir, "--broker", BROKER, "--out", out)
    assert "none" in result.output
    assert not (out / "key.pem").exists()
    cert = check_node_cert(out, fleet_dir, "dev-9")
    csr = pki.load_csr(csr_path)
    assert pki.same_public_key(cert.public_key(), csr.public_key())  # type: ignore[arg-type]
    assert Fleet(fleet_dir).latest("dev-9").from_csr
    # The device unpacks the bundle next to its key; the config then loads as is.
    for f in out.iterdir():
        if f.is_dir():
            shutil.copytree(f, device_dir / f.name)
        else:
            shutil.copy(f, device_dir / f.name)
    cfg = load(DeviceConfig, device_dir / "device.toml")
    assert cfg.broker.tls_key == device_dir / "key.pem" and cfg.cell == "c3"
    bundles.check_bundle_key(device_dir)
    no_private_keys(cli)


def test_signing_into_the_enroll_directory_checks_the_key(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    device_dir = tmp_path / "device"
    csr_path = enroll("dev-5", device_dir)
    cli("sign", csr_path, "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", device_dir)
    load(DeviceConfig, device_dir / "device.toml")
    assert mode(device_dir / "key.pem") == 0o600


def test_a_forged_or_invalid_csr_is_refused(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    der = pki.make_csr(pki.generate_tls_key(), "dev-7").public_bytes(serialization.Encoding.DER)
    forged = x509.load_der_x509_csr(der.replace(b"dev-7", b"dev-8"))
    (tmp_path / "forged.csr").write_bytes(forged.public_bytes(serialization.Encoding.PEM))
    result = cli("sign", tmp_path / "forged.csr", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER,
                 "--out", tmp_path / "o1", ok=False)
    assert "CSR" in result.output and "signature" in result.output
    pki.write_csr(tmp_path / "bad.csr", pki.make_csr(pki.generate_tls_key(), "dev#1"))
    result = cli("sign", tmp_path / "bad.csr", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER,
                 "--out", tmp_path / "o2", ok=False)
    assert "invalid" in result.output
    (tmp_path / "junk.csr").write_text("junk")
    result = cli("sign", tmp_path / "junk.csr", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER,
                 "--out", tmp_path / "o3", ok=False)
    assert "junk.csr" in result.output
    assert Fleet(fleet_dir).records() == []


# --- revoke, rotate, list --------------------------------------------------------------------------


def test_revoke_lists_the_serial_in_the_crl(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    cli("device", "d1", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "d1")
    cli("device", "d2", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "d2")
    serial = pki.load_certificate(tmp_path / "d1" / "cert.pem").serial_number
    result = cli("revoke", "d1", "--fleet", fleet_dir)
    assert format(serial, "x") in result.output
    fleet = Fleet(fleet_dir)
    crl = fleet.crl()
    assert crl.is_signature_valid(fleet.ca_cert.public_key())  # type: ignore[arg-type]
    assert [r.serial_number for r in crl] == [serial]
    assert crl.get_revoked_certificate_by_serial_number(serial) is not None
    assert fleet.latest("d1").revoked and not fleet.latest("d2").revoked
    assert "nothing to revoke" in cli("revoke", "d1", "--fleet", fleet_dir).output
    assert "NAME" in cli("revoke", "nobody", "--fleet", fleet_dir, ok=False).output


def test_rotate_issues_a_new_serial_for_the_same_node(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    cli("device", "d1", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "old",
        "--data-dir", "mydata")
    old = pki.load_certificate(tmp_path / "old" / "cert.pem")
    cli("rotate", "d1", "--fleet", fleet_dir, "--out", tmp_path / "new")
    new = pki.load_certificate(tmp_path / "new" / "cert.pem")
    assert new.serial_number != old.serial_number and pki.cert_common_name(new) == "d1"
    assert (tmp_path / "new" / "key.pem").read_bytes() != (tmp_path / "old" / "key.pem").read_bytes()
    assert mode(tmp_path / "new" / "key.pem") == 0o600
    cfg = load(DeviceConfig, tmp_path / "new" / "device.toml")
    assert (cfg.cell, cfg.broker.host, cfg.data_dir.name) == ("c0", "gw.example", "mydata")
    assert len(Fleet(fleet_dir).crl()) == 0  # the old one stays valid until --revoke-old
    cli("rotate", "d1", "--fleet", fleet_dir, "--out", tmp_path / "newer", "--revoke-old")
    newest = pki.load_certificate(tmp_path / "newer" / "cert.pem")
    revoked = {r.serial_number for r in Fleet(fleet_dir).crl()}
    assert revoked == {old.serial_number, new.serial_number} and newest.serial_number not in revoked
    # A gateway keeps both brokers; a broker keeps its hosts.
    cli("gateway", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--cloud-broker", "cloud:9000", "--out",
        tmp_path / "gw")
    cli("rotate", "c0", "--fleet", fleet_dir, "--out", tmp_path / "gw2", "--kind", "gateway")
    assert load(EdgeConfig, tmp_path / "gw2" / "edge.toml").cloud_broker.port == 9000
    cli("broker", "c0", "--fleet", fleet_dir, "--host", "10.1.1.1", "--out", tmp_path / "b")
    cli("rotate", "c0", "--fleet", fleet_dir, "--out", tmp_path / "b2", "--kind", "broker")
    san = pki.load_certificate(tmp_path / "b2" / "broker.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.1.1.1"]
    no_private_keys(cli)


def test_rotate_with_a_new_csr(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    csr1 = enroll("dev-1", tmp_path / "k1")
    cli("sign", csr1, "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "b1")
    csr2 = enroll("dev-1", tmp_path / "k2")
    cli("rotate", "dev-1", "--fleet", fleet_dir, "--out", tmp_path / "b2", "--csr", csr2, "--revoke-old")
    assert not (tmp_path / "b2" / "key.pem").exists()
    cert = pki.load_certificate(tmp_path / "b2" / "cert.pem")
    assert pki.same_public_key(cert.public_key(), pki.load_csr(csr2).public_key())  # type: ignore[arg-type]
    other = enroll("dev-2", tmp_path / "k3")
    assert "CSR" in cli("rotate", "dev-1", "--fleet", fleet_dir, "--out", tmp_path / "b3", "--csr", other,
                        ok=False).output


def test_list_flags_expiring_and_revoked_and_json_has_no_keys(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    cli("device", "soon", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "a",
        "--days", 10)
    cli("device", "later", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "b")
    cli("device", "gone", "--cell", "c0", "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / "c",
        "--days", 5)
    cli("revoke", "gone", "--fleet", fleet_dir)
    rows = {r["name"]: r for r in json.loads(cli("list", "--fleet", fleet_dir, "--json").output)}
    assert rows["soon"]["expiring"] and not rows["soon"]["revoked"]
    assert not rows["later"]["expiring"]
    assert rows["gone"]["revoked"] and not rows["gone"]["expiring"]
    assert rows["soon"]["kind"] == "device" and rows["soon"]["cell"] == "c0"
    assert rows["soon"]["serial"] == format(pki.load_certificate(tmp_path / "a" / "cert.pem").serial_number, "x")
    assert {"not_after", "not_before", "expired"} <= set(rows["soon"])
    rows = {r["name"]: r for r in json.loads(cli("list", "--fleet", fleet_dir, "--json",
                                                 "--expiring-days", 3).output)}
    assert not rows["soon"]["expiring"]
    text = cli("list", "--fleet", fleet_dir).output
    lines = {line.split()[0]: line for line in text.splitlines()[1:] if line.strip()}
    assert lines["soon"].endswith("EXPIRING") and lines["later"].endswith("active")
    assert lines["gone"].endswith("revoked")
    no_private_keys(cli)


def test_crl_renewal_and_publishing(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    before = Fleet(fleet_dir).crl()
    cli("crl", "--fleet", fleet_dir, "--days", 30, "--publish", tmp_path / "gw0")
    after = Fleet(fleet_dir).crl()
    n = x509.CRLNumber
    assert after.extensions.get_extension_for_class(n).value.crl_number > \
        before.extensions.get_extension_for_class(n).value.crl_number
    assert (tmp_path / "gw0" / "crl.pem").read_bytes() == (fleet_dir / "crl.pem").read_bytes()


# --- broker configs --------------------------------------------------------------------------------


def test_broker_config_for_a_cell(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    out = tmp_path / "gw0"
    assert "provision broker" in cli("broker-config", "--cell", "c0", "--fleet", fleet_dir, "--out", out,
                                     ok=False).output
    cli("broker", "gw0", "--fleet", fleet_dir, "--host", "127.0.0.1", "--out", out)
    cli("broker-config", "--cell", "c0", "--fleet", fleet_dir, "--out", out, "--port", 18883)
    conf = (out / "mosquitto.conf").read_text()
    for line in ("per_listener_settings false", "allow_anonymous false", "listener 18883 0.0.0.0",
                 f"cafile {out / 'ca.pem'}", f"certfile {out / 'broker.pem'}", f"keyfile {out / 'broker.key'}",
                 f"crlfile {out / 'crl.pem'}", "require_certificate true", "use_identity_as_username true",
                 "tls_version tlsv1.2", f"acl_file {out / 'fedtier.acl'}", "persistence false", "log_dest stdout"):
        assert line in conf.splitlines(), line
    assert not any(line.startswith("user ") for line in conf.splitlines())
    acl = (out / "fedtier.acl").read_text().splitlines()
    first_user = next(i for i, line in enumerate(acl) if line.startswith("user "))
    assert not any(line.startswith("topic ") for line in acl[:first_user]), "topic lines before user: anonymous only"
    assert {"pattern write ft/v1/+/cell/c0/up/%u/#", "pattern read ft/v1/+/cell/c0/down/#",
            "pattern write ft/v1/status/%u"} <= set(acl[:first_user])
    assert acl[first_user] == "user c0"
    assert "already has a broker config" in cli("broker-config", "--cell", "c0", "--fleet", fleet_dir, "--out", out,
                                                 ok=False).output
    # A server certificate from another fleet is refused.
    other = tmp_path / "other"
    cli("init", "--fleet", other)
    cli("broker", "x", "--fleet", other, "--host", "h", "--out", tmp_path / "ob")
    result = cli("broker-config", "--cell", "c0", "--fleet", fleet_dir, "--out", tmp_path / "o",
                 "--cert", tmp_path / "ob" / "broker.pem", "--key", tmp_path / "ob" / "broker.key", ok=False)
    assert "not issued by the fleet CA" in result.output
    no_private_keys(cli)


def test_members_only_binds_devices_to_the_cell(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    out = tmp_path / "gw0"
    for name, cell in (("d0", "c0"), ("d1", "c0"), ("e0", "c1")):
        cli("device", name, "--cell", cell, "--fleet", fleet_dir, "--broker", BROKER, "--out", tmp_path / name)
    cli("revoke", "d1", "--fleet", fleet_dir)
    cli("broker", "gw0", "--fleet", fleet_dir, "--host", "127.0.0.1", "--out", out)
    cli("broker-config", "--cell", "c0", "--fleet", fleet_dir, "--out", out, "--members-only")
    acl = (out / "fedtier.acl").read_text()
    assert "user d0\ntopic write ft/v1/+/cell/c0/up/d0/#\ntopic read ft/v1/+/cell/c0/down/#" in acl
    assert "user d1" not in acl and "user e0" not in acl and "%u/#" not in acl
    # a roaming rollout: every device of the inventory may act here, each by name (revoked d1 still not)
    assert "--roaming goes with --members-only" in cli("broker-config", "--cell", "c0", "--fleet", fleet_dir,
                                                       "--out", out, "--force", "--roaming", ok=False).output
    cli("broker-config", "--cell", "c0", "--fleet", fleet_dir, "--out", out, "--force", "--members-only", "--roaming")
    acl = (out / "fedtier.acl").read_text()
    assert "user e0\ntopic write ft/v1/+/cell/c0/up/e0/#\ntopic read ft/v1/+/cell/c0/down/#" in acl
    assert "user d0\n" in acl and "user d1" not in acl and "%u/#" not in acl


def test_run_as_hands_a_0600_key_copy_to_that_user(tmp_path: Path, fleet_dir: Path, cli: Cli) -> None:
    require(os.geteuid() == 0, "root (handing the key to another user needs it)")
    user = system_user("mosquitto")
    require(user is not None, "the `mosquitto` user (Debian's mosquitto package makes it)")
    src, out = tmp_path / "src", tmp_path / "gw0"
    cli("broker", "gw0", "--fleet", fleet_dir, "--host", "127.0.0.1", "--out", src)
    cli("broker-config", "--cell", "c0", "--fleet", fleet_dir, "--out", out, "--cert", src / "broker.pem", "--key",
        src / "broker.key", "--run-as", "mosquitto")
    assert "user mosquitto" in (out / "mosquitto.conf").read_text().splitlines()
    st = os.stat(out / "broker.key")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == user.pw_uid
    assert os.stat(src / "broker.key").st_uid == 0  # the original is untouched
    assert f"keyfile {out / 'broker.key'}" in (out / "mosquitto.conf").read_text()
    assert "no such user" in cli("broker-config", "--cell", "c0", "--fleet", fleet_dir, "--out", out, "--force",
                                 "--cert", src / "broker.pem", "--key", src / "broker.key",
                                 "--run-as", "no-such-user-xyz", ok=False).output


def test_combined_config_uses_the_current_user_and_reuses_its_certificate(tmp_path: Path, fleet_dir: Path) -> None:
    fleet = Fleet(fleet_dir)
    bundles.issue_device(fleet, "d0", "c0", ("127.0.0.1", 8883), tmp_path / "d0")
    setup = broker_config.combined_broker_config(["c0", "c1"], "cloud", fleet=fleet, out=tmp_path / "b", port=18884)
    conf = setup.conf.read_text().splitlines()
    assert f"user {broker_config.current_user()}" in conf and "listener 18884 127.0.0.1" in conf
    assert f"crlfile {fleet.crl_path}" in conf and setup.devices == {"d0": "c0"}
    assert mode(setup.key) == 0o600
    serial = pki.load_certificate(setup.cert).serial_number
    again = broker_config.combined_broker_config(["c0", "c1"], "cloud", fleet=fleet, out=tmp_path / "b", port=18884)
    assert pki.load_certificate(again.cert).serial_number == serial
    wider = broker_config.combined_broker_config(["c0"], "cloud", fleet=fleet, out=tmp_path / "b",
                                                 hosts=["127.0.0.1", "demo.lan"])
    assert pki.load_certificate(wider.cert).serial_number != serial
    with pytest.raises(NameConflictError):
        broker_config.combined_broker_config(["c0", "cloud"], "cloud", fleet=fleet, out=tmp_path / "x")
    with pytest.raises(NameConflictError):
        broker_config.combined_acl(["c0"], "cloud", {"c0": "c0"})


# --- the ACL fits the topic tree ----------------------------------------------------------------------


def grants(acl: str, user: str, access: str) -> list[str]:
    """Filters granting ``access`` to ``user`` in an ACL text (patterns with %u substituted)."""
    out, current = [], None
    for line in acl.splitlines():
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        if parts[0] == "user":
            current = parts[1]
        elif parts[0] == "pattern" and parts[1] in (access, "readwrite"):
            out.append(parts[2].replace("%u", user))
        elif parts[0] == "topic" and current == user and parts[1] in (access, "readwrite"):
            out.append(parts[2])
    return out


def allowed(acl: str, user: str, access: str, topic: str) -> bool:
    return any(topic_matches(f, topic) for f in grants(acl, user, access))


@pytest.mark.parametrize("mode_", ["cell", "cell-members", "combined"])
def test_the_acl_grants_each_role_exactly_its_topics(mode_: str) -> None:
    """Every topic a role uses (fedtier.transport.topics, every message kind) is granted; others' are not."""
    r, kinds = "r1", sorted(MESSAGE_TYPES)
    if mode_ == "combined":
        acl = broker_config.combined_acl(["c0", "c1"], "cloud", {"d0": "c0", "d1": "c0"})
    else:
        acl = broker_config.cell_acl("c0", devices={"d0": "c0", "d1": "c0"} if mode_ == "cell-members" else None)
    # device d0
    for k in kinds:
        assert allowed(acl, "d0", "write", topics.cell_up(r, "c0", "d0", k))
        assert allowed(acl, "d0", "read", topics.cell_down(r, "c0", k))
        assert allowed(acl, "d0", "read", topics.cell_down(r, "c0", k, "d0"))
    assert allowed(acl, "d0", "read", topics.cell_manifest(r, "c0"))
    assert allowed(acl, "d0", "write", topics.status("d0"))  # an older agent's presence topic
    assert allowed(acl, "d0", "write", topics.cell_status("c0", "d0"))  # its presence, in its cell
    assert allowed(acl, "d0", "read", topics.cell_status("c0", "d0"))  # (it reads its own: a copied bundle?)
    for t in (topics.cell_up(r, "c0", "d1", "device_update"), topics.cell_up(r, "c1", "d0", "device_update"),
              topics.cell_down(r, "c0", "device_task"), topics.status("d1"), topics.manifest(r),
              topics.cell_status("c0", "d1"), topics.cell_status("c1", "d0"), topics.status("c0")):
        assert not allowed(acl, "d0", "write", t), t
    for t in (topics.cell_down(r, "c1", "device_task"), topics.cell_up(r, "c0", "d1", "device_update"),
              topics.status("d1"), topics.manifest(r), topics.cloud_down(r, "c0", "cell_task"),
              topics.cell_status("c0", "d1")):
        assert not allowed(acl, "d0", "read", t), t
    # gateway c0 on the cell side
    for k in kinds:
        assert allowed(acl, "c0", "read", topics.cell_up(r, "c0", "d0", k))
        assert allowed(acl, "c0", "write", topics.cell_down(r, "c0", k))
        assert allowed(acl, "c0", "write", topics.cell_down(r, "c0", k, "d1"))
    assert allowed(acl, "c0", "write", topics.cell_manifest(r, "c0"))
    assert allowed(acl, "c0", "read", topics.cell_status("c0", "d0"))
    assert not allowed(acl, "c0", "read", topics.cell_status("c1", "e0"))  # presence stays in its cell
    assert not allowed(acl, "c0", "write", topics.cell_status("c0", "d0"))
    assert not allowed(acl, "c0", "write", topics.cell_down(r, "c1", "device_task"))
    assert not allowed(acl, "c0", "read", topics.cell_up(r, "c1", "e0", "device_update"))
    if mode_ != "combined":
        return
    # gateway c0 on the cloud side, and the coordinator
    for k in kinds:
        assert allowed(acl, "c0", "read", topics.cloud_down(r, "c0", k))
        assert allowed(acl, "c0", "write", topics.edge_up(r, "c0", k))
        assert allowed(acl, "cloud", "write", topics.cloud_down(r, "c1", k))
        assert allowed(acl, "cloud", "read", topics.edge_up(r, "c1", k))
    assert allowed(acl, "c0", "read", topics.manifest(r)) and allowed(acl, "c0", "write", topics.status("c0"))
    assert allowed(acl, "cloud", "write", topics.manifest(r)) and allowed(acl, "cloud", "read", topics.status("c0"))
    assert allowed(acl, "c0", "read", topics.status("cloud"))
    assert allowed(acl, "cloud", "read", topics.cell_status("c0", "d0"))  # a shared broker's device inventory
    assert not allowed(acl, "c0", "read", topics.cloud_down(r, "c1", "cell_task"))
    assert not allowed(acl, "c0", "write", topics.edge_up(r, "c1", "cell_update"))
    assert not allowed(acl, "c0", "write", topics.manifest(r))
    assert not allowed(acl, "cloud", "write", topics.cell_down(r, "c0", "device_task"))
    assert not allowed(acl, "cloud", "write", topics.edge_up(r, "c0", "cell_update"))
    assert not allowed(acl, "d0", "read", topics.cell_down(r, "c1", "device_task"))


@pytest.mark.parametrize("shape", ["combined", "gateway of c1", "cloud only"])
def test_a_roaming_rollouts_acl_lets_each_device_into_every_cell_the_broker_serves(shape: str) -> None:
    """``[topology] roaming``: d0 (enrolled in c0) may act in c1 as itself — its uplink, c1's downlink, its presence
    there — and still as nobody else; without roaming it is bound to c0."""
    r, devices = "r1", {"d0": "c0", "d1": "c1"}
    if shape == "combined":
        acl = broker_config.combined_acl(["c0", "c1"], "cloud", devices)
        roaming = broker_config.broker_acl(cell_side=["c0", "c1"], cloud_side=["c0", "c1"], cloud_id="cloud",
                                           devices=devices, roaming=True)
    elif shape == "gateway of c1":
        acl = broker_config.broker_acl(cell_side=["c1"], devices=devices)
        roaming = broker_config.broker_acl(cell_side=["c1"], devices=devices, roaming=True)
    else:  # the cloud's broker of a fleet with gateway brokers: no device connects there
        roaming = broker_config.broker_acl(cloud_side=["c0", "c1"], cloud_id="cloud", devices=devices, roaming=True)
        assert "d0" not in roaming  # no device block on a broker no device connects to
        return
    here = [("write", topics.cell_up(r, "c1", "d0", "device_update")),
            ("read", topics.cell_down(r, "c1", "device_task")), ("read", topics.cell_manifest(r, "c1")),
            ("write", topics.cell_status("c1", "d0"))]
    for access, topic in here:
        assert allowed(roaming, "d0", access, topic), topic
        assert not allowed(acl, "d0", access, topic), topic
    for t in (topics.cell_up(r, "c1", "d1", "device_update"), topics.cell_status("c1", "d1"),
              topics.cell_down(r, "c1", "device_task")):
        assert not allowed(roaming, "d0", "write", t), t
    assert allowed(roaming, "d1", "write", topics.cell_up(r, "c1", "d1", "device_update"))


# --- help -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(provision.commands))
def test_every_command_explains_itself(command: str) -> None:
    result = CliRunner().invoke(provision, [command, "--help"])
    assert result.exit_code == 0 and len(result.output.splitlines()) > 4
