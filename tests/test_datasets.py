"""Dataset registration: synthetic generation is all-or-nothing, and a rerun is identical."""

from __future__ import annotations

from pathlib import Path

import pytest

import warehouse.synthetic as synthetic
from warehouse.datasets import create_synthetic, synthetic_is_current


def data_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "data").rglob("*.parquet"))}


def test_killed_generation_leaves_the_previous_dataset_and_rerun_is_identical(wh_vocab, monkeypatch):
    first = create_synthetic(wh_vocab, "synthetic", patients=120, seed=5, shard_size=50)
    files = data_files(wh_vocab.meds_dir("synthetic"))
    assert len(files) == 3 and synthetic_is_current(wh_vocab, "synthetic", 120, 5)
    real_generate = synthetic.generate

    def killed(out_dir, **kwargs):
        real_generate(out_dir, **{**kwargs, "n_patients": 60})  # a partial write, then the process dies
        raise KeyboardInterrupt("killed during generation")

    monkeypatch.setattr(synthetic, "generate", killed)
    with pytest.raises(KeyboardInterrupt):
        create_synthetic(wh_vocab, "synthetic", patients=120, seed=5, shard_size=50)
    assert data_files(wh_vocab.meds_dir("synthetic")) == files  # the registered dataset is untouched
    monkeypatch.setattr(synthetic, "generate", real_generate)
    again = create_synthetic(wh_vocab, "synthetic", patients=120, seed=5, shard_size=50)
    assert data_files(wh_vocab.meds_dir("synthetic")) == files
    assert again["fingerprint"] == first["fingerprint"]
    assert wh_vocab.read("datasets").height == 1
    assert not [p for p in wh_vocab.meds_dir("synthetic").parent.iterdir() if p.name.startswith(".")]
    assert not synthetic_is_current(wh_vocab, "synthetic", 121, 5)
