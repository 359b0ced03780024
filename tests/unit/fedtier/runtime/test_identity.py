"""A node's check of its own certificate at start."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

import pytest

from fedtier.runtime.config import BrokerConfig
from fedtier.runtime.identity import check_certificate, preflight
from fedtier.security import pki
from provisioning import ca

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)


@pytest.fixture
def issue(tmp_path: Path):
    ca_key, ca_cert = ca.create_ca(now=NOW - dt.timedelta(days=100))
    pki.write_certificate(tmp_path / "ca.pem", ca_cert)

    def make(name: str = "dev-0", *, days_left: float = 200.0, starts_in: float = -10.0,
             other_key: bool = False) -> BrokerConfig:
        key = pki.generate_tls_key()
        cert = ca.issue_node_certificate(ca_key, ca_cert, key.public_key(), name,
                                         not_before=NOW + dt.timedelta(days=starts_in),
                                         not_after=NOW + dt.timedelta(days=days_left))
        directory = tmp_path / f"{name}-{days_left}-{starts_in}-{other_key}"
        pki.write_certificate(directory / "cert.pem", cert)
        pki.write_private_key(directory / "key.pem", pki.generate_tls_key() if other_key else key)
        return BrokerConfig(tls_ca=tmp_path / "ca.pem", tls_cert=directory / "cert.pem", tls_key=directory / "key.pem")

    return make


def test_a_good_certificate_has_nothing_to_report(issue) -> None:
    assert check_certificate(issue(), "dev-0", now=NOW) == []
    assert check_certificate(BrokerConfig(), "dev-0", now=NOW) == []  # no TLS, nothing to check


@pytest.mark.parametrize(("kwargs", "node", "fatal", "words"), [
    ({"days_left": -1}, "dev-0", True, "expired on"),
    ({"other_key": True}, "dev-0", True, "is not the key of"),
    ({}, "dev-1", True, "is the certificate of 'dev-0', but this node is 'dev-1'"),
    ({"starts_in": 2}, "dev-0", False, "clock is probably behind"),
    ({"days_left": 10}, "dev-0", False, "fedtier provision rotate dev-0"),
])
def test_what_is_wrong_is_said_and_whether_it_can_work(issue, kwargs: dict, node: str, fatal: bool,
                                                      words: str) -> None:
    [finding] = check_certificate(issue(**kwargs), node, now=NOW)
    assert finding.fatal is fatal and words in finding.message
    assert finding.level == (logging.WARNING if "rotate dev-0" in words else logging.ERROR)


def test_preflight_logs_each_problem_and_fails_only_on_fatal_ones(issue, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert preflight("dev-0", [issue(days_left=10)], now=NOW)
        assert not preflight("dev-0", [issue(days_left=-1)], now=NOW)
    assert [r.levelname for r in caplog.records] == ["WARNING", "ERROR"]
