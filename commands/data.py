"""``fedtier data``: bring your own data — split a table into the per-device shards agents read."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fleet_data.split import SPLIT_PARTITIONS


@click.group()
def data() -> None:
    """Your own data: split a CSV or .npz table into one shard per device.

    \b
    Example (runs as printed; the first command writes scikit-learn's digits as a CSV):
      fedtier data example --out digits.csv
      fedtier data split --input digits.csv --label-column label --devices 6 \\
          --partition dirichlet --alpha 0.5 --test-fraction 0.2 --out shards
    """


@data.command("split")
@click.option("--input", "input_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The table: .csv (one example per row) or .npz (arrays x, y).")
@click.option("--devices", type=click.IntRange(1), required=True,
              help="Number of devices; shards are named dev-00, dev-01, ... as a generated topology names them.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for the shards (<out>/<device>/train.npz and eval/), split.json and test.npz.")
@click.option("--partition", type=click.Choice(SPLIT_PARTITIONS), default="iid", show_default=True,
              help="iid shares, dirichlet label skew (--alpha), or label shards (--classes-per-device).")
@click.option("--label-column", default=None,
              help="CSV: the label column by name or 0-based index (default: the last column); "
                   "comma-separated for several outputs.")
@click.option("--alpha", type=click.FloatRange(min=0, min_open=True), default=0.5, show_default=True,
              help="dirichlet: concentration (small = each device sees few classes).")
@click.option("--classes-per-device", type=click.IntRange(1), default=2, show_default=True,
              help="shards: label classes per device.")
@click.option("--holdout", type=click.FloatRange(0, 0.9), default=0.2, show_default=True,
              help="Share of each device's rows held out for federated evaluation (never trained on).")
@click.option("--test-fraction", type=click.FloatRange(0, 0.9), default=0.0, show_default=True,
              help="Share of all rows split off first as the coordinator's central test set (<out>/test.npz).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random choice.")
@click.option("--force", is_flag=True, help="Write into a non-empty --out.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary (split.json) as JSON.")
def split(input_path: Path, devices: int, out: Path, partition: str, label_column: str | None, alpha: float,
          classes_per_device: int, holdout: float, test_fraction: float, seed: int, force: bool,
          as_json: bool) -> None:
    """Split a table into per-device shards in the format agents read.

    Each device gets <out>/<device>/train.npz and, with --holdout > 0, held-out rows in
    <out>/<device>/eval/ that it evaluates each round's global model on. The devices are named
    dev-00, dev-01, ...: name them so in the rollout's [topology], and `fedtier provision fleet
    --shards <out>` puts each shard in its device's bundle (or point a device's data_dir at its
    shard). Point a rollout at all of them with [data] dataset = "files", dir = "<out>" (and
    eval_file = "<out>/test.npz" with --test-fraction).

    \b
    Example (runs as printed):
      fedtier data example --out digits.csv
      fedtier data split --input digits.csv --label-column label --devices 6 \\
          --partition dirichlet --alpha 0.5 --test-fraction 0.2 --out shards
    """
    from fleet_data.split import SplitOptions, split_table
    from fleet_data.tables import read_table

    table = read_table(input_path, label_column)
    options = SplitOptions(devices=devices, partition=partition, alpha=alpha, classes_per_device=classes_per_device,
                           seed=seed, holdout=holdout, test_fraction=test_fraction)
    summary = split_table(table, options, out, source=str(input_path), force=force)
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    click.echo(f"{summary['rows']} rows of {summary['features']} features -> {devices} devices ({partition}), "
               f"written to {out}/")
    click.echo(f"{'device':<10} {'train':>6} {'eval':>6}  labels")
    for name, entry in summary["devices"].items():
        labels = " ".join(f"{k}:{v}" for k, v in entry.get("labels", {}).items())
        click.echo(f"{name:<10} {entry['train']:>6} {entry['eval']:>6}  {labels}")
    if summary["test"]:
        click.echo(f"central test set: {summary['test']} rows in {out / 'test.npz'}")
    if summary["class_names"]:
        click.echo("classes: " + ", ".join(f"{i}={n}" for i, n in enumerate(summary["class_names"])))


@data.command("example")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="CSV file to write.")
@click.option("--force", is_flag=True, help="Overwrite --out.")
def example(out: Path, force: bool) -> None:
    """Write scikit-learn's bundled digits (1797 8x8 images, 10 classes) as a CSV to try the tools on.

    The header names the 64 pixel columns p0..p63 (scaled to [0, 1]) and the class column label.

    \b
    Example (runs as printed):
      fedtier data example --out digits.csv
    """
    from fleet_data.split import write_example_csv
    from fedtier.errors import ConfigError

    if out.exists() and not force:
        raise ConfigError(f"{out} exists (use --force to overwrite)", key="--out")
    rows = write_example_csv(out)
    click.echo(f"wrote {rows} rows to {out} (label column: label)")
