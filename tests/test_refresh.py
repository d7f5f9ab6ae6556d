"""A nightly refresh of a MEDS extract: registered again under its name, its cohort built again, the run scored.

The earlier cohort must stay as its runs scored it, and every command must say which version of the data a
cohort or a run holds.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dxr.cli import main
from dxr.errors import InputError, NotFoundError
from tasks.evaluate import in_sample_note
from tests.conftest import cli, cut_cohort_builds_short, dx, tiny_events, write_tiny_meds
from warehouse.cohorts import CohortOptions, build_cohort, cohort_id_for
from warehouse.datasets import get_dataset, ingest_meds, ingest_mimic
from warehouse.meds import _size_fingerprint, validate_meds_dir
from warehouse.store import Warehouse

MIMIC4 = Path(__file__).resolve().parent / "fixtures" / "mimic4"


def write_uncompressed(root: Path, events: pl.DataFrame) -> Path:
    """The tiny dataset with its shard stored plain (no compression, no dictionary): a code corrected to another of
    the same length then leaves the file's size and row count as they were."""
    write_tiny_meds(root, events)
    shard = root / "data" / "0.parquet"
    pq.write_table(pq.read_table(shard), shard, compression="NONE", use_dictionary=False)
    return shard


def test_a_correction_that_keeps_every_file_size_is_a_new_cohort_and_leaves_the_scored_one_alone(wh_vocab, tmp_path):
    # Subject 1 (held_out) is coded J18.9 at its target encounter 103; the refresh corrects it to J18.8.
    first = write_uncompressed(tmp_path / "v1", tiny_events())
    at_target = (pl.col("encounter_id") == 103) & (pl.col("code") == dx("J189"))
    corrected = tiny_events().with_columns(code=pl.when(at_target).then(pl.lit(dx("J188"))).otherwise(pl.col("code")))
    second = write_uncompressed(tmp_path / "v2", corrected)
    assert first.stat().st_size == second.stat().st_size  # what sizes and row counts alone could not tell apart

    ingest_meds(wh_vocab, tmp_path / "v1", "hosp")
    before = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]
    scored = wh_vocab.read("targets", cohort_id=before)
    ingest_meds(wh_vocab, tmp_path / "v2", "hosp")
    after = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]

    assert after != before
    assert wh_vocab.read("targets", cohort_id=before).equals(scored)  # as the earlier runs scored it
    target = wh_vocab.read("targets", cohort_id=after).filter(pl.col("trajectory_id") == f"{after}:1:103")
    assert dx("J188") in target["code"].to_list() and dx("J189") not in target["code"].to_list()
    assert wh_vocab.read("cohorts", cohort_id=before)["dataset_fingerprint"][0] != get_dataset(
        wh_vocab, "hosp")["fingerprint"]


def test_a_dataset_registered_before_content_fingerprints_still_builds_its_cohort_under_the_same_id(
        wh_vocab, tmp_path):
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "v1"), "hosp")
    info = validate_meds_dir(wh_vocab.meds_dir("hosp"))
    legacy = get_dataset(wh_vocab, "hosp") | {"fingerprint": _size_fingerprint(info.root, info.shards)}
    wh_vocab.write("datasets", pl.DataFrame([legacy]), dataset_id="hosp")
    assert len(legacy["fingerprint"]) == 16 and info.holds_registered(legacy["fingerprint"])
    row = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)
    assert row["cohort_id"] == cohort_id_for(legacy, CohortOptions(), 7)


def test_the_same_files_registered_again_over_a_size_fingerprint_are_not_called_earlier_files(wh_vocab, tmp_path):
    # A warehouse made by 3da0d44 (size fingerprints, cohorts without dataset_fingerprint), then `dxr synth` of the
    # same seed and patients with today's dxr: byte-identical shards, yet the note said the cohorts "were built from
    # earlier files" and every forecast, evaluation and report of their runs called them an earlier version.
    from warehouse.cohorts import superseded_note

    data_dir = wh_vocab.root
    write_tiny_meds(tmp_path / "v1")
    assert cli(data_dir, "ingest", "meds", tmp_path / "v1", "--name", "hosp")[0] == 0
    info = validate_meds_dir(wh_vocab.meds_dir("hosp"))
    legacy = get_dataset(wh_vocab, "hosp") | {"fingerprint": _size_fingerprint(info.root, info.shards)}
    wh_vocab.write("datasets", pl.DataFrame([legacy]), dataset_id="hosp")
    cohort_id = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]
    # The cohorts row as a dxr before content fingerprints wrote it: its Parquet file has no dataset_fingerprint.
    wh_vocab.read("cohorts", cohort_id=cohort_id).drop("dataset_fingerprint").write_parquet(
        wh_vocab.partition_path("cohorts", cohort_id=cohort_id))
    # Built since by a dxr that records the fingerprint, from the same registration: it records the size one.
    every = build_cohort(wh_vocab, "hosp", "every", CohortOptions(target="every"), seed=7)["cohort_id"]
    assert wh_vocab.read("cohorts", cohort_id=every)["dataset_fingerprint"][0] == legacy["fingerprint"]
    assert cli(data_dir, "forecast", "--cohort", cohort_id, "--system", "repeat_history", "--split", "all",
               "--run-id", "night1")[0] == 0

    code, out, _ = cli(data_dir, "ingest", "meds", tmp_path / "v1", "--name", "hosp")
    assert code == 0 and "earlier files" not in out
    assert f"note: cohort every ({every}) was built under dataset hosp's fingerprint of before 2026-12-05" in out
    assert (f"note: cohort nightly ({cohort_id}) was built under dataset hosp's fingerprint of before 2026-12-05, of "
            "sizes and row counts, which these files match (likely the same files); their fingerprint is now of their "
            "contents. The cohort keeps its tables, and its runs and models stay on its id. To forecast these files, "
            "run `dxr cohort build --dataset hosp --name nightly --target final --harmonize native --min-history 1`: "
            "a new cohort id, which --cohort nightly then names") in out
    dataset = get_dataset(wh_vocab, "hosp")
    note = (f"cohort nightly ({cohort_id}) was built when dataset hosp had a fingerprint of its files' sizes and row "
            f"counts (before 2026-12-05); registered again on {dataset['registered_at']:%Y-%m-%d %H:%M} UTC with "
            f"files of the same sizes and row counts, likely the same, it has a fingerprint of their contents "
            f"({dataset['fingerprint']}), which gives the cohort's options another cohort id")
    assert superseded_note(wh_vocab, wh_vocab.read("cohorts", cohort_id=cohort_id).row(0, named=True)) == note
    # Nor do the notes of its runs call the cohort an earlier version of the files.
    code, _, err = cli(data_dir, "evaluate", "--run", "night1", "--bootstrap", "0")
    assert code == 0 and "sizes and row counts (before 2026-12-05)" in err and "earlier version" not in err
    assert "these scores are of that cohort as it was built" in err
    # The report's stderr says it too (it said only an earlier evaluation's), as `dxr evaluate` does.
    code, _, err = cli(data_dir, "report", "--run", "night1")
    assert code == 0 and err.splitlines() == [  # a run of --split all scores train patients too
        f"note: run night1: {note}: these scores are of that cohort as it was built",
        f"note: run night1: {in_sample_note(wh_vocab, 'night1')}"]
    report = (data_dir / "reports" / "night1" / "report.md").read_text()
    assert f"Earlier cohort: {note}: these scores are of that cohort as it was built." in report
    assert "Earlier data" not in report

    # Files that change while the check reads them (an ingest swapping the directory; the check holds no lock) leave
    # the note in its general wording rather than failing the forecast that writes it.
    cohort_row = wh_vocab.read("cohorts", cohort_id=cohort_id).row(0, named=True)
    shard = next((wh_vocab.meds_dir("hosp") / "data").rglob("*.parquet"))
    saved = shard.read_bytes()
    shard.write_bytes(b"half a file")
    try:
        general = f"with other files (fingerprint {dataset['fingerprint']})"
        assert superseded_note(wh_vocab, cohort_row).endswith(general)
    finally:
        shard.write_bytes(saved)

    # Other files (a new night) are earlier files again, as for a cohort built under a content fingerprint.
    code, out, _ = cli(data_dir, "ingest", "meds", write_next_night(tmp_path / "v2"), "--name", "hosp")
    assert code == 0 and f"note: cohort nightly ({cohort_id}) was built from earlier files of dataset hosp;" in out
    assert f"note: cohort every ({every}) was built from earlier files of dataset hosp;" in out


def fingerprint_with_paths(root: Path) -> str:
    """A MEDS directory's fingerprint as datasets were registered before it left out dataset.json's paths: the
    metadata but its created_at, then the splits, the codes and each shard by name and SHA-256."""
    metadata = json.loads((root / "metadata" / "dataset.json").read_text())
    del metadata["created_at"]
    h = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for path in (root / "metadata" / "subject_splits.parquet", root / "metadata" / "codes.parquet",
                 *sorted((root / "data").rglob("*.parquet"))):
        h.update(f"{path.relative_to(root)}\n".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:24]


def test_a_mimic_import_registered_while_the_fingerprint_hashed_paths_keeps_its_cohort_ids(wh_vocab):
    ingest_mimic(wh_vocab, "mimic4", MIMIC4, "mimic4", seed=7)
    legacy = get_dataset(wh_vocab, "mimic4") | {"fingerprint": fingerprint_with_paths(wh_vocab.meds_dir("mimic4"))}
    assert legacy["fingerprint"] != get_dataset(wh_vocab, "mimic4")["fingerprint"]  # the paths made it another
    wh_vocab.write("datasets", pl.DataFrame([legacy]), dataset_id="mimic4")
    cohort_id = build_cohort(wh_vocab, "mimic4", "m4", CohortOptions(), seed=7)["cohort_id"]
    assert cohort_id == cohort_id_for(legacy, CohortOptions(), 7)

    # The same release ingested again from the same place is recognised: nothing to build again, same id.
    code, out, _ = cli(wh_vocab.root, "ingest", "mimic4", MIMIC4, "--name", "mimic4")
    assert code == 0 and "built from earlier files" not in out
    assert get_dataset(wh_vocab, "mimic4")["fingerprint"] == legacy["fingerprint"]
    assert build_cohort(wh_vocab, "mimic4", "m4", CohortOptions(), seed=7)["cohort_id"] == cohort_id
    assert wh_vocab.read("cohorts")["cohort_id"].to_list() == [cohort_id]


def write_next_night(root: Path) -> Path:
    """The tiny dataset as the next night exports it: a new held_out patient (5, two encounters) and a new
    encounter of train patient 2."""
    added = [(5, None, "GENDER//M", None, None, None), (5, datetime(1960, 1, 1), "MEDS_BIRTH", None, None, None),
             (5, datetime(2020, 3, 1), dx("I10"), None, None, 501),
             (5, datetime(2020, 6, 1), dx("E119"), None, None, 502),
             (2, datetime(2021, 1, 1), dx("I10"), None, None, 203)]
    write_tiny_meds(root, pl.concat([tiny_events(), pl.DataFrame(added, schema=tiny_events().schema, orient="row")]))
    splits = root / "metadata" / "subject_splits.parquet"
    earlier = pl.read_parquet(splits)
    pl.concat([earlier, pl.DataFrame({"subject_id": [5], "split": ["held_out"]}, schema=earlier.schema)]).write_parquet(
        splits)
    return root


def test_a_nightly_refresh_names_the_cohorts_and_runs_that_hold_the_earlier_files(wh_vocab, tmp_path):
    data_dir = wh_vocab.root
    write_tiny_meds(tmp_path / "v1")
    write_next_night(tmp_path / "v2")

    assert cli(data_dir, "ingest", "meds", tmp_path / "v1", "--name", "hosp")[0] == 0
    assert cli(data_dir, "cohort", "build", "--dataset", "hosp", "--name", "nightly")[0] == 0
    old = wh_vocab.read("cohorts")["cohort_id"][0]
    assert cli(data_dir, "forecast", "--cohort", "nightly", "--system", "repeat_history", "--split", "all",
               "--run-id", "night1")[0] == 0

    code, out, _ = cli(data_dir, "ingest", "meds", tmp_path / "v2", "--name", "hosp")
    assert code == 0
    assert (f"note: cohort nightly ({old}) was built from earlier files of dataset hosp; it keeps them, and its runs "
            "their scores. To forecast these files, run `dxr cohort build --dataset hosp --name nightly --target final "
            "--harmonize native --min-history 1`") in out
    code, out, _ = cli(data_dir, "cohort", "build", "--dataset", "hosp", "--name", "nightly")
    new = wh_vocab.read("cohorts").filter(pl.col("cohort_id") != old)["cohort_id"][0]
    assert code == 0 and f"note: --cohort nightly now names this cohort; the 1 earlier one(s) of the name ({old}" in out

    # The same night again: the same files, the same cohort, nothing added.
    code, out, _ = cli(data_dir, "ingest", "meds", tmp_path / "v2", "--name", "hosp")
    assert code == 0 and "note: cohort" not in out
    assert cli(data_dir, "cohort", "build", "--dataset", "hosp", "--name", "nightly")[0] == 0
    assert sorted(wh_vocab.read("cohorts")["cohort_id"]) == sorted([old, new])

    # The run of the earlier night says what it scored; a forecast into it by name finds the new cohort.
    code, out, err = cli(data_dir, "evaluate", "--run", "night1", "--bootstrap", "0")
    assert code == 0 and (f"note: run night1: cohort nightly ({old}) was built from earlier files of dataset hosp, "
                          "registered again on") in err and "these scores are of that cohort as it was built" in err
    assert cli(data_dir, "report", "--run", "night1")[0] == 0
    report = (data_dir / "reports" / "night1" / "report.md").read_text()
    fingerprint = wh_vocab.read("cohorts", cohort_id=old)["dataset_fingerprint"][0]
    assert f"Cohort nightly ({old}), built " in report and f"from dataset hosp (fingerprint {fingerprint})" in report
    assert "Earlier cohort: cohort nightly (" in report and "these scores are of that cohort as it was built." in report
    result = CliRunner().invoke(main, ["--data-dir", str(data_dir), "forecast", "--cohort", "nightly", "--system",
                                       "global_frequency", "--split", "all", "--run-id", "night1"])
    assert result.exit_code == 1 and (f"pass --cohort {old} to add to this run, a new --run-id, or, to discard that "
                                       "run, delete it first (`dxr run delete night1`)") in result.output


def test_the_rebuild_command_of_a_cohort_built_under_another_seed_names_that_seed(wh_vocab, tmp_path, monkeypatch):
    # The seed is a setting, not a flag of `dxr cohort build`, and part of the cohort id: without it the printed
    # command would build a second cohort beside this one, split by the seed in force.
    data_dir = wh_vocab.root
    write_tiny_meds(tmp_path / "v1")
    write_next_night(tmp_path / "v2")
    monkeypatch.setenv("DXR_SEED", "3")
    assert cli(data_dir, "ingest", "meds", tmp_path / "v1", "--name", "hosp")[0] == 0
    assert cli(data_dir, "cohort", "build", "--dataset", "hosp", "--name", "nightly")[0] == 0
    monkeypatch.delenv("DXR_SEED")

    code, out, _ = cli(data_dir, "ingest", "meds", tmp_path / "v2", "--name", "hosp")
    command = ("DXR_SEED=3 dxr cohort build --dataset hosp --name nightly --target final --harmonize native "
               "--min-history 1")
    assert code == 0 and f"run `{command}`" in out
    monkeypatch.setenv("DXR_SEED", "3")  # the command as printed
    assert cli(data_dir, "cohort", "build", "--dataset", "hosp", "--name", "nightly")[0] == 0
    rebuilt = wh_vocab.read("cohorts").sort("created_at")["cohort_id"][-1]
    dataset = get_dataset(wh_vocab, "hosp")
    assert rebuilt == cohort_id_for(dataset, CohortOptions(), 3) != cohort_id_for(dataset, CohortOptions(), 7)
    code, out, _ = cli(data_dir, "ingest", "meds", tmp_path / "v2", "--name", "hosp")
    assert code == 0 and "note: cohort" not in out


def test_a_refresh_names_no_cohort_whose_name_now_finds_another_datasets_cohort(wh_vocab, tmp_path):
    # Once the name nightly is given to a cohort of clinic, --cohort nightly no longer finds hosp's: a refresh of
    # hosp leaves no cohort of that name to build again, and building one would take the name back from clinic.
    from warehouse.cohorts import superseded_cohorts

    write_tiny_meds(tmp_path / "v1")
    at_target = (pl.col("encounter_id") == 103) & (pl.col("code") == dx("J189"))
    write_tiny_meds(tmp_path / "v2", tiny_events().with_columns(
        code=pl.when(at_target).then(pl.lit(dx("J188"))).otherwise(pl.col("code"))))
    ingest_meds(wh_vocab, tmp_path / "v1", "hosp")
    hosp = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]
    ingest_meds(wh_vocab, tmp_path / "v2", "hosp")
    assert [cohort["cohort_id"] for cohort in superseded_cohorts(wh_vocab, "hosp")] == [hosp]

    ingest_meds(wh_vocab, tmp_path / "v1", "clinic")
    build_cohort(wh_vocab, "clinic", "nightly", CohortOptions(), seed=7)
    assert superseded_cohorts(wh_vocab, "hosp") == []


def test_an_icd10_cohort_built_by_the_earlier_rule_is_named_for_its_rule_not_for_earlier_files(wh_vocab, tmp_path):
    # Until 2026-12-06 `--harmonize icd10` built what icd10_closest builds now, under an id that named no rule. Such a
    # cohort holds the dataset's current files: its notes must name the rule, and an ingest of the same files must not
    # list it among the cohorts built from earlier ones.
    from warehouse.cohorts import superseded_note

    write_tiny_meds(tmp_path / "v1")
    assert cli(wh_vocab.root, "ingest", "meds", tmp_path / "v1", "--name", "hosp")[0] == 0
    options = CohortOptions(harmonize="icd10")
    current = build_cohort(wh_vocab, "hosp", "coded", options, seed=7)["cohort_id"]
    dataset = get_dataset(wh_vocab, "hosp")
    # The id such a build gave: the dataset, the seed and the options, no rule.
    payload = json.dumps({"dataset_id": "hosp", "fingerprint": dataset["fingerprint"], "seed": 7, "target": "final",
                          "harmonize": "icd10", "min_history": 1}, sort_keys=True)
    earlier = "c" + hashlib.sha256(payload.encode()).hexdigest()[:11]
    assert earlier != current
    row = wh_vocab.read("cohorts", cohort_id=current).with_columns(cohort_id=pl.lit(earlier), name=pl.lit("coded_2025"))
    wh_vocab.write("cohorts", row, cohort_id=earlier)

    assert superseded_note(wh_vocab, row.row(0, named=True)) == (
        f"cohort coded_2025 ({earlier}) was built from these files of dataset hosp by the icd10 rule of before "
        "2026-12-06, one ICD-10 code per GEM choice list (now --harmonize icd10_closest), whereas icd10 now maps each "
        "ICD-9 code to every target of its GEM rows")
    code, out, _ = cli(wh_vocab.root, "ingest", "meds", tmp_path / "v1", "--name", "hosp")
    assert code == 0 and "note: cohort" not in out


def test_an_icd10_cohort_of_the_earlier_rule_and_a_size_fingerprint_is_named_for_both_not_for_earlier_files(
        wh_vocab, tmp_path):
    # A warehouse of 2026-12-04 (size fingerprints, the earlier icd10 rule), then `dxr synth` of the same seed and
    # patients with today's dxr: the same files, yet the ingest note and every run's note said the icd10 cohort "was
    # built from earlier files", while its native sibling was told apart as size-fingerprinted.
    from warehouse.cohorts import superseded_note

    write_tiny_meds(tmp_path / "v1")
    assert cli(wh_vocab.root, "ingest", "meds", tmp_path / "v1", "--name", "hosp")[0] == 0
    info = validate_meds_dir(wh_vocab.meds_dir("hosp"))
    legacy = get_dataset(wh_vocab, "hosp") | {"fingerprint": _size_fingerprint(info.root, info.shards)}
    wh_vocab.write("datasets", pl.DataFrame([legacy]), dataset_id="hosp")
    current = build_cohort(wh_vocab, "hosp", "today", CohortOptions(harmonize="icd10"), seed=7)
    # The row such a build wrote: an id of the dataset, the seed and the options, no rule; no fingerprint recorded.
    payload = json.dumps({"dataset_id": "hosp", "fingerprint": legacy["fingerprint"], "seed": 7, "target": "final",
                          "harmonize": "icd10", "min_history": 1}, sort_keys=True)
    earlier = "c" + hashlib.sha256(payload.encode()).hexdigest()[:11]
    written = {key: value for key, value in json.loads(current["options_json"]).items() if key != "gem_rule"}
    wh_vocab.write("cohorts", wh_vocab.read("cohorts", cohort_id=current["cohort_id"]).with_columns(
        cohort_id=pl.lit(earlier), name=pl.lit("coded"), options_json=pl.lit(json.dumps(written, sort_keys=True)),
        dataset_fingerprint=pl.lit(None, dtype=pl.String)), cohort_id=earlier)

    code, out, _ = cli(wh_vocab.root, "ingest", "meds", tmp_path / "v1", "--name", "hosp")
    assert code == 0 and "earlier files" not in out
    assert (f"note: cohort coded ({earlier}) was built under dataset hosp's fingerprint of before 2026-12-05, of "
            "sizes and row counts, which these files match (likely the same files), and by the icd10 rule of before "
            "2026-12-06, one ICD-10 code per GEM choice list (now --harmonize icd10_closest); their fingerprint is now "
            "of their contents. The cohort keeps its tables") in out
    dataset = get_dataset(wh_vocab, "hosp")
    assert superseded_note(wh_vocab, wh_vocab.read("cohorts", cohort_id=earlier).row(0, named=True)) == (
        f"cohort coded ({earlier}) was built when dataset hosp had a fingerprint of its files' sizes and row counts "
        "(before 2026-12-05), and by the icd10 rule of before 2026-12-06, one ICD-10 code per GEM choice list (now "
        f"--harmonize icd10_closest); registered again on {dataset['registered_at']:%Y-%m-%d %H:%M} UTC with files of "
        f"the same sizes and row counts, likely the same, it has a fingerprint of their contents "
        f"({dataset['fingerprint']}), which gives the cohort's options another cohort id")


def test_an_icd10_cohort_records_its_gem_rule_under_the_same_id_and_cohort_list_names_the_earlier_rule(
        wh_vocab, tmp_path):
    # options_json did not say which GEM rule an icd10 cohort was built by, and `dxr cohort list` showed a cohort
    # built before 2026-12-06 (by the rule now named icd10_closest) as one of today's icd10 cohorts.
    write_tiny_meds(tmp_path / "v1")
    assert cli(wh_vocab.root, "ingest", "meds", tmp_path / "v1", "--name", "hosp")[0] == 0
    native = build_cohort(wh_vocab, "hosp", "plain", CohortOptions(), seed=7)
    current = build_cohort(wh_vocab, "hosp", "coded", CohortOptions(harmonize="icd10"), seed=7)
    identity = {"dataset_id": "hosp", "fingerprint": get_dataset(wh_vocab, "hosp")["fingerprint"], "seed": 7,
                "target": "final", "harmonize": "icd10", "min_history": 1}

    def hashed(payload: dict) -> str:
        return "c" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:11]

    # Recording the rule left the ids as they were.
    assert current["cohort_id"] == hashed({**identity, "gem_rule": "every_target"})
    assert native["cohort_id"] == hashed({**identity, "harmonize": "native"})
    assert json.loads(current["options_json"])["gem_rule"] == "every_target"
    assert "gem_rule" not in json.loads(native["options_json"])

    # Two icd10 cohorts as builds before 2026-12-06 wrote them, no rule in their ids or options_json: one of these
    # files, and an older one from before the files were recorded in the row.
    written = {key: value for key, value in json.loads(current["options_json"]).items() if key != "gem_rule"}
    row = wh_vocab.read("cohorts", cohort_id=current["cohort_id"]).with_columns(
        options_json=pl.lit(json.dumps(written, sort_keys=True)))
    for days, name, cohort_id, fingerprint in ((9, "coded_2024", hashed({**identity, "fingerprint": "f0"}), None),
                                               (5, "coded_2025", hashed(identity), identity["fingerprint"])):
        wh_vocab.write("cohorts", row.with_columns(
            cohort_id=pl.lit(cohort_id), name=pl.lit(name), created_at=pl.col("created_at") - pl.duration(days=days),
            dataset_fingerprint=pl.lit(fingerprint, dtype=pl.String)), cohort_id=cohort_id)

    code, out, _ = cli(wh_vocab.root, "cohort", "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["cohort_id", "name", "dataset_id", "target_rule", "harmonization", "min_history",
                                "n_trajectories", "vocabulary_size", "cut_rule_version", "gem_rule"]
    listed = [line.split(None, 9) for line in lines[2:-1]]  # the gem_rule cell holds spaces
    assert [(cells[1], cells[4], cells[9:]) for cells in listed] == [
        ("coded_2024", "icd10", ["icd10_closest (earlier icd10)"]),
        ("coded_2025", "icd10", ["icd10_closest (earlier icd10)"]),
        ("plain", "native", []), ("coded", "icd10", ["every_target"])]


# A prior that trains in seconds on the tiny dataset, set as an ETL host would configure it (the backfill trains with
# the configured prior settings). promote = false: a backfill's first model of a cohort is put in service anyway.
TINY_PRIOR = {"DXR_PRIOR__D_MODEL": "16", "DXR_PRIOR__N_LAYERS": "1", "DXR_PRIOR__N_HEADS": "2",
              "DXR_PRIOR__N_EXPERTS": "4", "DXR_PRIOR__TOP_K": "2", "DXR_PRIOR__EXPERT_HIDDEN": "16",
              "DXR_PRIOR__MIN_CODE_COUNT": "1", "DXR_PRIOR__EPOCHS": "1", "DXR_PRIOR__PROMOTE": "false"}


def forecast_cohorts(wh, run_id: str) -> dict[str, str]:
    """The cohort each system of a run forecast, by system."""
    runs = wh.read("runs").filter((pl.col("run_id") == run_id) & pl.col("kind").str.starts_with("forecast:"))
    return {kind.removeprefix("forecast:"): cohort for kind, cohort in runs.select("kind", "cohort_id").rows()}


def test_a_refreshing_backfill_builds_the_refreshed_cohort_and_trains_its_prior_once_across_a_retry(
        wh_vocab, tmp_path, monkeypatch):
    import models.prior.train
    import tasks.refresh
    from flows.backfill import cohort_backfill_flow
    from models.prior import tracking
    from models.prior.config import PriorConfig

    for variable, value in TINY_PRIOR.items():
        monkeypatch.setenv(variable, value)
    # Named apart from test_serve's backfills: the session's one Prefect API holds every test's artifacts.
    data_dir, systems, name = str(wh_vocab.root), ("repeat_history", "ehr_prior"), "hosp-refreshed"
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "v1"), "hosp")
    first_cohort = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]

    # The first firing finds the cohort current and only trains the prior it lacks.
    first = cohort_backfill_flow(data_dir, "nightly", systems, split="all", name=name, refresh=True)
    assert forecast_cohorts(wh_vocab, first) == {"repeat_history": first_cohort, "ehr_prior": first_cohort}
    refreshed = wh_vocab.read("runs").filter(pl.col("run_id") == f"{first}-refresh")
    assert refreshed.select("kind", "status", "cohort_id").rows() == [("train:ehr_prior", "finished", first_cohort)]

    # The ETL registers the next night's files; the next firing crashes while training and is retried.
    ingest_meds(wh_vocab, write_next_night(tmp_path / "v2"), "hosp")
    builds, trainings = [], []
    real_build, real_train = tasks.refresh.build_cohort, models.prior.train.train_prior_model

    def counted_build(*args, **kwargs):
        builds.append(args[2])
        return real_build(*args, **kwargs)

    def train_fails_the_first_time(connection, cohort_id, system, *args, **kwargs):
        trainings.append((cohort_id, system))
        if len(trainings) == 1:
            raise OSError("no space left on device")
        return real_train(connection, cohort_id, system, *args, **kwargs)

    monkeypatch.setattr(tasks.refresh, "build_cohort", counted_build)
    monkeypatch.setattr(models.prior.train, "train_prior_model", train_fails_the_first_time)
    flow = cohort_backfill_flow.with_options(retries=1, retry_delay_seconds=0)
    second = flow(data_dir, "nightly", systems, split="all", name=name, refresh=True)

    cohorts = wh_vocab.read("cohorts")
    [second_cohort] = cohorts.filter(pl.col("cohort_id") != first_cohort)["cohort_id"]
    assert cohorts.filter(pl.col("cohort_id") == second_cohort)["name"].to_list() == ["nightly"]
    assert builds == ["nightly"]  # the retry found the cohort built, and did not build it again
    assert trainings == [(second_cohort, "ehr_prior")] * 2  # the failed training and its retry
    assert forecast_cohorts(wh_vocab, second) == {"repeat_history": second_cohort, "ehr_prior": second_cohort}
    trajectories = wh_vocab.read("ranking_status", run_id=second)["trajectory_id"]
    assert trajectories.str.starts_with(f"{second_cohort}:5:").any()  # the new patient is forecast
    refreshed = wh_vocab.read("runs").filter(pl.col("run_id") == f"{second}-refresh").sort("kind")
    assert refreshed.select("kind", "status", "cohort_id").rows() == [
        ("cohort", "finished", second_cohort), ("train:ehr_prior", "finished", second_cohort)]
    tracking.use_tracking(wh_vocab.root, None, PriorConfig().experiment)
    [version] = tracking.registered_versions("ehr_prior", second_cohort)
    assert version["aliases"] == ["champion"]
    model = json.loads(wh_vocab.read("runs", run_id=second, kind="forecast:ehr_prior")["config_json"][0])["model"]
    assert (model["registered_model"], model["version"]) == (f"ehr_prior-{second_cohort}", version["version"])
    assert wh_vocab.read("metrics", run_id=second).height


def test_a_backfill_without_refresh_forecasts_the_cohort_as_last_built(wh_vocab, tmp_path):
    from flows.backfill import cohort_backfill_flow

    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "v1"), "hosp")
    first_cohort = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]
    ingest_meds(wh_vocab, write_next_night(tmp_path / "v2"), "hosp")

    run_id = cohort_backfill_flow(str(wh_vocab.root), "nightly", ("repeat_history",), split="all",
                                  name="hosp-as-built")
    assert forecast_cohorts(wh_vocab, run_id) == {"repeat_history": first_cohort}
    assert wh_vocab.read("cohorts")["cohort_id"].to_list() == [first_cohort]
    assert wh_vocab.read("runs").filter(pl.col("run_id") == f"{run_id}-refresh").is_empty()


def test_a_refreshing_backfill_cuts_again_under_its_id_a_cohort_cut_by_other_rules(wh_vocab, tmp_path):
    # A refreshing backfill rebuilt only cohorts of earlier files: one cut by older rules from the current files was
    # forecast as it was, with the forecast's warning, every night.
    import logging

    from flows.backfill import cohort_backfill_flow
    from tests.conftest import LoggedMessages
    from warehouse.cohorts import CUT_RULE_VERSION

    data_dir = str(wh_vocab.root)
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "v1"), "hosp")
    cohort_id = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]
    # The cohorts row as a dxr before cut rules were versioned wrote it: its Parquet file has no such column.
    wh_vocab.read("cohorts", cohort_id=cohort_id).drop("cut_rule_version").write_parquet(
        wh_vocab.partition_path("cohorts", cohort_id=cohort_id))
    cut_before = (f"cohort nightly ({cohort_id}) was cut before cut rules were versioned, not by this dxr's version "
                  f"{CUT_RULE_VERSION}: its trajectories, targets and pre-target records may differ from what a build "
                  "makes now")
    rebuild = "dxr cohort build --dataset hosp --name nightly --target final --harmonize native --min-history 1"
    logged = LoggedMessages(logging.INFO)
    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    for logger in loggers:
        logger.addHandler(logged)
    try:
        # Without refresh the cohort is forecast as it was cut, and the forecast says so.
        kept = cohort_backfill_flow(data_dir, "nightly", ("repeat_history",), split="all", name="hosp-recut-kept")
        assert f"{cut_before}; this run forecasts it as it is, and `{rebuild}` cuts it again" in logged.lines
        assert wh_vocab.read("cohorts", cohort_id=cohort_id)["cut_rule_version"].to_list() == [None]
        assert wh_vocab.read("runs").filter(pl.col("run_id") == f"{kept}-refresh").is_empty()

        logged.lines.clear()
        refreshed = cohort_backfill_flow(data_dir, "nightly", ("repeat_history",), split="all",
                                         name="hosp-recut-refreshed", refresh=True)
    finally:
        for logger in loggers:
            logger.removeHandler(logged)
    assert f"{cut_before}; building it again from the current files, as `{rebuild}` does" in logged.lines
    assert not [line for line in logged.lines if "forecasts it as it is" in line]
    # The rebuild's steps reach the run's log as they end: a scheduled build of minutes shows no bar to anyone.
    assert [re.sub(r"done in \d+\.\d s$", "done in S s", line) for line in logged.lines
            if line.startswith("cohort nightly: ")] == [
        f"cohort nightly: {step} done in S s" for step in (
            "events", "harmonized diagnosis codes", "trajectories", "vocabulary",
            "pre-target records, train events and targets")]
    # The same files, options and seed: the same id, cut by this dxr's rules, and forecast so.
    assert wh_vocab.read("cohorts").select("cohort_id", "cut_rule_version").rows() == [(cohort_id, CUT_RULE_VERSION)]
    assert wh_vocab.read("runs").filter(pl.col("run_id") == f"{refreshed}-refresh").select(
        "kind", "status", "cohort_id").rows() == [("cohort", "finished", cohort_id)]
    assert forecast_cohorts(wh_vocab, refreshed) == {"repeat_history": cohort_id}


def test_a_refreshing_backfill_whose_rebuild_was_cut_short_builds_it_at_the_next_firing(
        wh_vocab, tmp_path, monkeypatch):
    # A refreshing backfill rebuilds a cohort cut by older rules under its id, which leaves the cohort unregistered
    # until the build ends. Cut short, that build left every later firing failing with "is not built: ... build it
    # again with `dxr cohort build ...`" until someone ran the command by hand.
    import logging

    from flows.backfill import cohort_backfill_flow
    from tests.conftest import LoggedMessages
    from warehouse.cohorts import CUT_RULE_VERSION

    data_dir = str(wh_vocab.root)
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "v1"), "hosp")
    cohort_id = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]
    # The cohorts row as a dxr before cut rules were versioned wrote it, which a refresh cuts again under its id.
    wh_vocab.read("cohorts", cohort_id=cohort_id).drop("cut_rule_version").write_parquet(
        wh_vocab.partition_path("cohorts", cohort_id=cohort_id))

    cut_cohort_builds_short(monkeypatch, OSError("no space left on device"))
    with pytest.raises(OSError, match="no space left on device"):
        cohort_backfill_flow(data_dir, "nightly", ("repeat_history",), split="all", run_id="night1",
                             name="hosp-cut-short", refresh=True)
    monkeypatch.undo()
    assert wh_vocab.read("cohorts").is_empty() and wh_vocab.has_rows("trajectories", cohort_id=cohort_id)

    # A backfill without refresh builds no cohort: it refuses, naming the build that was cut short and the command.
    refusal = (f"cohort nightly ({cohort_id}) is not built: its build in run night1-refresh failed, and a build "
               "unregisters its cohort until it is complete; build it again with `dxr cohort build --dataset hosp "
               "--name nightly --target final --harmonize native --min-history 1`")
    with pytest.raises(NotFoundError, match=f"^{re.escape(refusal)}$"):
        cohort_backfill_flow(data_dir, "nightly", ("repeat_history",), split="all", name="hosp-cut-short-kept")

    # The next refreshing firing finishes the build with the options of the last finished one, then forecasts.
    logged = LoggedMessages(logging.INFO)
    logging.getLogger("prefect.task_runs").addHandler(logged)
    try:
        night2 = cohort_backfill_flow(data_dir, "nightly", ("repeat_history",), split="all", run_id="night2",
                                      name="hosp-cut-short", refresh=True)
    finally:
        logging.getLogger("prefect.task_runs").removeHandler(logged)
    assert (f"cohort nightly ({cohort_id}) is not built: its build in run night1-refresh failed; building it again "
            "from the current files, as `dxr cohort build --dataset hosp --name nightly --target final --harmonize "
            "native --min-history 1` does") in logged.lines
    assert wh_vocab.read("cohorts").select("cohort_id", "name", "cut_rule_version").rows() == [
        (cohort_id, "nightly", CUT_RULE_VERSION)]
    assert wh_vocab.read("runs").filter(pl.col("run_id") == "night2-refresh").select(
        "kind", "status", "cohort_id").rows() == [("cohort", "finished", cohort_id)]
    assert forecast_cohorts(wh_vocab, night2) == {"repeat_history": cohort_id}
    assert wh_vocab.has_rows("targets", cohort_id=cohort_id) and wh_vocab.read("metrics", run_id=night2).height


def test_a_refreshing_backfill_finishes_the_newest_build_of_its_name_cut_short_not_an_older_cohort_of_it(
        wh_vocab, tmp_path, monkeypatch):
    # "nightly" built natively, then by categories (another id) and cut short: the name means the category cohort
    # (readers refuse it until it is built), so the refresh builds that one, not the native one still registered.
    from flows.backfill import cohort_backfill_flow

    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "v1"), "hosp")
    native = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]

    cut_cohort_builds_short(monkeypatch, OSError("no space left on device"))
    with pytest.raises(OSError):
        build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(harmonize="category"), seed=7, run_id="by-hand")
    monkeypatch.undo()
    category = wh_vocab.read("runs", run_id="by-hand")["cohort_id"][0]

    night = cohort_backfill_flow(str(wh_vocab.root), "nightly", ("repeat_history",), split="all", run_id="night",
                                 name="hosp-category", refresh=True)
    assert wh_vocab.read("runs", run_id="night-refresh").select("status", "cohort_id").rows() == [
        ("finished", category)]
    assert sorted(wh_vocab.read("cohorts")["cohort_id"]) == sorted([native, category])
    assert forecast_cohorts(wh_vocab, night) == {"repeat_history": category}


def test_a_refreshing_backfill_of_a_cohort_named_by_its_id_is_refused(wh_vocab, tmp_path):
    from flows.backfill import cohort_backfill_flow

    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "v1"), "hosp")
    cohort_id = build_cohort(wh_vocab, "hosp", "nightly", CohortOptions(), seed=7)["cohort_id"]
    with pytest.raises(InputError, match=f"^refresh: cohort {cohort_id} is named by its id, which stays on the files "
                                         "it was built from: name the backfill's cohort by its name, 'nightly', or "
                                         "set refresh = false$"):
        cohort_backfill_flow(str(wh_vocab.root), cohort_id, ("repeat_history",), split="all", refresh=True)
    assert wh_vocab.read("runs").filter(pl.col("kind").str.starts_with("forecast:")).is_empty()


def cohort_with_a_run(wh: Warehouse, tmp_path: Path, *build_options: str) -> tuple[tuple[str, ...], str]:
    """The tiny MEDS dataset ingested as `hosp`, a cohort built from it with `build_options` and run r1 of
    repeat_history forecast over all its trajectories, through the CLI; returns the build command and the cohort id."""
    write_tiny_meds(tmp_path / "v1")
    build = ("cohort", "build", "--dataset", "hosp", *build_options)
    assert cli(wh.root, "ingest", "meds", tmp_path / "v1", "--name", "hosp")[0] == 0
    assert cli(wh.root, *build)[0] == 0
    [cohort_id] = wh.read("cohorts")["cohort_id"]
    assert cli(wh.root, "forecast", "--cohort", build_options[1], "--system", "repeat_history", "--split", "all",
               "--run-id", "r1")[0] == 0
    return build, cohort_id


def test_a_run_whose_cohort_was_built_again_under_its_id_says_so_and_names_the_trajectories_it_lost(
        wh_vocab, tmp_path, monkeypatch):
    # A build of the same files and options (or a refreshing backfill of a cohort cut by older rules) rewrites the
    # cohort under its id: `dxr evaluate` scored a run's earlier lists against the new targets without a word, and
    # `dxr report` mixed the stored evaluation with a K-sweep of the new targets.
    import warehouse.cohorts as cohorts
    from warehouse.cohorts import CUT_RULE_VERSION

    data_dir = wh_vocab.root
    build, cohort_id = cohort_with_a_run(wh_vocab, tmp_path, "--name", "every", "--target", "every",
                                         "--min-history", "0")
    forecast = ("forecast", "--cohort", "every", "--system", "repeat_history", "--split", "all", "--run-id", "r1")
    config = json.loads(wh_vocab.read("runs", run_id="r1", kind="forecast:repeat_history")["config_json"][0])
    assert config["cut_rule_version"] == CUT_RULE_VERSION
    code, _, err = cli(data_dir, "evaluate", "--run", "r1", "--bootstrap", "0")
    assert code == 0 and "built again" not in err

    def built_again(cut: str) -> str:
        built = wh_vocab.read("cohorts", cohort_id=cohort_id)["created_at"][0]
        return (f"cohort every ({cohort_id}) was built again on {built:%Y-%m-%d %H:%M} UTC, after this run's "
                f"repeat_history forecast it, cut by version {cut}")

    # The same rules: the same targets, said so; the stored evaluation is of the earlier build until taken again.
    assert cli(data_dir, *build)[0] == 0
    code, _, err = cli(data_dir, "report", "--run", "r1")
    built = wh_vocab.read("cohorts", cohort_id=cohort_id)["created_at"][0]
    assert code == 1 and err == (f"Error: the evaluation of run 'r1' was taken before cohort every ({cohort_id}) was "
                                 f"built again on {built:%Y-%m-%d %H:%M} UTC: run `dxr evaluate --run r1` again, then "
                                 "the report\n")
    code, _, err = cli(data_dir, "evaluate", "--run", "r1", "--bootstrap", "0")
    same = f"{built_again(f'{CUT_RULE_VERSION} of the cut rules')} as before: the same trajectories and targets"
    assert code == 0 and f"note: run r1: {same}\n" in err

    # Other rules: the targets may differ, in the notes of `dxr evaluate` and of the report.
    monkeypatch.setattr(cohorts, "CUT_RULE_VERSION", CUT_RULE_VERSION + 1)
    assert cli(data_dir, *build)[0] == 0

    def other_rules() -> str:  # read after each build: the note names its minute
        return (f"{built_again(f'{CUT_RULE_VERSION + 1} of the cut rules')} where the lists are of one cut by version "
                f"{CUT_RULE_VERSION} of the cut rules: its trajectories and targets may differ from those the lists "
                "were forecast for")

    other = other_rules()
    code, _, err = cli(data_dir, "evaluate", "--run", "r1", "--bootstrap", "0")
    assert code == 0 and f"note: run r1: {other}\n" in err
    code, _, err = cli(data_dir, "report", "--run", "r1")
    assert code == 0 and err.splitlines() == [f"note: run r1: {other}",
                                              f"note: run r1: {in_sample_note(wh_vocab, 'r1')}"]
    assert f"\nCohort built again: {other}.\n" in (data_dir / "reports" / "r1" / "report.md").read_text()

    # Rules that leave out patient 1's three trajectories: named in one line, not dropped or a crash.
    real_shards = cohorts.assign_shards
    monkeypatch.setattr(cohorts, "assign_shards",
                        lambda trajectories, size: real_shards(trajectories.filter(pl.col("subject_id") != 1), size))
    assert cli(data_dir, *build)[0] == 0
    code, _, err = cli(data_dir, "evaluate", "--run", "r1", "--bootstrap", "0")
    assert code == 1 and err.splitlines()[-1] == (
        f"Error: run 'r1' ranks trajectory '{cohort_id}:1:101' (3 such), which is not in cohort {cohort_id}'s "
        "trajectories: forecast the run's systems again on the current build, under a new --run-id or this one with "
        f"the same options; {other_rules()}")

    # Forecast again under the same id with the same options (the cut rules are no option): the note is gone.
    assert cli(data_dir, *forecast)[0] == 0
    code, _, err = cli(data_dir, "evaluate", "--run", "r1", "--bootstrap", "0")
    assert code == 0 and "built again" not in err

    # A run forecast before forecasts recorded their cohort's cut rules cannot say which rules cut its lists' build.
    runs = wh_vocab.read("runs", run_id="r1", kind="forecast:repeat_history")
    unrecorded = {key: value for key, value in json.loads(runs["config_json"][0]).items() if key != "cut_rule_version"}
    wh_vocab.write("runs", runs.with_columns(config_json=pl.lit(json.dumps(unrecorded))), run_id="r1",
                   kind="forecast:repeat_history")
    assert cli(data_dir, *build)[0] == 0
    code, _, err = cli(data_dir, "evaluate", "--run", "r1", "--bootstrap", "0")
    assert code == 0 and (f"note: run r1: {built_again(f'{CUT_RULE_VERSION + 1} of the cut rules')} where the lists "
                          "are of one cut by rules the run did not record: its trajectories and targets may differ "
                          "from those the lists were forecast for\n") in err


def test_a_run_whose_trajectories_lost_their_targets_in_a_rebuild_says_the_cohort_was_built_again(
        wh_vocab, tmp_path, monkeypatch):
    # A trajectory still in the cohort but without targets: the error said only that "the cohort build and the run
    # disagree", not that the cohort was built again, by other rules, after the run forecast it.
    import warehouse.cohorts as cohorts
    from warehouse.cohorts import CUT_RULE_VERSION

    data_dir = wh_vocab.root
    build, cohort_id = cohort_with_a_run(wh_vocab, tmp_path, "--name", "every", "--target", "every",
                                         "--min-history", "0")
    monkeypatch.setattr(cohorts, "CUT_RULE_VERSION", CUT_RULE_VERSION + 1)
    assert cli(data_dir, *build)[0] == 0
    # The build by the other rules holds patient 1's three trajectories without their targets.
    targets = wh_vocab.read("targets", cohort_id=cohort_id)
    wh_vocab.write("targets", targets.filter(pl.col("trajectory_id").str.split(":").list.get(1) != "1"),
                   cohort_id=cohort_id)

    built = wh_vocab.read("cohorts", cohort_id=cohort_id)["created_at"][0]
    code, _, err = cli(data_dir, "evaluate", "--run", "r1", "--bootstrap", "0")
    assert code == 1 and err.splitlines()[-1] == (
        f"Error: trajectory '{cohort_id}:1:101' of run 'r1' has no gold targets (3 such): empty targets are excluded "
        "at cohort build time, so the cohort build and the run disagree; rebuild the cohort and rerun the forecast; "
        f"cohort every ({cohort_id}) was built again on {built:%Y-%m-%d %H:%M} UTC, after this run's repeat_history "
        f"forecast it, cut by version {CUT_RULE_VERSION + 1} of the cut rules where the lists are of one cut by "
        f"version {CUT_RULE_VERSION} of the cut rules: its trajectories and targets may differ from those the lists "
        "were forecast for")


def test_a_cohort_whose_rebuild_was_cut_short_is_refused_with_its_build_command_and_a_rerun_restores_it(
        wh_vocab, tmp_path, monkeypatch):
    # A rebuild unregisters its cohort, rewrites its tables and registers it last. Killed after the trajectories
    # and records but before the targets, it left `dxr evaluate --run r1` (and the report's K-sweep) telling the user
    # that empty targets are excluded at build time, and `dxr forecast --cohort nightly` that no cohort was ever built.
    data_dir = wh_vocab.root
    build, cohort_id = cohort_with_a_run(wh_vocab, tmp_path, "--name", "nightly")
    assert cli(data_dir, "evaluate", "--run", "r1", "--bootstrap", "0")[0] == 0
    scored = wh_vocab.read("metrics", run_id="r1").sort("system", "subset", "k", "metric")

    cut_cohort_builds_short(monkeypatch, KeyboardInterrupt("killed between the records and the targets"))
    assert cli(data_dir, *build)[0] == 1
    monkeypatch.undo()
    assert wh_vocab.has_rows("trajectories", cohort_id=cohort_id) and not wh_vocab.has_rows("targets",
                                                                                           cohort_id=cohort_id)
    [cut_short] = wh_vocab.read("runs").filter(pl.col("kind") == "cohort", pl.col("status") == "failed")["run_id"]
    refusal = (f"Error: cohort nightly ({cohort_id}) is not built: its build in run {cut_short} failed, and a build "
               "unregisters its cohort until it is complete; build it again with `dxr cohort build --dataset hosp "
               "--name nightly --target final --harmonize native --min-history 1`\n")
    for command in (("evaluate", "--run", "r1", "--bootstrap", "0"), ("report", "--run", "r1"),
                    ("forecast", "--cohort", "nightly", "--system", "repeat_history", "--run-id", "r2"),
                    ("forecast", "--cohort", cohort_id, "--system", "repeat_history", "--run-id", "r2"),
                    ("prior", "train", "--cohort", "nightly")):
        code, _, err = cli(data_dir, *command)
        assert (code, err.splitlines()[-1] + "\n") == (1, refusal), command
    assert cli(data_dir, "cohort", "list")[1].endswith("(0 rows)\n")  # only complete cohorts are listed

    assert cli(data_dir, *build)[0] == 0  # the command the refusal names
    assert cli(data_dir, "evaluate", "--run", "r1", "--bootstrap", "0")[0] == 0
    assert wh_vocab.read("metrics", run_id="r1").sort("system", "subset", "k", "metric").equals(scored)
