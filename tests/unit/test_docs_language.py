"""Docs and help texts speak to a reader who has only the repository: papers by title, no
internal dialect (paper numbers, research notes, issue references, a folder that is not here)."""

from __future__ import annotations

import re
from pathlib import Path

import click
from click.testing import CliRunner

from fedtier.cli import cli

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    r"\bseed \d{3}\b": "a paper's internal number: cite the paper by title",
    r"\bseed_\d{3}": "a research note's file name",
    r"digest §|digest's|implementation digest|\bdigest \(": "the research notes are not in the repository",
    r"papers/": "a folder that is not in the repository",
    r"field notes": "the research notes are not in the repository",
    r"\b(the|see the) [\w-]+ issue\b": "an issue tracker reference",
    r"§": "a section of a document the reader does not have",
}


PUBLIC_SECTIONS = {"docs/broker.md": 'OASIS standard\n"MQTT Version 5.0"'}
"""Pages that cite sections (§) of a public standard, and the words that name it on the page."""


def offences(text: str, page: str = "") -> list[str]:
    rules = dict(FORBIDDEN)
    if page in PUBLIC_SECTIONS and PUBLIC_SECTIONS[page] in text:
        del rules[r"§"]
    return [f"{why}: {m.group(0)!r}" for pattern, why in rules.items() for m in re.finditer(pattern, text)]


def help_texts() -> dict[str, str]:
    runner, out = CliRunner(), {}

    def walk(command: click.Command, path: list[str]) -> None:
        out[" ".join(["fedtier", *path])] = runner.invoke(cli, [*path, "--help"]).output
        if isinstance(command, click.Group):
            ctx = click.Context(command)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                walk(sub, [*path, name])

    walk(cli, [])
    return out


def test_the_docs_cite_papers_by_title_and_need_no_history() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "experiments" / "README.md"]
    found = {str(p.relative_to(ROOT)): offences(p.read_text(), str(p.relative_to(ROOT))) for p in pages}
    assert {k: v for k, v in found.items() if v} == {}


def test_help_texts_need_no_history() -> None:
    texts = help_texts()
    assert len(texts) > 25  # every command and subcommand
    assert {k: offences(v) for k, v in texts.items() if offences(v)} == {}
