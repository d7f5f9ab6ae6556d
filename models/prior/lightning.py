"""A thin LightningModule: losses, optimiser and validation P@20/R@20 around `PriorNet`."""

from __future__ import annotations

import lightning as L
import torch

from models.prior.config import PriorConfig
from models.prior.nn import PriorNet, next_visit_loss, router_losses, visit_multi_hot


def precision_recall_at_k(scores: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row P@k and R@k; scores (N, O), labels (N, O) 0/1. Rows without labels get R = 0.

    >>> s = torch.tensor([[0.9, 0.8, 0.1]]); y = torch.tensor([[1.0, 0.0, 1.0]])
    >>> [round(float(v), 3) for t in precision_recall_at_k(s, y, 2) for v in t]
    [0.5, 0.5]
    """
    k = min(k, scores.shape[1])
    hits = labels.gather(1, scores.topk(k, dim=1).indices).sum(1)  # (N,)
    return hits / k, hits / labels.sum(1).clamp(min=1)


def trim(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cut padding beyond the longest sequence and the fullest visit of the batch.

    Codes fill each visit's slots from the front, so slicing the slot axis drops padding only.
    """
    V = int(batch["lengths"].max())
    C = max(1, int((batch["codes"] > 0).sum(-1).max()))
    trimmed = {k: (v[:, :V] if k in ("codes", "numeric", "dx") else v) for k, v in batch.items()}
    trimmed["codes"] = trimmed["codes"][:, :, :C]
    return trimmed


class PriorModule(L.LightningModule):
    def __init__(self, net: PriorNet, cfg: PriorConfig):
        super().__init__()
        self.net, self.cfg = net, cfg
        self.epoch_stats: dict[str, list[torch.Tensor]] = {}

    def _collect(self, name: str, value: torch.Tensor) -> None:
        self.epoch_stats.setdefault(name, []).append(value.detach())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        batch = trim(batch)
        scores, _, aux = self.net(batch["codes"], batch["numeric"], batch["lengths"], batch["dx"])
        task = next_visit_loss(scores, batch["dx"], batch["lengths"])
        balance, z = router_losses(aux)
        loss = task + self.cfg.balance_loss_weight * balance + self.cfg.z_loss_weight * z
        for name, value in (("train_loss", loss), ("train_task_loss", task), ("train_balance_loss", balance),
                            ("train_z_loss", z)):
            self._collect(name, value)
        for layer, stats in enumerate(aux):
            if "load" in stats:
                self._collect(f"router_load_l{layer}", stats["load"])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        batch = trim(batch)
        scores, _, _ = self.net(batch["codes"], batch["numeric"], batch["lengths"], batch["dx"], last_only=True)
        labels = visit_multi_hot(batch["labels"].unsqueeze(1), scores.shape[-1]).squeeze(1)  # (B, O)
        for k in (10, 20):
            precision, recall = precision_recall_at_k(scores, labels, k)
            self._collect(f"val_precision_at_{k}", precision)
            self._collect(f"val_recall_at_{k}", recall)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def pop_epoch_metrics(self) -> dict[str, float]:
        """Means of what was collected since the last call; router loads as one metric per expert."""
        metrics: dict[str, float] = {}
        for name, values in self.epoch_stats.items():
            if name.startswith("router_load"):
                load = torch.stack(values).mean(0)
                metrics.update({f"{name}_e{e}": float(v) for e, v in enumerate(load)})
                metrics[f"{name}_max_over_uniform"] = float(load.max() * load.numel())
            elif name.startswith("val_"):
                metrics[name] = float(torch.cat(values).mean())
            else:
                metrics[name] = float(torch.stack(values).mean())
        self.epoch_stats = {}
        return metrics
