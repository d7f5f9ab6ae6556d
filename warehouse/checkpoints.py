"""Where a prior's training keeps its resume checkpoint: `<data_dir>/mlflow/checkpoints/<run_id>/<system>/last.ckpt`.

Beside the data dir's MLflow store and its copies of registered models (`mlflow/cache`): what a training in progress
needs and nothing else reads. One directory per training (run id and system), so what goes with the training also
takes the scratch siblings a write killed midway left there (`warehouse.scratch`). The training writes it after each
finished epoch (`models.prior.train.EpochCheckpoint`) and removes it once the training is recorded finished
(`tasks.prior.train_prior`); `dxr cohort delete` removes those of the cohort's trainings. Anyone may delete the folder
at any time: a rerun then trains from its first epoch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

CHECKPOINTS_DIR = Path("mlflow") / "checkpoints"
CHECKPOINT_FILE = "last.ckpt"


def training_checkpoint(root: Path, run_id: str, system: str) -> Path:
    """The resume checkpoint of run `run_id`'s training of `system` in the data dir `root`."""
    return root / CHECKPOINTS_DIR / run_id / system / CHECKPOINT_FILE


def remove_training_checkpoint(root: Path, run_id: str, system: str) -> None:
    """Remove a training's checkpoint directory, then the run's and the checkpoints' directories left empty."""
    shutil.rmtree(training_checkpoint(root, run_id, system).parent, ignore_errors=True)
    remove_emptied_checkpoint_dirs(root, run_id)


def remove_emptied_checkpoint_dirs(root: Path, run_id: str) -> None:
    """Remove the run's checkpoint directory and the checkpoints' own when they are empty: `rmdir` leaves one that
    another training has put its checkpoint in meanwhile."""
    for directory in (root / CHECKPOINTS_DIR / run_id, root / CHECKPOINTS_DIR):
        try:
            directory.rmdir()
        except OSError:  # not empty, or gone
            return
