"""EHR Prior networks and data: shapes, masking, routing losses, determinism, a planted pattern."""

from __future__ import annotations

import datetime as dt
import doctest
import math
import re

import duckdb
import lightning as L
import numpy as np
import polars as pl
import pytest
import torch
import torch.nn.functional as F

from dxr.errors import InputError
from models.prior import data as prior_data, lit as prior_lit, tracking as prior_tracking, train as prior_train
from models.prior.config import PriorConfig
from models.prior.data import Vocabulary, drop_last_visit, training_sequences, trim, visit_tensors
from models.prior.lit import PriorDataModule, precision_recall_at_k
from models.prior.nn import (N_HISTORY_FEATURES, MoEFeedForward, NetConfig, PriorNet, SparseHistory,
                             history_features, init_weights, visit_losses, visit_multi_hot)
from models.prior.planted import dx, write_planted_cohort
from models.prior.train import fit_network
from warehouse.cohorts import encounter_starts_sql
from warehouse.store import Warehouse

TINY = dict(d_model=16, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16, dropout=0.0)


def random_batch(B=3, V=5, C=4, O=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 1])[:B]
    codes = torch.randint(2, 20, (B, V, C), generator=g)
    dx_ids = torch.randint(0, O, (B, V, 2), generator=g)
    numeric = torch.rand(B, V, 2, generator=g)
    static = torch.tensor([[2, 3], [4, 0], [0, 0]])[:B]  # the last sequence has no static code
    pad = torch.arange(V)[None, :] >= lengths[:, None]
    codes[pad], dx_ids[pad], numeric[pad] = 0, O, 0.0
    return codes, numeric, static, lengths, dx_ids


@pytest.mark.parametrize("n_layers", [1, 2])
@pytest.mark.parametrize("arch", ["moe", "dense", "gru"])
def test_shapes_and_padding_do_not_leak(arch, n_layers):
    torch.manual_seed(0)
    net = PriorNet(NetConfig(n_input_codes=20, n_output_codes=7, arch=arch, max_visits=5,
                             **{**TINY, "n_layers": n_layers})).eval()
    codes, numeric, static, lengths, dx_ids = random_batch()
    scores, states, aux = net(codes, numeric, static, lengths, dx_ids)
    assert scores.shape == (3, 5, 7) and states.shape == (3, 5, 16)
    assert len(aux) == (0 if arch == "gru" else n_layers)
    # The last-visit forecast runs its final block for the last positions only: same scores and states.
    last, last_states, _ = net(codes, numeric, static, lengths, dx_ids, last_only=True)
    assert last.shape == (3, 7) and last_states.shape == (3, 16)
    assert torch.allclose(last, scores[torch.arange(3), lengths - 1], atol=1e-5)
    assert torch.allclose(last_states, states[torch.arange(3), lengths - 1], atol=1e-5)
    # Garbage in padded visits must not change any real position's scores (causal + token mask).
    noisy = codes.clone()
    noisy[1, 2:] = 5
    noisy_dx = dx_ids.clone()
    noisy_dx[2, 1:] = 3
    again, _, _ = net(noisy, numeric, static, lengths, noisy_dx, last_only=True)
    assert torch.allclose(again, last, atol=1e-5)
    # Static codes change every position of their own sequence only.
    other_sex = static.clone()
    other_sex[0, 0] = 5
    moved, _, _ = net(codes, numeric, other_sex, lengths, dx_ids)
    assert not torch.allclose(moved[0], scores[0], atol=1e-4)
    assert torch.allclose(moved[1:], scores[1:], atol=1e-5)


def dense(history: SparseHistory, B: int, V: int, O: int) -> torch.Tensor:
    """The sparse history as (B, V, O, F), or (B, O, F) when at the last visit; zeros where no entry."""
    if history.last_only:
        out = torch.zeros(B, O, N_HISTORY_FEATURES)
        out[history.rows, history.codes] = history.features
    else:
        out = torch.zeros(B, V, O, N_HISTORY_FEATURES)
        out[history.rows, history.positions, history.codes] = history.features
    return out


def test_history_features_count_recency_and_latest():
    dx_ids = torch.tensor([[[0, 3], [1, 3], [0, 3], [3, 3]]])  # O = 3, padding id 3; visit 3 is padding
    lengths = torch.tensor([3])
    feats = dense(history_features(dx_ids, lengths, 3, last_only=True), 1, 4, 3)[0]  # (O, F)
    assert feats[:, 0].tolist() == pytest.approx([torch.log1p(torch.tensor(2.0)).item(),
                                                  torch.log1p(torch.tensor(1.0)).item(), 0.0])
    assert feats[:, 1].tolist() == pytest.approx([1.0, 0.5, 0.0])  # code 0 seen now, code 1 one visit ago
    assert feats[:, 2].tolist() == [1.0, 0.0, 0.0]
    every = dense(history_features(dx_ids, lengths, 3), 1, 4, 3)[0]  # (V, O, F)
    assert torch.equal(every[2], feats)
    assert not every[0, 1:].any() and every[1, 1].tolist() == pytest.approx([math.log(2), 1.0, 1.0])
    assert not every[3].any()  # nothing at a padded position


def test_last_visit_history_features_match_the_per_position_ones():
    codes, numeric, static, lengths, dx_ids = random_batch(O=7)
    dx_ids[0, 1, 1] = 7  # a padded diagnosis slot inside a real visit
    dx_ids[1, 3] = torch.tensor([2, 5])  # ids beyond a sequence's length must not count
    dx_ids[0, 2] = torch.tensor([4, 4])  # a repeated id counts its visit once
    every = dense(history_features(dx_ids, lengths, 7), 3, 5, 7)  # (B, V, O, F)
    last = history_features(dx_ids, lengths, 7, last_only=True)
    assert len(last.rows) == int((every[torch.arange(3), lengths - 1, :, 0] > 0).sum())  # history codes only
    assert torch.allclose(dense(last, 3, 5, 7), every[torch.arange(3), lengths - 1])
    assert not every[1, 2:].any()  # positions beyond the sequence's length hold nothing


def test_sparse_repeat_term_equals_the_dense_formula():
    torch.manual_seed(1)
    net = PriorNet(NetConfig(n_input_codes=20, n_output_codes=7, max_visits=5, **TINY)).eval()
    codes, numeric, static, lengths, dx_ids = random_batch(O=7)
    scores, states, _ = net(codes, numeric, static, lengths, dx_ids)  # (B, V, O)
    history = dense(history_features(dx_ids, lengths, 7), 3, 5, 7)  # (B, V, O, F)
    head = net.head
    repeat = head.repeat(states) + (history * head.feature_weights(states).unsqueeze(-2)).sum(-1)
    expected = head.generate(states) + (history[..., 0] > 0).float() * repeat
    real = torch.arange(5)[None, :] < lengths[:, None]
    assert torch.allclose(scores[real], expected[real], atol=1e-5)


def test_loss_masks_pairs_beyond_each_sequence():
    codes, numeric, static, lengths, dx_ids = random_batch()
    scores = torch.zeros(3, 5, 7)
    # With zero logits each code costs log 2; only the 4 + 1 + 0 real pairs count.
    task, _ = visit_losses(scores, dx_ids, lengths, later_visits=0)
    assert task.item() == pytest.approx(7 * torch.log(torch.tensor(2.0)).item())
    labels = visit_multi_hot(dx_ids, 7)
    assert labels[2, 1:].sum() == 0


def later_loss(scores: torch.Tensor, dx_ids: torch.Tensor, lengths: torch.Tensor, n_visits: int) -> float:
    return visit_losses(scores, dx_ids, lengths, n_visits)[1].item()


def test_later_visits_loss_targets_the_codes_of_the_visits_after_the_next():
    O = 4
    # One record of 4 visits coding {0}, {1}, {2}, {1, 3}, padded to 5 visits with O; a record of 2 visits has
    # no visit t+2 and adds nothing.
    dx_ids = torch.tensor([[[0, O], [1, O], [2, O], [1, 3], [O, O]],
                           [[0, O], [1, O], [O, O], [O, O], [O, O]]])
    lengths = torch.tensor([4, 2])
    scores = torch.full((2, 5, O), -30.0)
    scores[0, 0, [1, 2, 3]] = 30.0  # position 0's later visits (2 and 3) code {2, 1, 3}; 1 is visit t+1's too
    scores[0, 1, [1, 3]] = 30.0  # position 1's later visit (3) codes {1, 3}
    assert later_loss(scores, dx_ids, lengths, n_visits=3) == pytest.approx(0.0, abs=1e-6)
    # One visit ahead only: position 0 sees visit 2 ({2}), so its scores for 1 and 3 cost 30 each.
    assert later_loss(scores, dx_ids, lengths, n_visits=1) == pytest.approx(30.0, rel=1e-4)
    # A wrong score at a position without a visit t+2 (position 2 of the first record, any of the second) is free.
    scores[0, 2], scores[1] = 30.0, 30.0
    assert later_loss(scores, dx_ids, lengths, n_visits=3) == pytest.approx(0.0, abs=1e-6)


def test_visit_losses_equal_dense_bce_with_multi_hot_labels_and_their_gradients():
    """The sparse label term must give the loss and gradients of BCE over (B, V, O) multi-hot labels, ids
    repeated within a visit or across the later visits included."""
    torch.manual_seed(3)
    B, V, D, O = 6, 7, 5, 11
    scores = torch.randn(B, V, O, dtype=torch.float64, requires_grad=True)
    dx_ids = torch.randint(0, O + 1, (B, V, D))  # O is padding; small O makes repeats certain
    lengths = torch.tensor([7, 6, 3, 2, 1, 5])
    hot = visit_multi_hot(dx_ids, O).double()  # (B, V, O)
    position = torch.arange(V)[None, :]
    bce = F.binary_cross_entropy_with_logits
    next_mask = position[:, :-1] < (lengths - 1)[:, None]
    expected_task = (bce(scores[:, :-1], hot[:, 1:], reduction="none").sum(-1) * next_mask).sum() / next_mask.sum()
    later_hot = torch.zeros_like(hot)
    for ahead in (2, 3, 4):
        later_hot[:, :V - ahead] = torch.maximum(later_hot[:, :V - ahead], hot[:, ahead:])
    later_mask = position < (lengths - 2)[:, None]
    expected_later = (bce(scores, later_hot, reduction="none").sum(-1) * later_mask).sum() / later_mask.sum()

    task, later = visit_losses(scores, dx_ids, lengths, later_visits=3)
    assert task.item() == pytest.approx(expected_task.item(), rel=1e-12)
    assert later.item() == pytest.approx(expected_later.item(), rel=1e-12)
    gradient = torch.autograd.grad(task + 0.5 * later, scores)[0]
    expected_gradient = torch.autograd.grad(expected_task + 0.5 * expected_later, scores)[0]
    assert torch.allclose(gradient, expected_gradient, rtol=0, atol=1e-12)


def test_a_visit_that_may_not_be_a_target_withholds_its_pairs_from_both_losses():
    O = 3
    # One record of 5 visits coding {0}, {1}, {2}, {0}, {1} whose visit 2 may not be the target of the visits before
    # it (they hold what was coded after its cutoff), padded to 6 visits: the padded visit withholds nothing.
    dx_ids = torch.tensor([[[0], [1], [2], [0], [1], [O]]])
    lengths, targets = torch.tensor([5]), torch.tensor([[True, True, False, True, True, False]])
    scores = torch.randn(1, 6, O, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def bce(position: int, codes: set[int]) -> float:
        labels = torch.tensor([float(c in codes) for c in range(O)], dtype=torch.float64)
        return F.binary_cross_entropy_with_logits(scores[0, position], labels, reduction="sum").item()

    task, later = visit_losses(scores, dx_ids, lengths, later_visits=2, targets=targets)
    # Task pairs 0→1, 2→3, 3→4 (not 1→2); later windows {3, 4} of position 1 and {4} of position 2 (not {2, 3}).
    assert task.item() == pytest.approx((bce(0, {1}) + bce(2, {0}) + bce(3, {1})) / 3, rel=1e-12)
    assert later.item() == pytest.approx((bce(1, {0, 1}) + bce(2, {1})) / 2, rel=1e-12)
    # Without targets every pair counts, as it did before.
    task, later = visit_losses(scores, dx_ids, lengths, later_visits=2)
    assert task.item() == pytest.approx((bce(0, {1}) + bce(1, {2}) + bce(2, {0}) + bce(3, {1})) / 4, rel=1e-12)
    assert later.item() == pytest.approx((bce(0, {2, 0}) + bce(1, {0, 1}) + bce(2, {1})) / 3, rel=1e-12)


def test_a_stay_nested_in_a_longer_one_is_trained_on_the_record_its_forecast_sees(wh_vocab, tmp_path):
    from tests.conftest import dx as icd10, nested_stay_meds
    from warehouse.cohorts import CohortOptions, build_cohort
    from warehouse.datasets import ingest_meds

    ingest_meds(wh_vocab, nested_stay_meds(tmp_path / "meds"), "nested")
    # Every encounter a target, so the forecasting store holds the pre-target record of train trajectory 2:205 too.
    cid = build_cohort(wh_vocab, "nested", "every", CohortOptions(target="every"), seed=7)["cohort_id"]
    con, cfg = wh_vocab.connect(), PriorConfig(min_code_count=1)
    vocab = prior_data.build_vocabulary(con, cid, min_code_count=1)
    tensors, _ = training_sequences(con, cid, vocab, cfg)

    def tokens(row: int, visit: int) -> list[str]:
        return [vocab.input_codes[i - 2] for i in tensors.codes[row, visit].tolist() if i > 1]

    lab = "LAB//HBA1C//%//q0"
    # Subject 2's sequence: 201, 202, the outer 204 (its N179 coded on day 20), the inner 205 (admitted on day 12).
    # 205 is no target of that sequence: the visits before it hold N179, which its forecast cannot know.
    assert tensors.keys == [2, (2, 205)]
    assert [tokens(0, v) for v in range(4)] == [[icd10("E119"), icd10("I10"), lab], [icd10("I10"), icd10("J189"), lab],
                                                [icd10("N179"), lab], [icd10("J189"), lab]]
    assert tensors.targets[0].tolist() == [True, True, True, False]
    # Its pair: the record cut at 205's admission (204 has no diagnosis before then, so it is no visit), then 205.
    assert tensors.lengths.tolist() == [4, 3] and tensors.targets[1].tolist() == [False, False, True, False]
    assert [tokens(1, v) for v in range(2)] == [[icd10("E119"), icd10("I10"), lab], [icd10("I10"), icd10("J189"), lab]]
    assert [vocab.output_codes[i] for i in tensors.dx.dense()[1, 2].tolist() if i < vocab.n_output] == [icd10("J189")]
    # The same tensors as the forecast of 205 builds from its pre-target record.
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:2:205")
    served = visit_tensors(pretarget, "trajectory_id", vocab, cfg)
    C, S = served.codes.shape[2], served.static.shape[1]
    assert torch.equal(tensors.codes[1, :2, :C], served.codes[0]) and tensors.codes[1, :2, C:].sum() == 0
    assert torch.equal(tensors.numeric[1, :2], served.numeric[0])
    assert torch.equal(tensors.static[1, :S], served.static[0]) and tensors.static[1, S:].sum() == 0


def test_a_nested_stays_pair_holds_no_more_visits_than_the_network_embeds(wh_vocab, tmp_path):
    from tests.conftest import dx as icd10, nested_stay_meds
    from warehouse.cohorts import CohortOptions, build_cohort
    from warehouse.datasets import ingest_meds

    ingest_meds(wh_vocab, nested_stay_meds(tmp_path / "meds"), "nested")
    cid = build_cohort(wh_vocab, "nested", "every", CohortOptions(target="every"), seed=7)["cohort_id"]
    con, cfg = wh_vocab.connect(), PriorConfig(min_code_count=1, max_visits=2, **TINY)
    vocab = prior_data.build_vocabulary(con, cid, min_code_count=1)
    tensors, _ = training_sequences(con, cid, vocab, cfg)
    # Subject 2's sequence keeps its last 2 visits (204, 205); the pair of 205 the last of its cut record (202),
    # then 205: a third visit had no position embedding, and training failed with 'index out of range in self'.
    assert tensors.keys == [2, (2, 205)] and tensors.lengths.tolist() == [2, 2] and tensors.codes.shape[1] == 2
    assert [vocab.input_codes[i - 2] for i in tensors.codes[1, 0].tolist() if i > 1] == [
        icd10("I10"), icd10("J189"), "LAB//HBA1C//%//q0"]
    assert tensors.targets[1].tolist() == [False, True]
    net = PriorNet(NetConfig(vocab.n_input, vocab.n_output, max_visits=2, **TINY)).eval()
    batch = trim({"codes": tensors.codes, "numeric": tensors.numeric, "static": tensors.static,
                  "lengths": tensors.lengths, "dx": tensors.dx.dense()})
    assert net(batch["codes"], batch["numeric"], batch["static"], batch["lengths"], batch["dx"])[0].shape == (
        2, 2, vocab.n_output)


@pytest.mark.parametrize("arch", ["moe", "dense", "gru"])
def test_a_forecast_reads_the_visits_training_inputs_hold_not_the_untrained_last_position(arch):
    from models.prior.forecaster import RegisteredPrior

    t = dt.datetime
    codes = [dx("A"), dx("B"), dx("C"), dx("D")]
    events = pl.DataFrame({"trajectory_id": "t", "time": [t(2020, 1, 1), t(2020, 2, 1), t(2020, 3, 1), t(2020, 4, 1)],
                           "code": codes, "encounter_id": [1, 2, 3, 4]})
    cfg = PriorConfig(max_visits=3, **TINY)
    vocab = Vocabulary(input_codes=codes, output_codes=codes, omega=codes)
    torch.manual_seed(0)
    net = PriorNet(NetConfig(vocab.n_input, vocab.n_output, arch=arch, max_visits=3, **TINY)).eval()
    # A training sequence holds at most max_visits = 3 visits, the third only ever a target: no loss trains
    # position 2 as an input. A forecast that read the record's last visit there would score NaN.
    with torch.no_grad():
        net.visits.position.weight[2] = float("nan")
    forecaster = RegisteredPrior()
    forecaster.vocab, forecaster.train_cfg, forecaster.batch_size = vocab, cfg, 8
    forecaster.net, forecaster.output_codes = net, np.array(codes, dtype=object)
    ranked = forecaster.predict(pl.DataFrame({"trajectory_id": ["t"]}), events, 4)
    assert sorted(ranked["code"].to_list()) == codes and ranked["score"].is_finite().all()
    # It reads the 2 most recent visits, C and D, at positions 0 and 1.
    kept = visit_tensors(events, "trajectory_id", vocab, prior_data.input_config(cfg), keys=["t"])
    assert kept.lengths.tolist() == [2] and kept.codes[0, :, 0].tolist() == [4, 5]


def test_a_validation_record_whose_last_visit_is_nested_is_cut_at_its_cutoff():
    t = dt.datetime
    # Two tuning records of one patient (target rule every) share encounters 1-3: record "a", cut on day 30, holds
    # the outer stay 2 with the diagnosis Y coded at its discharge (day 20) and the nested stay 3 (days 12-14, Z);
    # record "b", cut on day 15, holds stay 2 without a diagnosis yet (no visit) and stay 3.
    day = [t(2020, 1, d) for d in range(1, 31)]
    a = [(day[0], "HOSPITAL_ADMISSION//E", 1), (day[2], dx("X"), 1), (day[9], "HOSPITAL_ADMISSION//E", 2),
         (day[19], dx("Y"), 2), (day[11], "HOSPITAL_ADMISSION//E", 3), (day[13], dx("Z"), 3)]
    b = [row for row in a if row[1] != dx("Y")]
    events = pl.DataFrame({"trajectory_id": ["a"] * len(a) + ["b"] * len(b), "time": [r[0] for r in a + b],
                           "code": [r[1] for r in a + b], "encounter_id": [r[2] for r in a + b]})
    vocab = Vocabulary(input_codes=[dx("X"), dx("Y"), dx("Z")], output_codes=[dx("X"), dx("Y"), dx("Z")],
                       omega=[dx("X"), dx("Y"), dx("Z")])
    inputs, labels = prior_data.validation_pairs(events, "trajectory_id", vocab, PriorConfig())
    # "b" keeps its last visit as the label of the visits before it; "a"'s last visit, 3, follows the outer stay,
    # whose Y its forecast cannot know: its pair is "a" cut at 3's admission (day 12), which leaves visit 1 only.
    assert inputs.keys == ["b", ("a", 3)]
    assert inputs.lengths.tolist() == [1, 1] and inputs.codes[:, 0, 0].tolist() == [2, 2]  # X
    assert labels.dense()[:, 0].tolist() == [[2], [2]]  # Z


def test_each_token_uses_top_k_experts_and_balance_loss_tracks_imbalance():
    cfg = NetConfig(n_input_codes=4, n_output_codes=2, **TINY)
    moe = MoEFeedForward(cfg)
    x = torch.randn(2, 6, 16)
    mask = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        moe.router.weight.zero_()
        out, aux = moe(x, mask)
    # Uniform router probabilities: the balance loss is exactly 1 whatever the tie-breaking.
    assert aux["balance_loss"].item() == pytest.approx(1.0)
    assert aux["z_loss"].item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2, rel=1e-5)
    assert aux["load"].sum().item() == pytest.approx(1.0)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:2, 0] = 10.0  # with feature 0 near 5, every token prefers experts 0 and 1
        moe.router.weight[0, 0] += 0.1
        _, skewed = moe(x.clone().index_fill_(2, torch.tensor([0]), 5.0), mask)
    assert skewed["load"].tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0])
    assert skewed["balance_loss"].item() > 1.5
    # Masked (padded) tokens are neither routed nor written.
    mask[1, 3:] = False
    out, aux = moe(x, mask)
    assert torch.equal(out[1, 3:], torch.zeros(3, 16))


def test_visit_tensors_orders_visits_and_keeps_empty_keys():
    t = dt.datetime
    events = pl.DataFrame({
        "trajectory_id": ["a"] * 6,
        "time": [t(1950, 1, 1), t(2020, 1, 1), t(2020, 1, 3), t(2020, 1, 11), t(2020, 1, 11), t(2020, 1, 12)],
        "code": ["MEDS_BIRTH", dx("X"), "PROCEDURE//ICD//10//P", dx("Y"), "MEDICATION//NAME//m", "LAB//k//u"],
        "encounter_id": [None, 1, 1, 2, 2, 3]})
    vocab = Vocabulary(input_codes=[dx("X"), dx("Y"), "PROCEDURE//ICD//10//P"], output_codes=[dx("Y")],
                       omega=[dx("X"), dx("Y")])
    out = visit_tensors(events, "trajectory_id", vocab, PriorConfig(max_visits=4, max_codes_per_visit=3),
                        keys=["a", "empty"])
    assert out.lengths.tolist() == [2, 1]  # encounter 3 has no diagnosis: not a visit
    assert out.codes.shape[1] == out.dx.visits == 2  # padded to the longest record, not max_visits
    assert out.codes.dtype == out.dx.dense().dtype == torch.int32
    batch = trim({"codes": out.codes, "numeric": out.numeric, "lengths": out.lengths, "dx": out.dx.dense()})
    assert batch["dx"].dtype == torch.int64
    assert out.codes[0, 0].tolist() == [2, 4, 0]  # diagnosis X, then procedure P
    assert out.codes[0, 1].tolist() == [3, 1, 0]  # Y, then the unknown medication
    assert out.dx.dense()[0, :2, 0].tolist() == [1, 0]  # X is not an output code (padding id 1); Y is 0
    assert out.numeric[0, 1, 0].item() == pytest.approx(torch.log1p(torch.tensor(10.0)).item() / 5)
    assert out.numeric[0, 0, 1].item() == pytest.approx(70.0 / 100, abs=0.01)
    assert out.codes[1].sum() == 0
    assert out.history.rows() == [(0, 0, dx("X"))]  # Ω code outside the output vocabulary, for copying
    inputs, labels = drop_last_visit(out, vocab.n_output)
    assert inputs.keys == ["a"] and inputs.lengths.tolist() == [1] and labels.dense()[0, 0].tolist() == [0]
    assert inputs.codes[0, 1].sum() == 0


def test_one_wide_visit_widens_only_the_batches_that_hold_it():
    # A visit coded with hundreds of diagnoses (an export that files a problem list under one encounter) used to pad
    # the diagnoses of every visit of every sequence to its width: 5.5 GB instead of 1.3 GB to train on a cohort of
    # 10,000 patients with one such visit.
    wide = [dx(f"W{i:03}") for i in range(300)]
    day = dt.datetime(2020, 1, 1)
    rows = ([("wide", day, code, 1) for code in wide] + [("wide", day + dt.timedelta(days=30), dx("X"), 2)]
            + [("a", day, dx("X"), 3), ("a", day + dt.timedelta(days=30), dx("Y"), 4)])
    events = pl.DataFrame(rows, schema=["trajectory_id", "time", "code", "encounter_id"], orient="row")
    codes = sorted([*wide, dx("X"), dx("Y")])
    vocab = Vocabulary(input_codes=codes, output_codes=codes, omega=codes)
    out = visit_tensors(events, "trajectory_id", vocab, PriorConfig(), keys=["a", "wide"])
    assert out.dx.ids.numel() == 303  # the diagnoses recorded, not 2 sequences x 2 visits x 300 slots
    assert [vocab.output_codes[i] for i in out.dx.dense()[1, 0].tolist()] == wide
    dataset = prior_data.SequenceDataset(out)
    [narrow] = torch.utils.data.DataLoader(dataset, batch_sampler=[[0]], collate_fn=dataset.collate)
    [both] = torch.utils.data.DataLoader(dataset, batch_sampler=[[0, 1]], collate_fn=dataset.collate)
    assert narrow["dx"].tolist() == [[[codes.index(dx("X"))], [codes.index(dx("Y"))]]]
    assert both["dx"].shape == (2, 2, 300)
    inputs, labels = drop_last_visit(out, vocab.n_output)
    assert inputs.dx.dense().shape == (2, 2, 300) and labels.dense().shape == (2, 1, 1)


def test_an_encounters_undated_diagnoses_belong_to_its_visit():
    # A source may keep diagnoses undated (the cohort counts such an encounter as history): encounter 2
    # is a visit that starts at its dated lab and holds its undated diagnosis.
    t = dt.datetime
    events = pl.DataFrame({
        "trajectory_id": ["a"] * 4,
        "time": [t(2020, 1, 1), t(2020, 2, 1), None, t(2020, 2, 1)],
        "code": [dx("X"), "LAB//k//u", dx("Y"), "MEDICATION//NAME//m"],
        "encounter_id": [1, 2, 2, 2]})
    vocab = Vocabulary(input_codes=[dx("X"), dx("Y"), "MEDICATION//NAME//m"], output_codes=[dx("X"), dx("Y")],
                       omega=[dx("X"), dx("Y")])
    out = visit_tensors(events, "trajectory_id", vocab, PriorConfig(), keys=["a"])
    assert out.lengths.tolist() == [2]
    assert out.codes[0, 1, :2].tolist() == [3, 4]  # Y, then the medication
    assert out.dx.dense()[0, :, 0].tolist() == [0, 1]
    assert out.numeric[0, 1, 0].item() == pytest.approx(torch.log1p(torch.tensor(31.0)).item() / 5)


def test_a_record_without_birth_gets_the_mean_age_of_train_visits_and_old_models_keep_age_zero():
    t = dt.datetime
    # Train patient 1: born 1950, diagnosed visits on 2020-01-01 and 2030-01-01 (25,567 and 29,220 days old), a
    # lab-only encounter (no visit); patient 2 has no birth and does not count.
    train = pl.DataFrame({
        "cohort_id": "c", "subject_id": [1, 1, 1, 1, 1, 2],
        "time": [t(1950, 1, 1), t(2020, 1, 1), t(2030, 1, 1), t(2030, 1, 3), t(2040, 1, 1), t(2020, 1, 1)],
        "code": ["MEDS_BIRTH", dx("X"), "LAB//k//u", dx("X"), "LAB//k//u", dx("X")],
        "numeric_value": [None, None, 1.0, None, 2.0, None], "encounter_id": [None, 1, 2, 2, 3, 4]},
        schema_overrides={"numeric_value": pl.Float32})
    con = duckdb.connect()
    con.register("train_events", train.with_columns(text_value=pl.lit(None, pl.String)).to_arrow())
    con.register("cohort_vocabulary", pl.DataFrame({"cohort_id": ["c"], "code": [dx("X")]}).to_arrow())
    vocab = prior_data.build_vocabulary(con, "c", min_code_count=1)
    assert vocab.age_fill == pytest.approx((25567 + 29220) / 2 / 365.25, abs=1e-9)
    record = pl.DataFrame({"trajectory_id": ["a", "a"], "time": [t(2021, 1, 1), t(2022, 1, 1)],
                           "code": [dx("X"), dx("X")], "encounter_id": [7, 8]})
    ages = visit_tensors(record, "trajectory_id", Vocabulary(**vocab.to_json()), PriorConfig()).numeric[0, :, 1]
    assert ages.tolist() == pytest.approx([vocab.age_fill / 100] * 2)
    # A model registered before age_fill existed was trained with age 0 for such records and keeps it.
    registered = {key: value for key, value in vocab.to_json().items() if key != "age_fill"}
    assert visit_tensors(record, "trajectory_id", Vocabulary(**registered), PriorConfig()).numeric[0, :, 1].tolist() \
        == [0.0, 0.0]


def test_the_mean_age_of_train_visits_is_the_same_bits_whatever_order_duckdbs_threads_add_it_in():
    # Two trainings on the same data must register the same `age_fill`: a float sum over parallel partial
    # aggregates gave a different last digit nearly every time on these 55,000 rows (17 values in 20 calls).
    rng = np.random.default_rng(0)
    patients, visits_each = 5000, 10
    births = pl.DataFrame({"subject_id": np.arange(patients), "encounter_id": None, "code": "MEDS_BIRTH",
                           "time": rng.integers(-30 * 365 * 86_400, 0, patients) * 1_000_000},
                          schema_overrides={"encounter_id": pl.Int64})
    visits = pl.DataFrame({"subject_id": np.repeat(np.arange(patients), visits_each),
                           "encounter_id": np.arange(patients * visits_each), "code": dx("X"),
                           "time": rng.integers(0, 50 * 365 * 86_400, patients * visits_each) * 1_000_000})
    train = pl.concat([births, visits]).with_columns(pl.col("time").cast(pl.Datetime("us")), cohort_id=pl.lit("c"))
    con = duckdb.connect()
    con.execute("SET threads = 8")
    con.register("train_events", train.to_arrow())
    ages = {prior_data.mean_visit_age(con, "c") for _ in range(10)}
    assert len(ages) == 1
    ages_us = (visits.join(births, on="subject_id", suffix="_birth")
               .select(pl.col("time") - pl.col("time_birth"))["time"].to_list())
    assert ages.pop() == pytest.approx(sum(ages_us) / len(ages_us) / 86_400_000_000 / 365.25, rel=1e-12)


def test_an_undated_birth_leaves_its_patients_visits_out_of_the_mean_age():
    # visit_tensors gives a visit whose birth has no time the fill age, as one without a MEDS_BIRTH: such visits are
    # no ages to average. Counted with a NULL sum they dragged the mean towards 0, or failed on an all-NULL sum.
    def train(birth_times):
        births = pl.DataFrame({"subject_id": [1, 2], "encounter_id": [None, None], "code": "MEDS_BIRTH",
                               "time": birth_times}, schema_overrides={"encounter_id": pl.Int64,
                                                                      "time": pl.Datetime("us")})
        visits = pl.DataFrame({"subject_id": [1, 2], "encounter_id": [10, 20], "code": dx("X"),
                               "time": [dt.datetime(2020, 1, 1), dt.datetime(2020, 1, 1)]},
                              schema_overrides={"time": pl.Datetime("us")})
        con = duckdb.connect()
        con.register("train_events", pl.concat([births, visits]).with_columns(cohort_id=pl.lit("c")).to_arrow())
        return prior_data.mean_visit_age(con, "c")

    one_dated = train([dt.datetime(1950, 1, 1), None])
    assert one_dated == pytest.approx((dt.datetime(2020, 1, 1) - dt.datetime(1950, 1, 1)).days / 365.25, rel=1e-12)
    assert train([None, None]) == 0.0


def test_static_codes_become_per_record_ids():
    t = dt.datetime(2020, 1, 1)
    events = pl.DataFrame({
        "trajectory_id": ["a", "a", "a", "a", "a", "b", "b", "b", "b"],
        "time": [None, None, t, dt.datetime(2020, 6, 1), None, None, t, None, None],
        "code": ["GENDER//F", "ETHNICITY//X", dx("X"), dx("X"), dx("Y"), "GENDER//M", dx("X"), dx("Y"),
                 "MEDICATION//NAME//m"],
        # Y has no time but belongs to encounter 3: an undated event of a visit, not a fact of the patient
        # (as a static code, a later visit's diagnosis would reach every earlier visit's input). Neither are b's
        # undated Y and m without an encounter (a problem or medication list taken at extraction, left out of
        # pre-target views).
        "encounter_id": [None, None, 1, 3, 3, None, 2, None, None]})
    vocab = Vocabulary(input_codes=["GENDER//F", "GENDER//M", dx("X"), dx("Y"), "MEDICATION//NAME//m"],
                       output_codes=[dx("X")], omega=[dx("X")])
    out = visit_tensors(events, "trajectory_id", vocab, PriorConfig(), keys=["b", "a", "none"])
    # Row order follows `keys`; a static code outside the vocabulary is dropped, not made unknown.
    assert out.static.tolist() == [[3], [2], [0]] and out.static.dtype == torch.int32
    assert drop_last_visit(out, vocab.n_output)[0].static.tolist() == [[2]]  # "a", the one record with two visits


def test_a_full_visit_keeps_diagnoses_then_procedures_then_medications_then_labs():
    at = dt.datetime(2020, 1, 1)
    codes = [dx("X"), "LAB//k//u", "MEDICATION//NAME//m", "PROCEDURE//ICD//10//P"]
    events = pl.DataFrame({"trajectory_id": ["a"] * 4, "time": [at] * 4, "code": codes,
                           "numeric_value": [None, 2.5, None, None], "encounter_id": [1] * 4})
    vocab = Vocabulary(input_codes=sorted([dx("X"), "LAB//k//u//q2", "MEDICATION//NAME//m", "PROCEDURE//ICD//10//P"]),
                       output_codes=[dx("X")], omega=[dx("X")], lab_cuts={"LAB//k//u": [1.0, 2.0, 3.0, 4.0]})
    ids = {code: i + 2 for i, code in enumerate(vocab.input_codes)}
    order = [dx("X"), "PROCEDURE//ICD//10//P", "MEDICATION//NAME//m", "LAB//k//u//q2"]
    for width in (4, 3, 2):
        out = visit_tensors(events, "trajectory_id", vocab, PriorConfig(max_codes_per_visit=width))
        assert out.codes[0, 0].tolist() == [ids[c] for c in order[:width]], width


def test_a_visit_keeps_each_code_once_and_codes_of_a_kind_in_code_order_whatever_their_events_order():
    at = dt.datetime(2020, 1, 1)
    codes = ["MEDICATION//NAME//c", dx("Y"), "MEDICATION//NAME//a", "MEDICATION//NAME//zz", "MEDICATION//NAME//a",
             dx("X"), "MEDICATION//NAME//b"]
    events = pl.DataFrame({"trajectory_id": ["a"] * 7, "time": [at] * 7, "code": codes, "encounter_id": [1] * 7})
    vocab = Vocabulary(input_codes=[dx("X"), dx("Y"), "MEDICATION//NAME//a", "MEDICATION//NAME//b",
                                    "MEDICATION//NAME//c"], output_codes=[dx("Y"), dx("X")], omega=[dx("X"), dx("Y")])
    ids = {code: i + 2 for i, code in enumerate(vocab.input_codes)}
    kept = [dx("X"), dx("Y"), "MEDICATION//NAME//a", "MEDICATION//NAME//b", "MEDICATION//NAME//c"]
    for width in (7, 4):
        out = visit_tensors(events, "trajectory_id", vocab, PriorConfig(max_codes_per_visit=width))
        assert out.codes[0, 0].tolist() == ([ids[c] for c in kept] + [1, 0])[:width], width  # zz: unknown, last
        assert out.dx.ids.tolist() == [1, 0]  # X then Y, by code, as output ids


def test_each_records_visits_hold_their_own_codes_and_history_in_the_rows_keys_give():
    # Rows in the order of `keys` (one without a visit between), and only the most recent max_visits visits: the
    # oldest visit of b, with its H, is gone. H and Z are Ω diagnoses without an output: the history that `predict`
    # scores, once per visit that holds them.
    day = dt.timedelta(days=1)
    at = dt.datetime(2020, 1, 1)
    visits = {("b", 1, at): [dx("H"), dx("X")], ("b", 2, at + 10 * day): ["MEDICATION//NAME//m", dx("H"), dx("H")],
              ("b", 3, at + 20 * day): [dx("Y"), dx("H")], ("a", 4, at): [dx("Z"), dx("X")]}
    events = pl.DataFrame([(key, time, code, encounter) for (key, encounter, time), codes in visits.items()
                           for code in codes], schema=["trajectory_id", "time", "code", "encounter_id"], orient="row")
    vocab = Vocabulary(input_codes=[dx("H"), dx("X"), dx("Y"), "MEDICATION//NAME//m"], output_codes=[dx("X"), dx("Y")],
                       omega=[dx("H"), dx("X"), dx("Y"), dx("Z")])
    out = visit_tensors(events, "trajectory_id", vocab, PriorConfig(max_visits=2, max_codes_per_visit=2),
                        keys=["b", "none", "a"])
    assert out.lengths.tolist() == [2, 1, 1]
    assert out.codes.tolist() == [[[2, 5], [2, 4]], [[0, 0], [0, 0]], [[3, 1], [0, 0]]]  # H, m; H, Y; X, unknown Z
    assert out.dx.counts.tolist() == [[0, 1], [0, 0], [1, 0]] and out.dx.ids.tolist() == [1, 0]  # b: Y; a: X
    assert sorted(out.history.rows()) == [(0, 0, dx("H")), (0, 1, dx("H")), (2, 0, dx("Z"))]
    assert out.history.schema == pl.Schema({"row": pl.Int64, "pos": pl.Int64, "code": pl.String})


def test_precision_recall_and_trim():
    p, r = precision_recall_at_k(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), torch.tensor([[0.0, 1.0, 1.0, 1.0]]), 2)
    assert (p.item(), r.item()) == (0.5, pytest.approx(1 / 3))
    codes, numeric, static, lengths, dx_ids = random_batch()
    short = trim({"codes": codes[1:], "numeric": numeric[1:], "static": static[1:].int(), "lengths": lengths[1:],
                  "dx": dx_ids[1:]})
    assert short["codes"].shape == (2, 2, 4) and short["dx"].shape == (2, 2, 2)
    assert short["static"].dtype == torch.int64


def test_validation_metrics_skip_label_visits_without_output_codes():
    module = prior_lit.PriorModule(PriorNet(NetConfig(n_input_codes=20, n_output_codes=7, **TINY)), PriorConfig())
    codes, numeric, static, lengths, dx_ids = random_batch()
    labels = torch.tensor([[1, 3], [7, 7], [2, 7]])  # the middle label visit has only codes outside the vocabulary
    module.validation_step({"codes": codes, "numeric": numeric, "static": static, "lengths": lengths, "dx": dx_ids,
                            "labels": labels}, 0)
    assert [len(rows) for rows in module.epoch_stats["val_recall_at_20"]] == [2]
    assert module.pop_epoch_metrics()["val_recall_at_20"] == 1.0  # 7 output codes: top-20 holds them all


def test_an_epoch_without_a_labelled_validation_pair_has_no_validation_metric():
    module = prior_lit.PriorModule(PriorNet(NetConfig(n_input_codes=20, n_output_codes=7, **TINY)), PriorConfig())
    codes, numeric, static, lengths, dx_ids = random_batch()
    labels = torch.full((3, 2), 7)  # every label visit holds only codes outside the output vocabulary
    module.validation_step({"codes": codes, "numeric": numeric, "static": static, "lengths": lengths, "dx": dx_ids,
                            "labels": labels}, 0)
    metrics = module.pop_epoch_metrics()
    # Not a recall of 0: epoch selection would then keep the first epoch's weights instead of the last's.
    assert not [name for name in metrics if name.startswith("val_")], metrics


def test_epoch_metrics_are_means_of_plain_numbers():
    module = prior_lit.PriorModule(PriorNet(NetConfig(n_input_codes=20, n_output_codes=7, **TINY)), PriorConfig())
    module._collect("train_loss", torch.tensor(2.0, requires_grad=True) * 1)
    module._collect("train_loss", torch.tensor(4.0))
    module._collect("val_recall_at_20", torch.tensor([1.0, 0.0, 0.5]))  # rows of one batch
    module._collect("val_recall_at_20", torch.tensor([0.5]))
    module._collect("router_load_l0", torch.tensor([0.5, 0.25, 0.25, 0.0]))
    module._collect("router_load_l0", torch.tensor([0.5, 0.25, 0.0, 0.25]))
    # Nothing tensor-backed is kept between steps (kept step tensors fragmented the heap at scale).
    assert not any(isinstance(v, torch.Tensor) for values in module.epoch_stats.values() for v in values)
    metrics = module.pop_epoch_metrics()
    assert metrics["train_loss"] == 3.0 and metrics["val_recall_at_20"] == 0.5  # per row, not per batch
    assert [metrics[f"router_load_l0_e{e}"] for e in range(4)] == [0.5, 0.25, 0.125, 0.125]
    assert metrics["router_load_l0_max_over_uniform"] == 2.0 and module.epoch_stats == {}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    wh = Warehouse(tmp_path_factory.mktemp("planted"))
    cohort = write_planted_cohort(wh, n_patients=300, seed=3)
    cfg = PriorConfig(**TINY, epochs=6, batch_size=16, lr=1e-2, min_code_count=1, seed=11)
    data = PriorDataModule(wh.connect(), cohort, cfg)
    data.setup()
    return data, cfg


def test_featurizing_train_patients_in_chunks_equals_featurizing_them_at_once(planted):
    data, cfg = planted
    whole, n_whole = training_sequences(data.con, data.cohort_id, data.vocab,
                                        cfg.model_copy(update={"featurize_chunk_patients": 10**6}))
    chunked, n_chunked = training_sequences(data.con, data.cohort_id, data.vocab,
                                            cfg.model_copy(update={"featurize_chunk_patients": 7}))
    assert n_whole == n_chunked == data.n_train_patients and len(whole) == len(data.train_set) > 7
    assert chunked.keys == whole.keys == sorted(whole.keys)
    for name in ("codes", "numeric", "static", "lengths"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name  # chunks span 5 or 6 visits
    assert torch.equal(chunked.dx.counts, whole.dx.counts) and torch.equal(chunked.dx.ids, whole.dx.ids)


def test_visits_within_a_stay_that_spans_them_are_cut_a_batch_at_a_time(monkeypatch):
    """Each visit within a stay still open at its admission is trained on its record cut there, so one record is
    cut once per such visit: one train patient with 2,000 daily visits within a stay spanning them all took a
    training's peak to 6.3 GB. The records are cut in batches of about `CUT_BATCH_EVENTS` events, with the same
    training sequences."""
    import models.pretarget as pretarget

    day = dt.datetime(2020, 1, 1)
    rows = [(100, day, "HOSPITAL_ADMISSION//EMERGENCY"), (100, day + dt.timedelta(days=28), dx("O"))]
    for i in range(20):
        admitted = day + dt.timedelta(days=1 + i)
        rows += [(101 + i, admitted, "HOSPITAL_ADMISSION//EMERGENCY"), (101 + i, admitted, dx("AB"[i % 2])),
                 (101 + i, admitted, "MEDICATION//NAME//m")]
    con = duckdb.connect()
    con.register("rows", pl.DataFrame([("c", 1, time, code, None, None, encounter) for encounter, time, code in rows],
                                      schema=["cohort_id", "subject_id", "time", "code", "numeric_value",
                                              "text_value", "encounter_id"], orient="row"))
    con.execute("CREATE TABLE train_events AS SELECT * REPLACE (numeric_value::DOUBLE AS numeric_value, "
                "text_value::VARCHAR AS text_value) FROM rows")
    codes = [dx("A"), dx("B"), dx("O")]
    vocab = Vocabulary(input_codes=[*codes, "MEDICATION//NAME//m"], output_codes=codes, omega=codes)
    whole, _ = training_sequences(con, "c", vocab, PriorConfig())
    cuts = []

    def counted(*args):
        cut = cut_records(*args)
        cuts.append(cut[2])
        return cut

    cut_records = pretarget.cut_records
    monkeypatch.setattr(pretarget, "cut_records", counted)
    monkeypatch.setattr(pretarget, "CUT_BATCH_EVENTS", 60)  # the record's 62 events: one visit a batch
    batched, _ = training_sequences(con, "c", vocab, PriorConfig())
    assert [len(names) for names in cuts] == [1] * 20  # each visit's record cut on its own, not the 20 at once
    # The sequence, then a pair of each visit but 101, whose cut record holds no visit (O is coded after it).
    assert batched.keys == whole.keys and len(whole) == 20
    for name in ("codes", "numeric", "static", "lengths", "targets"):
        assert torch.equal(getattr(batched, name), getattr(whole, name)), name
    assert torch.equal(batched.dx.counts, whole.dx.counts) and torch.equal(batched.dx.ids, whole.dx.ids)


def test_a_train_patient_cap_that_leaves_no_two_visit_patient_names_the_cap():
    t = dt.datetime
    con = duckdb.connect()
    # Subject 1 has one visit, subject 2 two: only a cap of 1 leaves nothing to learn from.
    con.execute("""CREATE TABLE train_events AS SELECT 'c' AS cohort_id, * FROM (VALUES
        (1, TIMESTAMP '2020-01-01', 'DIAGNOSIS//ICD//10//X', NULL::DOUBLE, NULL::VARCHAR, 10),
        (2, TIMESTAMP '2020-01-01', 'DIAGNOSIS//ICD//10//X', NULL, NULL, 20),
        (2, TIMESTAMP '2020-02-01', 'DIAGNOSIS//ICD//10//Y', NULL, NULL, 21))
        AS e(subject_id, time, code, numeric_value, text_value, encounter_id)""")
    vocab = Vocabulary(input_codes=[dx("X"), dx("Y")], output_codes=[dx("X"), dx("Y")], omega=[dx("X"), dx("Y")])
    tensors, n_patients = training_sequences(con, "c", vocab, PriorConfig())
    assert tensors.keys == [2] and n_patients == 2
    with pytest.raises(InputError) as refused:
        training_sequences(con, "c", vocab, PriorConfig(max_train_patients=1))
    assert str(refused.value) == (
        "cohort c: none of the first 1 train patients (--max-train-patients / prior.max_train_patients) has two "
        "visits with diagnoses; raise the cap or leave it unset to train on every train patient")


def test_training_is_deterministic_for_a_seed(planted):
    data, cfg = planted
    one = cfg.model_copy(update={"epochs": 1})
    first, _, _ = fit_network(data, "ehr_prior", one)
    second, _, _ = fit_network(data, "ehr_prior", one)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_progress_lines_within_an_epoch_leave_training_unchanged(planted, monkeypatch):
    # An epoch at 100,000 patients takes minutes with no bar in a log; its lines read the clock only.
    monkeypatch.setattr(prior_train, "PROGRESS_SECONDS", 0.0)  # a line after each batch
    data, cfg = planted
    one, lines = cfg.model_copy(update={"epochs": 1}), []
    silent, _, _ = fit_network(data, "ehr_prior", one)
    logged, _, _ = fit_network(data, "ehr_prior", one, log=lines.append)
    for (name, a), (_, b) in zip(silent.state_dict().items(), logged.state_dict().items()):
        assert torch.equal(a, b), name
    batches = math.ceil(len(data.train_set) / one.batch_size)
    assert [re.sub(r"in \d+\.\d s$", "in S s", line) for line in lines] == [
        f"ehr_prior epoch 1/1: {done}/{batches} batches in S s" for done in range(1, batches + 1)]


def test_tiny_run_learns_the_planted_successor(planted):
    data, cfg = planted
    net, _, _ = fit_network(data, "ehr_prior", cfg)
    val = data.val_set
    with torch.no_grad():
        scores, _, _ = net(val.t.codes, val.t.numeric, val.t.static, val.t.lengths, val.t.dx.dense(), last_only=True)
    # The planted successor S_j of the input's last trigger T_j is in the label by construction.
    codes = data.vocab.output_codes
    last = val.t.dx.dense()[torch.arange(len(val)), val.t.lengths - 1]
    top3 = scores.topk(3, dim=1).indices
    hits = 0
    for row in range(len(val)):
        triggers = [codes[i] for i in last[row].tolist() if i < len(codes) and "//T" in codes[i]]
        successor = codes.index(triggers[0].replace("//T", "//S"))
        hits += successor in top3[row].tolist()
    assert hits / len(val) >= 0.9, f"planted successor in the top 3 for {hits} of {len(val)} tuning pairs"


def test_static_codes_enter_the_vocabulary_and_foretell_a_sex_linked_code(tmp_path):
    wh = Warehouse(tmp_path)
    cohort = write_planted_cohort(wh, n_patients=300, seed=5, sex_linked=True)
    cfg = PriorConfig(**TINY, epochs=6, batch_size=16, lr=1e-2, min_code_count=1, seed=11)
    data = PriorDataModule(wh.connect(), cohort, cfg)
    data.setup()
    assert {"GENDER//F", "GENDER//M"} <= set(data.vocab.input_codes)
    net, _, _ = fit_network(data, "ehr_prior", cfg)
    val = data.val_set
    # Pairs whose label is the second visit: only the patient's sex tells F0 from M0 there.
    second = torch.nonzero(val.t.lengths == 1).squeeze(1)
    female, male = (data.vocab.output_codes.index(dx(c)) for c in ("F0", "M0"))
    is_female = torch.tensor([data.vocab.input_codes[i - 2] == "GENDER//F" for i in val.t.static[second, 0].tolist()])

    def right_sex_ranked_first(static: torch.Tensor) -> float:
        with torch.no_grad():
            scores, _, _ = net(val.t.codes[second], val.t.numeric[second], static, val.t.lengths[second],
                               val.t.dx.dense(second), last_only=True)
        return float(((scores[:, female] > scores[:, male]) == is_female).float().mean())

    assert len(second) >= 10
    assert right_sex_ranked_first(val.t.static[second]) >= 0.9
    assert right_sex_ranked_first(torch.zeros_like(val.t.static[second])) <= 0.75  # without them, a guess


class ValidationRecall(L.Callback):
    def __init__(self):
        self.values: list[float] = []

    def on_train_epoch_end(self, trainer: L.Trainer, module) -> None:
        self.values.append(module.epoch_metrics()["val_recall_at_20"])


def validation_recall(net: PriorNet, data: PriorDataModule) -> float:
    val = data.val_set
    with torch.no_grad():
        scores, _, _ = net(val.t.codes, val.t.numeric, val.t.static, val.t.lengths, val.t.dx.dense(), last_only=True)
    labels = visit_multi_hot(val.labels.dense(), scores.shape[-1]).squeeze(1)
    return float(precision_recall_at_k(scores, labels, 20)[1].mean())


class ScrambleLastEpoch(L.Callback):
    """Replaces the weights by a fresh random init before the last epoch and freezes them there,
    so the last epoch validates an untrained network and cannot be the best one."""

    def on_train_epoch_start(self, trainer: L.Trainer, module) -> None:
        if trainer.current_epoch == trainer.max_epochs - 1:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 0.0
            init_weights(module.net)


def test_training_keeps_the_best_validation_epoch(planted):
    data, cfg = planted
    four = cfg.model_copy(update={"epochs": 4})
    recorded = ValidationRecall()
    net, _, epoch = fit_network(data, "ehr_prior", four, [recorded, ScrambleLastEpoch()])
    best = max(range(len(recorded.values)), key=lambda e: (recorded.values[e], -e))
    assert recorded.values[-1] < recorded.values[best], recorded.values
    assert epoch == best
    assert validation_recall(net, data) == pytest.approx(recorded.values[best], abs=1e-6)

    last_recorded = ValidationRecall()
    last, _, none = fit_network(data, "ehr_prior", four.model_copy(update={"keep_best_epoch": False}),
                                [last_recorded, ScrambleLastEpoch()])
    assert none is None and last_recorded.values == recorded.values
    assert validation_recall(last, data) == pytest.approx(recorded.values[-1], abs=1e-6)


@pytest.mark.parametrize("module", [prior_data, prior_lit, prior_tracking])
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("bad, message", [({"n_heads": 5}, "multiple of n_heads"),
                                          ({"top_k": 5}, "cannot exceed n_experts")])
def test_network_shapes_that_cannot_run_are_rejected_with_the_settings(bad, message):
    with pytest.raises(ValueError, match=message):
        PriorConfig(**bad)


@pytest.mark.parametrize("alias, message", [("v2", "MLflow reserves alias 'v2'"), ("Latest", "MLflow reserves"),
                                            ("my alias", "letters, digits")])
def test_an_alias_mlflow_cannot_point_is_rejected_with_the_settings(alias, message):
    # Not after a training: MLflow refuses it only when the new version is to be put in service, and
    # `ensure_prior` would then train another version at every call.
    with pytest.raises(ValueError, match=message):
        PriorConfig(alias=alias)
    assert PriorConfig(alias="challenger-2").alias == "challenger-2"


def test_events_without_an_encounter_within_a_visits_stay_are_that_visits_tokens():
    # MEDS-Extract's MIMIC-IV ETL writes the pharmacy's orders (MEDICATION//START//…) and the ED draws before an
    # admission without hadm_id. Within a visit's stay, from its first to its last dated own event, they are its
    # tokens; outside any stay (an outpatient order) or without a time they are none. A diagnosis without an
    # encounter stays out even inside a stay: a visit's diagnoses are what its encounter codes, its labels.
    t = dt.datetime
    start, ed_lab, heparin = "MEDICATION//START//Furosemide", "LAB//51003//ng/mL", "MEDICATION//START//Heparin"
    events = pl.DataFrame({
        "trajectory_id": ["a"] * 9,
        "time": [t(2150, 1, 1, 3), t(2150, 1, 1, 4), t(2150, 1, 1, 8), t(2150, 1, 1, 10), t(2150, 1, 2, 9),
                 t(2150, 1, 4, 15), t(2150, 1, 9), t(2150, 3, 1, 8), t(2150, 3, 2, 15)],
        "code": ["TRANSFER_TO//ED//Emergency Department", ed_lab, "HOSPITAL_ADMISSION//EW EMER.//EMERGENCY ROOM",
                 start, dx("Y"), dx("X"), heparin, "HOSPITAL_ADMISSION//ELECTIVE//PHYSICIAN REFERRAL", dx("X")],
        "numeric_value": [None, 0.25, None, None, None, None, None, None, None],
        "encounter_id": [1, None, 1, None, None, 1, None, 2, 2]}, schema_overrides={"numeric_value": pl.Float32})
    vocab = Vocabulary(input_codes=sorted([dx("X"), dx("Y"), start, heparin, f"{ed_lab}//q2"]),
                       output_codes=[dx("X"), dx("Y")], omega=[dx("X"), dx("Y")],
                       lab_cuts={ed_lab: [0.1, 0.2, 0.3, 1.0]}, within_stays=True)
    ids = {code: i + 2 for i, code in enumerate(vocab.input_codes)}
    out = visit_tensors(events, "trajectory_id", vocab, PriorConfig(), keys=["a"])
    assert out.lengths.tolist() == [2]
    assert out.codes[0, 0, :3].tolist() == [ids[dx("X")], ids[start], ids[f"{ed_lab}//q2"]]
    assert out.codes[0, 0, 3:].sum() == 0 and out.codes[0, 1].tolist()[:2] == [ids[dx("X")], 0]
    assert out.dx.dense()[0, 0].tolist() == [0]  # X alone: the untagged Y is no label
    # A model registered before (its vocabulary.json has no within_stays) was trained without them and keeps that.
    registered = {key: value for key, value in vocab.to_json().items() if key != "within_stays"}
    old = visit_tensors(events, "trajectory_id", Vocabulary(**registered), PriorConfig(), keys=["a"])
    assert old.codes[0, 0].tolist()[:2] == [ids[dx("X")], 0]



def test_an_event_within_a_stay_that_spans_a_nested_one_is_the_outer_stays_after_the_nested_one_ended():
    # Admission 1 (days 1 to 20) spans admission 2 (days 8 to 10), as MIMIC holds a few. A pharmacy order on day 9 is
    # within both (the one begun last takes it), the order stopped on day 15 within admission 1 alone: it is
    # admission 1's, though admission 2 began after admission 1 and before it. An order on day 25 is within none.
    t = dt.datetime
    heparin, stop = "MEDICATION//START//Heparin", "MEDICATION//STOP//Furosemide"
    metformin = "MEDICATION//START//Metformin"
    events = pl.DataFrame({
        "subject_id": 1, "time": [t(2150, 1, 1), t(2150, 1, 8), t(2150, 1, 9), t(2150, 1, 10), t(2150, 1, 15),
                                  t(2150, 1, 20), t(2150, 1, 25)],
        "code": ["HOSPITAL_ADMISSION//E", "HOSPITAL_ADMISSION//E", heparin, dx("Y"), stop, dx("X"), metformin],
        "numeric_value": None, "encounter_id": [1, 2, None, 2, None, 1, None]},
        schema_overrides={"numeric_value": pl.Float32})
    vocab = Vocabulary(input_codes=sorted([dx("X"), dx("Y"), heparin, stop, metformin]),
                       output_codes=[dx("X"), dx("Y")], omega=[dx("X"), dx("Y")], within_stays=True)
    ids = {code: i + 2 for i, code in enumerate(vocab.input_codes)}
    out = visit_tensors(events, "subject_id", vocab, PriorConfig(), keys=[1])
    assert out.codes[0, :, :3].tolist() == [[ids[dx("X")], ids[stop], 0], [ids[dx("Y")], ids[heparin], 0]]
    # The vocabulary counts each where the visits take it: one encounter each, so all but Metformin at 1.
    con = duckdb.connect()
    con.register("train_events",
                 events.with_columns(cohort_id=pl.lit("c"), text_value=pl.lit(None, pl.String)).to_arrow())
    con.register("cohort_vocabulary", pl.DataFrame({"cohort_id": ["c", "c"], "code": [dx("X"), dx("Y")]}).to_arrow())
    assert prior_data.build_vocabulary(con, "c", min_code_count=1).input_codes == [
        dx("X"), dx("Y"), heparin, stop]


def test_an_event_goes_to_the_stay_begun_last_of_those_that_hold_it():
    # Checked against that definition, pair by pair, on random records of nested, overlapping and touching stays:
    # `within_stays` joins an event past its own stay's end to the stays that outlast the next one's start only
    # (every stay of the record was joined before, and one patient's 10,000 untagged labs within a stay spanning
    # 10,000 visits took 7.4 GB).
    from models.stays import within_stays

    rng = np.random.default_rng(3)
    start = dt.datetime(2000, 1, 1)
    for _ in range(200):
        spans, loose = [], []
        for key in range(3):
            for stay in range(int(rng.integers(0, 12))):
                begins = start + dt.timedelta(hours=int(rng.integers(0, 200)))
                length = dt.timedelta(hours=int(rng.choice([0, 1, 5, 30, 100, 300])))
                spans.append((key, key * 100 + stay, begins, begins + length))
            loose += [(key, start + dt.timedelta(hours=int(hour)), "LAB//x//u", None)
                      for hour in rng.integers(-5, 400, int(rng.integers(0, 15)))]
        spans = pl.DataFrame(spans, schema={"key": pl.Int64, "encounter_id": pl.Int64, "start": pl.Datetime("us"),
                                            "end": pl.Datetime("us")}, orient="row")
        events = pl.DataFrame(loose, schema={"key": pl.Int64, "time": pl.Datetime("us"), "code": pl.String,
                                             "encounter_id": pl.Int64}, orient="row")
        expected = []
        for key, time, code, _ in events.iter_rows():
            holders = [(begins, stay) for k, stay, begins, ends in spans.iter_rows()
                       if k == key and begins <= time <= ends]
            if holders:
                expected.append((key, time, code, max(holders)[1]))
        placed = within_stays(events, "key", spans).select(events.columns)
        assert sorted(placed.rows()) == sorted(expected)


def test_the_vocabulary_holds_the_codes_without_an_encounter_that_visits_take():
    t = dt.datetime
    start, outpatient = "MEDICATION//START//Furosemide", "MEDICATION//START//Metformin"
    # Patients 1 and 2 each get Furosemide started untagged during a stay; Metformin only between stays.
    train = pl.DataFrame({
        "cohort_id": "c", "subject_id": [1, 1, 1, 1, 2, 2, 2, 2],
        "time": [t(2150, 1, 1), t(2150, 1, 1, 5), t(2150, 1, 3), t(2150, 2, 1), t(2150, 1, 1), t(2150, 1, 2),
                 t(2150, 1, 3), t(2150, 5, 1)],
        "code": ["HOSPITAL_ADMISSION//E", start, dx("X"), outpatient, "HOSPITAL_ADMISSION//E", start, dx("X"),
                 outpatient],
        "numeric_value": None, "encounter_id": [1, None, 1, None, 2, None, 2, None]},
        schema_overrides={"numeric_value": pl.Float32})
    con = duckdb.connect()
    con.register("train_events", train.with_columns(text_value=pl.lit(None, pl.String)).to_arrow())
    con.register("cohort_vocabulary", pl.DataFrame({"cohort_id": ["c"], "code": [dx("X")]}).to_arrow())
    vocab = prior_data.build_vocabulary(con, "c", min_code_count=2)
    assert vocab.input_codes == [dx("X"), start] and vocab.within_stays
    assert prior_data.build_vocabulary(con, "c", min_code_count=3).input_codes == []


def test_the_ed_draws_and_orders_before_an_admission_are_its_tokens_as_the_cohort_rules_them():
    # An export whose ED transfer row carries no hadm_id either: admission 1's first own event is its admission, five
    # hours after the untagged ED registration. The cohort cuts a trajectory targeting it at the registration
    # (`encounter_starts_sql`: the ED draw and the pharmacy order in between are the target's own); the prior takes
    # them as that visit's tokens by the same rule. Models registered before keep their stays from the first own event.
    t = dt.datetime
    start, ed_lab = "MEDICATION//START//Aspirin", "LAB//51003//ng/mL"
    events = pl.DataFrame({
        "subject_id": 1, "time": [t(2150, 1, 1, 3), t(2150, 1, 1, 4), t(2150, 1, 1, 5), t(2150, 1, 1, 8),
                                  t(2150, 1, 4), t(2150, 3, 1), t(2150, 3, 4)],
        "code": ["ED_REGISTRATION", ed_lab, start, "HOSPITAL_ADMISSION//EW EMER.//EMERGENCY ROOM", dx("X"),
                 "HOSPITAL_ADMISSION//ELECTIVE//PHYSICIAN REFERRAL", dx("Y")],
        "numeric_value": [None, 0.25, None, None, None, None, None], "encounter_id": [None, None, None, 1, 1, 2, 2]},
        schema_overrides={"numeric_value": pl.Float32, "encounter_id": pl.Int64})
    con = duckdb.connect()
    con.register("train_events",
                 events.with_columns(cohort_id=pl.lit("c"), text_value=pl.lit(None, pl.String)).to_arrow())
    con.register("cohort_vocabulary", pl.DataFrame({"cohort_id": ["c", "c"], "code": [dx("X"), dx("Y")]}).to_arrow())
    assert con.execute(f"SELECT encounter_id, claims_from FROM ({encounter_starts_sql('train_events')}) ORDER BY 1"
                       ).fetchall() == [(1, t(2150, 1, 1, 3)), (2, t(2150, 3, 1))]
    vocab = prior_data.build_vocabulary(con, "c", min_code_count=1)
    assert vocab.input_codes == [dx("X"), dx("Y"), *(f"{ed_lab}//q{q}" for q in range(5)), start]
    assert vocab.stays_from_ed_registration and vocab.lab_cuts == {ed_lab: [0.25] * 4}
    ids = {code: i + 2 for i, code in enumerate(vocab.input_codes)}
    out = visit_tensors(events, "subject_id", vocab, PriorConfig(), keys=[1])
    assert out.codes[0, 0].tolist()[:4] == [ids[dx("X")], ids[start], ids[f"{ed_lab}//q0"], 0]
    assert out.numeric[0, 1, 0].item() == pytest.approx(math.log1p(59 - 8 / 24) / 5)  # gaps from the first own event
    registered = {key: value for key, value in vocab.to_json().items() if key != "stays_from_ed_registration"}
    old = visit_tensors(events, "subject_id", Vocabulary(**registered), PriorConfig(), keys=[1])
    assert old.codes[0, 0].tolist()[:2] == [ids[dx("X")], 0] and torch.equal(old.numeric, out.numeric)


def test_mimic_ivs_masked_lab_text_is_no_text_and_makes_no_token():
    # MIMIC-IV writes `___` as the value of a result whose words it moved to `comments` (de-identification): the
    # mask says nothing of the result, yet it made a token `LAB//…//___` for every lab that often has a comment.
    labs = pl.DataFrame({"code": ["LAB//k//u"] * 3, "numeric_value": [None, None, None],
                         "text_value": ["___", " _____ ", "NEG"]}, schema_overrides={"numeric_value": pl.Float64})
    # A vocabulary built before the mask counted as no text may hold its token: it is not made any more.
    tokens = prior_data.lab_value_tokens(labs, {}, {"LAB//k//u": ["NEG", "___"]})
    assert tokens["code"].to_list() == ["LAB//k//u//NEG"]


def test_a_lab_result_without_a_number_is_a_token_of_its_text_when_train_results_give_it_often(wh_vocab, tmp_path):
    # Text-only results (POSITIVE, NEG, >1000) had no token: only numbers were binned into quintiles.
    from tests.conftest import t, tiny_events, write_tiny_meds
    from warehouse.cohorts import CohortOptions, build_cohort
    from warehouse.datasets import ingest_meds

    hiv = "LAB//HIV Antibody (Blood)//no unit"
    rows = [(2, t(0, 7), hiv, None, "Positive", 201), (2, t(5, 7), hiv, None, " POSITIVE ", 202),
            (2, t(5, 8), hiv, None, "see  comment", 202),  # once: no token
            (2, t(5, 9), "LAB//HBA1C//%", None, "ERROR", 202),  # a numeric lab's text: once, no token either
            (2, t(0, 8), hiv, None, "___", 201), (2, t(5, 10), hiv, None, "___", 202),  # MIMIC-IV's mask: no text
            (1, t(10, 7), hiv, None, "positive", 102),
            (1, t(20, 7), hiv, None, "POSITIVE", 103)]  # the target encounter's: never an input
    extra = pl.DataFrame(rows, schema=tiny_events().schema, orient="row")
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "meds", pl.concat([tiny_events(), extra])), "texts")
    cid = build_cohort(wh_vocab, "texts", "final", CohortOptions(), seed=7)["cohort_id"]
    con, cfg = wh_vocab.connect(), PriorConfig(min_code_count=2)
    vocab = prior_data.build_vocabulary(con, cid, min_code_count=2)
    token = f"{hiv}//POSITIVE"
    assert vocab.lab_texts == {hiv: ["POSITIVE"]} and token in vocab.input_codes
    assert [code for code in vocab.input_codes if code.startswith("LAB//")] == [
        *(f"LAB//HBA1C//%//q{q}" for q in range(5)), token]
    assert Vocabulary(**vocab.to_json()) == vocab

    def tokens(t, row: int, visit: int) -> list[str]:
        return [vocab.input_codes[i - 2] for i in t.codes[row, visit].tolist() if i > 1 and
                vocab.input_codes[i - 2].startswith(hiv)]

    tensors, _ = training_sequences(con, cid, vocab, cfg)
    assert tensors.keys == [2] and [tokens(tensors, 0, v) for v in range(2)] == [[token], [token]]
    pretarget = wh_vocab.read("pretarget_events", cohort_id=cid).filter(pl.col("trajectory_id") == f"{cid}:1:103")
    served = visit_tensors(pretarget, "trajectory_id", vocab, cfg)
    assert served.lengths.tolist() == [2] and [tokens(served, 0, v) for v in range(2)] == [[], [token]]
    # A model registered before the field has no text tokens and keeps featurizing as it was trained.
    old = Vocabulary(**{k: v for k, v in vocab.to_json().items() if k != "lab_texts"})
    assert [tokens(visit_tensors(pretarget, "trajectory_id", old, cfg), 0, v) for v in range(2)] == [[], []]
