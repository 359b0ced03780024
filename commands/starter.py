"""The starter project ``fedtier init DIR`` writes: a commented rollout, a model factory, data.

Everything a newcomer edits is in ``rollout.toml``, with the alternatives commented out next to
the choice made; ``model.py`` is a torch factory for the example data; the data is
scikit-learn's digits as a CSV, already split into one shard per device by the same code as
``fedtier data split``. ``fedtier simulate --config DIR/rollout.toml`` runs it as written.
"""

from __future__ import annotations

from pathlib import Path

from fleet_data.split import SplitOptions, split_table, write_example_csv
from fleet_data.tables import read_table
from fedtier.errors import ConfigError

DEVICES = 6
ROLLOUT_FILE = "rollout.toml"
MODEL_FILE = "model.py"
DATA_FILE = "data.csv"
SHARDS_DIR = "shards"

MODEL_PY = '''"""A model factory for fedtier: returns (torch.nn.Module, an example input batch).

fedtier calls it on the coordinator only, under torch.manual_seed([model] init_seed), exports
the module to ONNX and ships the training artifacts to the devices (which never need torch).
Rows of the data are reshaped to the example's shape: here 64 pixel values -> 1 x 8 x 8.
Keep to layers onnxruntime-training can train (no BatchNorm or Dropout).
"""

import torch
from torch import nn


class DigitsNet(nn.Module):
    """A small convolutional network for 8x8 digits: conv 3x3 -> max-pool -> linear."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)  # (batch, 8, 4, 4)
        return self.head(x.flatten(1))  # logits: (batch, classes)


def make_model():
    return DigitsNet(), torch.zeros(1, 1, 8, 8)
'''

ROLLOUT_TOML = f'''# A fedtier rollout: your own model, trained on your own data across a fleet.
#
#   fedtier simulate --config rollout.toml         # every node in one process (runs as written)
#   fedtier coordinator run --config rollout.toml  # the cloud, over MQTT (set [broker] below)
#
# Every key is documented in docs/configuration.md; your own model and data in docs/models.md.

rollout = "starter"          # id in every MQTT topic; a new id starts a new rollout
algorithm = "fedavg"         # fedavg | hier_qsgd | qhetfed | hist (hist: the built-in mlp only)
rounds = 10                  # global rounds
seed = 0                     # names every random stream (minibatches, quantizers)
state_dir = "state"          # coordinator database, artifacts, metrics.json

[model]
# Your torch model: a function returning (torch.nn.Module, example input batch), in {MODEL_FILE}.
kind = "torch"
factory = "{MODEL_FILE}:make_model"   # or "package.module:function"
loss = "cross_entropy"       # cross_entropy (class labels) | bce (targets in [0, 1]) | mse (float targets)
init_seed = 0                # the factory runs under torch.manual_seed(init_seed)
#
# Or a model you exported to ONNX yourself (one batch-first input, one (batch, outputs) output):
# kind = "onnx"
# path = "model.onnx"
# trainable = ["head.weight", "head.bias"]   # default: every float initializer; the rest stay frozen
#
# Or a built-in model, sized from the data:
# kind = "mlp"
# hidden = [64]

[data]
# Your data: one shard per device, written by
#   fedtier data split --input {DATA_FILE} --label-column label --devices {DEVICES} --partition dirichlet \\
#       --alpha 0.5 --holdout 0.2 --test-fraction 0.2 --out {SHARDS_DIR} --force
# Each device trains on <dir>/<device>/train.npz and evaluates every round's incoming global model
# on <dir>/<device>/eval/ (federated evaluation, reported per round). Re-run the split when you
# change the number of devices below.
dataset = "files"
dir = "{SHARDS_DIR}"
eval_file = "{SHARDS_DIR}/test.npz"   # optional central test set the coordinator evaluates on
#
# Or data bundled with scikit-learn / generated (no files needed):
# dataset = "digits"         # digits | breast_cancer | synthetic
# partition = "dirichlet"    # iid | shards | dirichlet | cell_shards
# alpha = 0.5
# holdout = 0.2              # each device's held-out share for federated evaluation

[topology]
cells = 2                    # edge cells: cell-a, cell-b, ... (one gateway each)
devices_per_cell = 3         # devices dev-00 ... dev-05, matching the shards' names
# members = {{ cell-a = ["dev-00", "dev-01"], cell-b = ["dev-02"] }}   # or list them yourself

[fedavg]
local_steps = 20             # SGD steps per device per round
lr = 0.3                     # learning rate
batch_size = 32
# quorum = 0.8               # close a round with 80 % of the devices once deadline_s passed
# deadline_s = 60

# [broker]                   # for `fedtier coordinator run`: the cloud broker
# host = "127.0.0.1"
# port = 1883

# [privacy]                  # differential privacy (docs/privacy.md); turns federated evaluation off
# epsilon = 8.0
# clip = 1.0
# [topology.trusted]
# cell-a = true
'''


def write_starter(directory: Path, *, force: bool = False) -> list[Path]:
    """Write the starter project into ``directory``; return the files written.

    Raises:
        ConfigError: ``directory`` holds files already (and ``force`` is not set).
    """
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()) and not force:
        raise ConfigError(f"{directory} is not empty (use --force to write into it)", key="DIR")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ROLLOUT_FILE).write_text(ROLLOUT_TOML)
    (directory / MODEL_FILE).write_text(MODEL_PY)
    write_example_csv(directory / DATA_FILE)
    table = read_table(directory / DATA_FILE, "label")
    split_table(table, SplitOptions(devices=DEVICES, partition="dirichlet", alpha=0.5, holdout=0.2,
                                    test_fraction=0.2), directory / SHARDS_DIR, source=DATA_FILE, force=True)
    return [directory / ROLLOUT_FILE, directory / MODEL_FILE, directory / DATA_FILE, directory / SHARDS_DIR]
