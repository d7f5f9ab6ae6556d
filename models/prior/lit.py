"""Lightning wrappers: the data module reading the warehouse, and a thin module around `PriorNet`.

Kept apart from the featurization and the networks so that inference never imports Lightning.
"""

from __future__ import annotations

import duckdb
import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from models.prior.config import PriorConfig
from models.prior.data import (SequenceDataset, build_vocabulary, load_tuning_pretarget, training_sequences,
                               trim, validation_pairs)
from models.prior.nn import PriorNet, router_losses, visit_losses, visit_multi_hot


def precision_recall_at_k(scores: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row P@k and R@k; scores (N, O), labels (N, O) 0/1. Rows without labels get R = 0.

    >>> s = torch.tensor([[0.9, 0.8, 0.1]]); y = torch.tensor([[1.0, 0.0, 1.0]])
    >>> [round(float(v), 3) for t in precision_recall_at_k(s, y, 2) for v in t]
    [0.5, 0.5]
    """
    k = min(k, scores.shape[1])
    hits = labels.gather(1, scores.topk(k, dim=1).indices).sum(1)  # (N,)
    return hits / k, hits / labels.sum(1).clamp(min=1)


class PriorModule(L.LightningModule):
    def __init__(self, net: PriorNet, cfg: PriorConfig):
        super().__init__()
        self.net, self.cfg = net, cfg
        self.epoch_stats: dict[str, list] = {}
        self._epoch_metrics: tuple[int, dict[str, float]] | None = None

    def _collect(self, name: str, value: torch.Tensor) -> None:
        """Keep the value as Python numbers. Keeping each step's small tensors alive between the large
        per-step ones fragmented the heap: +4 MB resident per step with 25,000 output codes."""
        self.epoch_stats.setdefault(name, []).append(value.detach().tolist())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        batch = trim(batch)
        scores, _, aux = self.net(batch["codes"], batch["numeric"], batch["static"], batch["lengths"], batch["dx"])
        task, later = visit_losses(scores, batch["dx"], batch["lengths"],
                                   self.cfg.later_visits if self.cfg.later_weight else 0, batch.get("targets"))
        balance, z = router_losses(aux)
        loss = (task + self.cfg.later_weight * later + self.cfg.balance_loss_weight * balance
                + self.cfg.z_loss_weight * z)
        for name, value in (("train_loss", loss), ("train_task_loss", task), ("train_later_loss", later),
                            ("train_balance_loss", balance), ("train_z_loss", z)):
            self._collect(name, value)
        for layer, stats in enumerate(aux):
            if "load" in stats:
                self._collect(f"router_load_l{layer}", stats["load"])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        batch = trim(batch)
        scores, _, _ = self.net(batch["codes"], batch["numeric"], batch["static"], batch["lengths"], batch["dx"],
                                last_only=True)
        labels = visit_multi_hot(batch["labels"].unsqueeze(1), scores.shape[-1]).squeeze(1)  # (B, O)
        # A visit whose codes all lie outside the output vocabulary has no recall to measure.
        has_label = labels.sum(1) > 0
        scores, labels = scores[has_label], labels[has_label]
        for k in (10, 20):
            precision, recall = precision_recall_at_k(scores, labels, k)
            self._collect(f"val_precision_at_{k}", precision)
            self._collect(f"val_recall_at_{k}", recall)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def epoch_metrics(self) -> dict[str, float]:
        """This epoch's statistics, computed at the first request after its validation.

        Several callbacks read them at the end of an epoch; whichever asks first pops them.
        """
        if self._epoch_metrics is None or self._epoch_metrics[0] != self.current_epoch:
            self._epoch_metrics = (self.current_epoch, self.pop_epoch_metrics())
        return self._epoch_metrics[1]

    def pop_epoch_metrics(self) -> dict[str, float]:
        """Means of what was collected since the last call; router loads as one metric per expert."""
        metrics: dict[str, float] = {}
        for name, values in self.epoch_stats.items():
            if name.startswith("router_load"):
                load = torch.tensor(values).mean(0)
                metrics.update({f"{name}_e{e}": float(v) for e, v in enumerate(load)})
                metrics[f"{name}_max_over_uniform"] = float(load.max() * load.numel())
            elif name.startswith("val_"):
                # No labelled pair, no value: a 0 would make `KeepBestEpoch` keep the first epoch's weights.
                if n_rows := sum(map(len, values)):
                    metrics[name] = sum(map(sum, values)) / n_rows  # mean over rows
            else:
                metrics[name] = sum(values) / len(values)
        self.epoch_stats = {}
        return metrics


class LengthBucketBatches(Sampler[list[int]]):
    """Seeded shuffled batches of similar sequence length, so a batch carries little visit padding.

    Each epoch: shuffle, cut into pools of 50 batches, sort each pool by length, cut into batches,
    shuffle the batch order. Epoch e uses seed + e, so runs repeat exactly.
    """

    def __init__(self, lengths: torch.Tensor, batch_size: int, seed: int, pool_batches: int = 50):
        self.lengths, self.batch_size, self.seed, self.pool = lengths, batch_size, seed, batch_size * pool_batches
        self.epoch = 0

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch `epoch`'s: a fit resumed after epoch k (`models.prior.train.EpochCheckpoint`)
        makes the sampler anew, which would otherwise count from 0."""
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        order = torch.randperm(len(self.lengths), generator=g)
        batches = []
        for start in range(0, len(order), self.pool):
            pool = order[start:start + self.pool]
            pool = pool[torch.argsort(self.lengths[pool], stable=True)]
            batches.extend(pool[i:i + self.batch_size].tolist() for i in range(0, len(pool), self.batch_size))
        for i in torch.randperm(len(batches), generator=g).tolist():
            yield batches[i]


class PriorDataModule(L.LightningDataModule):
    """Training sequences from train patients; validation pairs from tuning pre-target records."""

    def __init__(self, con: duckdb.DuckDBPyConnection, cohort_id: str, cfg: PriorConfig):
        super().__init__()
        self.con, self.cohort_id, self.cfg = con, cohort_id, cfg

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):
            return
        self.vocab = build_vocabulary(self.con, self.cohort_id, self.cfg.min_code_count)
        train, self.n_train_patients = training_sequences(self.con, self.cohort_id, self.vocab, self.cfg)
        self.train_set = SequenceDataset(train)
        tuning = load_tuning_pretarget(self.con, self.cohort_id)
        self.val_set = SequenceDataset(*validation_pairs(tuning, "trajectory_id", self.vocab, self.cfg))

    def train_dataloader(self) -> DataLoader:
        sampler = LengthBucketBatches(self.train_set.t.lengths, self.cfg.batch_size, self.cfg.seed)
        return DataLoader(self.train_set, batch_sampler=sampler, collate_fn=SequenceDataset.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.cfg.predict_batch_size, collate_fn=SequenceDataset.collate)
