"""``fedtier init DIR``: a starter rollout to edit (your own model and data), runnable as written."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Write into a non-empty DIR (overwrites the starter's files).")
def init(directory: Path, force: bool) -> None:
    """Write a commented starter rollout into DIR: rollout.toml, a torch model factory (model.py),
    example data (data.csv: scikit-learn's digits) and its per-device shards (shards/).

    \b
    Example (runs as printed):
      fedtier init my-rollout
      fedtier simulate --config my-rollout/rollout.toml
    """
    from commands.starter import write_starter

    written = write_starter(directory, force=force)
    for path in written:
        click.echo(f"wrote {path}{'/' if path.is_dir() else ''}")
    click.echo(f"next: edit {directory / 'rollout.toml'}, then: fedtier simulate --config "
               f"{directory / 'rollout.toml'}")
