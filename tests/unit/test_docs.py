"""Docs that are generated or quoted must match the code."""

from __future__ import annotations

from pathlib import Path

from cloud_coordinator.config import RolloutConfig
from cloud_coordinator.config_docs import generate
from fedtier.config import load

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_up_to_date() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == generate(), "run: python -m cloud_coordinator.config_docs"


def test_every_experiment_config_loads() -> None:
    configs = sorted((ROOT / "experiments").glob("*.toml"))
    assert configs
    for path in configs:
        load(RolloutConfig, path)


def test_readme_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert block[0].startswith("./install.sh && fedtier demo")
    assert block[1].startswith("python3 -m pytest")
    assert "python3 -m pytest" in (ROOT / ".ci" / "run").read_text()
