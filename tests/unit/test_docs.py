"""Docs that are generated or quoted must match the code."""

from __future__ import annotations

from pathlib import Path

from fedtier.rollout.config import RolloutConfig
from commands.config_docs import generate
from fedtier.runtime.config import load

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_up_to_date() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == generate(), "run: python -m commands.config_docs"


def test_configuration_reference_lists_every_key_of_optional_sections() -> None:
    # Issue 17 A6: [privacy] (and [qhetfed.plan]) are optional tables; every key of theirs is documented.
    import dataclasses

    from fedtier.rollout.config import PlanSection, PrivacySection

    text = (ROOT / "docs" / "configuration.md").read_text()
    for prefix, section in (("privacy", PrivacySection), ("qhetfed.plan", PlanSection)):
        assert f"#### `[{prefix}]`" in text
        for f in dataclasses.fields(section):
            assert f"| `{prefix}.{f.name}` |" in text, f"{prefix}.{f.name}"


def test_privacy_doc_lists_every_upward_field() -> None:
    from commands.config_docs import privacy_doc

    committed = (ROOT / "docs" / "privacy.md").read_text()
    assert committed == privacy_doc(committed), "run: python -m commands.config_docs"


def test_every_experiment_config_loads() -> None:
    """Plain rollout configs load; experiment specs ([rollout] + splits) load for every run they make."""
    import sys

    import tomllib

    configs = sorted((ROOT / "experiments").glob("*.toml"))
    assert configs
    sys.path.insert(0, str(ROOT / "experiments"))
    for path in configs:
        spec = tomllib.loads(path.read_text())
        if not isinstance(spec.get("rollout"), dict):  # a plain rollout config (its "rollout" is an id)
            load(RolloutConfig, path)
            continue
        runner = __import__(str(spec.get("runner", path.stem)))  # a variant config names the runner it is for
        if hasattr(runner, "all_mappings"):  # runners whose runs are not (split x algorithm)
            for mapping in runner.all_mappings(spec):
                RolloutConfig.from_mapping(mapping, source=str(path), base_dir=path.parent)
            continue
        for split in spec["splits"]:
            for algorithm in runner.ALGORITHMS:
                RolloutConfig.from_mapping(runner.rollout_mapping(spec, algorithm, split, spec["seeds"][0]),
                                           source=str(path), base_dir=path.parent)


def test_readme_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert block[0].startswith("./install.sh && fedtier demo")
    assert block[1].startswith("python3 -m pytest")
    assert "python3 -m pytest" in (ROOT / ".ci" / "run").read_text()


PACKAGES = ("fedtier", "models", "device_agent", "edge_broker", "fleet_data", "cloud_coordinator", "provisioning",
            "local_fleet", "commands")


def test_architecture_doc_names_every_module_of_the_tree() -> None:
    """A reader who opens docs/architecture.md finds every module (but packages' ``__init__.py``) by its path."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p.relative_to(ROOT).as_posix() for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
               if p.name != "__init__.py" or p.parent.name == "trainers"]
    assert len(modules) > 150
    assert [m for m in modules if m not in text] == []


def test_architecture_doc_names_only_modules_that_exist() -> None:
    """Every path (``fedtier/wire/envelope.py``, ``edge_broker/``) and dotted module (``fedtier.wire``)
    that docs/architecture.md names exists, except the hypothetical ones its recipes introduce."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    hypothetical = {"fedtier/algorithms/fedfoo.py", "tests/unit/fedtier/algorithms/test_fedfoo.py",
                    "fedtier/transport/coap.py"}
    roots = "|".join([*PACKAGES, "tests"])
    paths = set(re.findall(rf"\b(?:{roots})/[\w/]*[\w]+(?:\.py)?/?", text))
    dotted = set(re.findall(r"\bfedtier(?:\.[a-z_]+)+\b", text))
    assert len(paths) > 40  # the document names modules by path; a broken regex would find none
    missing = sorted(p for p in paths - hypothetical if not (ROOT / p).exists())
    missing += sorted(d for d in dotted if not ((ROOT / (d.replace(".", "/") + ".py")).exists()
                                               or (ROOT / d.replace(".", "/") / "__init__.py").exists()))
    assert missing == [], f"docs/architecture.md names what does not exist: {missing}"
    for name in hypothetical:
        assert not (ROOT / name).exists(), f"{name} exists now; the recipe should pick another example"
