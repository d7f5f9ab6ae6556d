"""Dataset registration: generation and ingest are all-or-nothing, reruns are identical, and the
registered files cannot change underneath a cohort build."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import warehouse.meds as meds_module
import warehouse.synthetic as synthetic
from dxr.errors import ConfigError, InputError
from tests.conftest import (OUT_OF_MEMORY, SPLITS, FailsAt, abandoned_scratch, cli, disk_full_errors, dx,
                            file_size_limit, t, tiny_events, with_vocabularies, write_tiny_meds)
from warehouse import duck
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import create_synthetic, ingest_meds, ingest_mimic, synthetic_is_current
from warehouse.importers.mimic import MIMIC4, import_mimic_validated
from warehouse.meds import hash_split, read_splits, validate_meds_dir, write_data_shard, write_metadata


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
    target = wh_vocab.meds_dir("synthetic")
    (abandoned_scratch(target) / "data").mkdir(parents=True)  # a staging directory a SIGKILL left
    again = create_synthetic(wh_vocab, "synthetic", patients=120, seed=5, shard_size=50)
    assert data_files(wh_vocab.meds_dir("synthetic")) == files
    assert again["fingerprint"] == first["fingerprint"]
    assert wh_vocab.read("datasets").height == 1
    assert not [p for p in wh_vocab.meds_dir("synthetic").parent.iterdir() if p.name.startswith(".")]
    assert not synthetic_is_current(wh_vocab, "synthetic", 121, 5)


def test_a_full_disk_during_synth_names_the_data_dir_and_the_fix_not_the_staging_directory(wh_vocab, monkeypatch):
    # The one line named the file the generator was writing in its hidden staging directory:
    # "<data dir>/gold/meds/.synthetic.<host>-<pid>-<token>.tmp/data/00003.parquet: No space left on device: ...".
    real_generate = synthetic.generate

    def to_a_full_disk(out_dir, **kwargs):
        real_generate(out_dir, **{**kwargs, "n_patients": 60})
        shard = out_dir / "data" / "00002.parquet"  # as `naming` reports pyarrow's ENOSPC, which names no file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(shard))

    monkeypatch.setattr(synthetic, "generate", to_a_full_disk)
    code, out, err = cli(wh_vocab.root, "synth", "--patients", 120, "--run-id", "synth-full")
    assert (code, out, err.splitlines()[-1]) == (
        1, "", f"Error: generation of synthetic dataset synthetic: out of disk space in "
               f"{wh_vocab.meds_dir('synthetic').parent}: free disk space there, or point --data-dir (DXR_DATA_DIR) to "
               "a disk with room")  # after the progress lines
    assert list(wh_vocab.meds_dir("synthetic").parent.iterdir()) == []
    assert wh_vocab.read("runs").select("run_id", "status").rows() == [("synth-full", "failed")]


def test_a_file_size_limit_met_by_synthetic_generation_names_the_data_dir_and_the_fix(wh_vocab):
    with file_size_limit(8_000), pytest.raises(ConfigError) as raised:
        create_synthetic(wh_vocab, "synthetic", patients=120, seed=5, shard_size=50)
    assert str(raised.value) == (f"generation of synthetic dataset synthetic: a file in "
                                 f"{wh_vocab.meds_dir('synthetic').parent} reached the file-size limit: raise it "
                                 "(ulimit -f), or point --data-dir (DXR_DATA_DIR) to a disk with room")
    assert list(wh_vocab.meds_dir("synthetic").parent.iterdir()) == []


def test_ingest_copies_files_so_a_source_rewritten_in_place_leaves_the_dataset_unchanged(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    before = data_files(wh_vocab.meds_dir("tiny"))
    for shard in sorted((tiny_meds / "data").rglob("*.parquet")):
        with open(shard, "r+b") as f:  # same inode, new bytes: what a hard link would share
            f.write(b"XXXX")
    assert data_files(wh_vocab.meds_dir("tiny")) == before


def test_ingests_register_their_runs_also_when_called_from_python(wh_vocab, tiny_meds):
    mimic4 = Path(__file__).resolve().parent / "fixtures" / "mimic4"
    ingest_meds(wh_vocab, tiny_meds, "tiny", run_id="ing-meds")
    with pytest.raises(InputError, match="dataset name 'Bad Name' is not allowed"):
        ingest_mimic(wh_vocab, "mimic4", mimic4, "Bad Name", seed=0, run_id="ing-bad")
    row, summary = ingest_mimic(wh_vocab, "mimic4", mimic4, "fixture", seed=0, run_id="ing-mimic")
    assert (row["source"], row["n_events"], summary.n_shards > 0) == ("mimic4", 41, True)
    runs = wh_vocab.read("runs").sort("run_id").select("run_id", "kind", "status").rows()
    assert runs == [("ing-bad", "ingest:mimic4", "failed"), ("ing-meds", "ingest:meds", "finished"),
                    ("ing-mimic", "ingest:mimic4", "finished")]
    with pytest.raises(InputError, match="unknown MIMIC source 'mimic5'"):
        ingest_mimic(wh_vocab, "mimic5", mimic4, "fixture", seed=0)


def test_a_mimic_ingest_reads_the_events_once_and_registration_hands_on_only_an_unchanged_validation(
        wh_vocab, tmp_path, monkeypatch):
    # The importer validated its output and registration validated it again: two full reads of every event.
    mimic4 = Path(__file__).resolve().parent / "fixtures" / "mimic4"
    event_reads = []
    check_events = meds_module._check_events

    def counted(con, data_dir, *rest):  # the real check, noting which directory's events it read
        event_reads.append(data_dir.parent.name)
        return check_events(con, data_dir, *rest)

    monkeypatch.setattr(meds_module, "_check_events", counted)
    row, _ = ingest_mimic(wh_vocab, "mimic4", mimic4, "fixture", seed=0)
    assert (len(event_reads), row["n_events"]) == (1, 41)
    assert row["fingerprint"] == validate_meds_dir(wh_vocab.meds_dir("fixture")).fingerprint
    # A validation handed on is taken only for the files it read: after a shard's rewrite, the directory is read.
    _, info = import_mimic_validated(MIMIC4, mimic4, tmp_path / "meds", seed=0)
    assert validate_meds_dir(tmp_path / "meds", validated=info) == info
    shard = info.shards[0]
    events = pl.read_parquet(shard)
    pq.write_table(events.head(events.height - 1).to_arrow(), shard)
    event_reads.clear()
    again = validate_meds_dir(tmp_path / "meds", validated=info)
    assert (event_reads, again.n_events) == (["meds"], info.n_events - 1)
    (tmp_path / "meds" / "data" / "extra.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="extra.parquet is not a readable Parquet file"):
        validate_meds_dir(tmp_path / "meds", validated=again)


def test_a_full_disk_during_meds_ingest_says_so_and_where(wh_vocab, tiny_meds, monkeypatch):
    # copytree gathers the ENOSPC of each file into one shutil.Error without errno or file name: the CLI printed
    # the list of (source, target, reason) triples of every file.
    def to_a_full_disk(src, dst, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)

    copytree = shutil.copytree
    # copytree calls itself by name for each subdirectory, with its options as positional arguments.
    monkeypatch.setattr(shutil, "copytree", lambda src, dst, *options, **named: copytree(
        src, dst, copy_function=to_a_full_disk))
    with pytest.raises(ConfigError) as raised:
        ingest_meds(wh_vocab, tiny_meds, "full", run_id="ing-full")
    assert str(raised.value) == (
        f"MEDS ingest of {tiny_meds}: out of disk space in {wh_vocab.meds_dir('full').parent}: free disk space "
        "there, or point --data-dir (DXR_DATA_DIR) to a disk with room")
    assert not wh_vocab.meds_dir("full").exists()
    assert wh_vocab.read("runs").select("run_id", "status").rows() == [("ing-full", "failed")]


def test_meds_validation_holds_to_the_memory_limit_and_running_out_is_one_line(wh_vocab, tiny_meds):
    # Validation ran DuckDB without a limit (80% of the machine's memory) and an out-of-memory was a traceback.
    with pytest.raises(ConfigError) as raised:
        ingest_meds(wh_vocab, tiny_meds, "tiny", run_id="ing-oom", memory_limit="1MB")
    assert re.fullmatch(re.escape(f"MEDS ingest of {tiny_meds}: DuckDB ran out of memory within its limit of 1MB ")
                        + OUT_OF_MEMORY
                        + re.escape(": rerun with a larger memory limit (`--memory-limit`, e.g. 8GB) that the machine "
                                    "has free"), str(raised.value)), str(raised.value)
    assert not wh_vocab.meds_dir("tiny").exists()
    assert wh_vocab.read("runs").select("run_id", "status").rows() == [("ing-oom", "failed")]
    info = validate_meds_dir(tiny_meds, memory_limit="64MB")
    # The hash rule, for a dataset without subject_splits.parquet, reads the subjects within the limit too.
    with pytest.raises(duckdb.OutOfMemoryException):
        read_splits(replace(info, has_splits=False), seed=7, memory_limit="1MB")
    assert read_splits(replace(info, has_splits=False), seed=7, memory_limit="64MB").rows() == [
        (subject, hash_split(subject, 7)) for subject in sorted(SPLITS)]


@pytest.mark.parametrize("error", disk_full_errors(), ids=["enospc", "spill_cap"])
def test_a_full_disk_for_the_validation_spill_names_the_temporary_directory(wh_vocab, tiny_meds, monkeypatch, error):
    # Validation spills to the system's temporary directory, not the data dir: its full disk was a DuckDB traceback.
    connect = duck.connect
    monkeypatch.setattr(duck, "connect", lambda database: FailsAt(connect(database), "count(DISTINCT subject_id)",
                                                                  error))
    with pytest.raises(ConfigError) as raised:
        ingest_meds(wh_vocab, tiny_meds, "tiny", run_id="ing-full")
    assert str(raised.value) == (f"validation of MEDS directory {tiny_meds}: out of disk space in "
                                 f"{tempfile.gettempdir()}: free disk space there, or set TMPDIR to a directory on a "
                                 "disk with room")
    assert wh_vocab.read("runs").select("run_id", "status").rows() == [("ing-full", "failed")]


def test_a_failed_meds_shard_write_names_the_shard(tmp_path):
    # As a warehouse partition's (test_store): pyarrow names no file, the synthetic generator and the importers
    # write their shards through write_data_shard.
    size = (write_tiny_meds(tmp_path / "whole") / "data" / "0.parquet").stat().st_size
    with file_size_limit(size // 2), pytest.raises(OSError) as raised:
        write_data_shard(tmp_path / "half", "0", tiny_events())
    assert (raised.value.errno, raised.value.filename) == (errno.EFBIG, str(tmp_path / "half" / "data" / "0.parquet"))


def test_a_failed_dataset_json_write_names_it_and_leaves_no_partial_file(tmp_path):
    # Python's own file write names no file and, unlike pyarrow's Parquet writer, leaves what it wrote behind.
    root = write_tiny_meds(tmp_path / "meds")
    before = sorted(p.name for p in (root / "metadata").iterdir())
    with file_size_limit(20_000), pytest.raises(OSError) as raised:
        write_metadata(root, dataset_name="tiny", dataset_version="2", etl_name="tests", etl_version="1",
                       codes=pl.DataFrame({"code": ["LAB//x"]}),
                       splits=pl.DataFrame({"subject_id": [1], "split": ["train"]}), extra={"note": "x" * 50_000})
    assert (raised.value.errno, raised.value.filename) == (errno.EFBIG, str(root / "metadata" / "dataset.json"))
    assert sorted(p.name for p in (root / "metadata").iterdir()) == before
    assert json.loads((root / "metadata" / "dataset.json").read_text())["dataset_version"] == "1"


def test_cohort_build_refuses_files_changed_after_registration(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    shard = sorted((wh_vocab.meds_dir("tiny") / "data").rglob("*.parquet"))[0]
    # What a kill between the data swap and the `datasets` write leaves: new files, old row.
    table = pq.read_table(shard)
    pq.write_table(pa.concat_tables([table, table.slice(0, 1)]), shard)
    with pytest.raises(InputError, match=r"dataset 'tiny': the files in .* changed since they were registered.*"
                                         r"rerun `dxr ingest meds`"):
        build_cohort(wh_vocab, "tiny", "main", CohortOptions(), seed=0)
    ingest_meds(wh_vocab, wh_vocab.meds_dir("tiny"), "tiny")  # re-registering in place accepts the new files
    assert build_cohort(wh_vocab, "tiny", "main", CohortOptions(), seed=0)["cohort_id"]


def test_a_moved_warehouse_builds_cohorts_from_its_own_files(wh_vocab, tiny_meds, tmp_path):
    # `datasets.meds_dir` records where the files were registered; a warehouse moved or restored elsewhere
    # (another mount point, a backup) must read the files it holds, not a path that is gone or another copy's.
    from warehouse.store import Warehouse

    ingest_meds(wh_vocab, tiny_meds, "tiny")
    moved = Warehouse(shutil.move(wh_vocab.root, tmp_path / "moved"))
    row = build_cohort(moved, "tiny", "main", CohortOptions(), seed=0)
    assert (row["n_trajectories"], moved.read("datasets")["meds_dir"].to_list()) == (
        3, [str(wh_vocab.root / "gold" / "meds" / "tiny")])


def test_a_meds_dir_and_a_warehouse_under_key_value_directories_ingest_and_build_as_under_plain_paths(vocab_cache,
                                                                                                       tmp_path):
    # DuckDB took a column from each `key=value` directory of a path it read: a MEDS dir under `subject_id=9/` had
    # one patient, not 4, and one under `code=X/` no diagnosis (ingest refused it); a warehouse under `cohort_id=zz/`
    # read every cohort's rows as cohort zz.
    from warehouse.store import Warehouse

    built = {}
    for lake in ("plain", "site=a/subject_id=9/code=X/cohort_id=zz"):
        wh = with_vocabularies(Warehouse(tmp_path / lake / "warehouse"), vocab_cache)
        row = ingest_meds(wh, write_tiny_meds(tmp_path / lake / "meds"), "tiny")
        cohort = build_cohort(wh, "tiny", "main", CohortOptions(), seed=0)
        trajectories = wh.connect().execute("SELECT cohort_id, trajectory_id FROM trajectories ORDER BY ALL").fetchall()
        built[lake] = (row["n_subjects"], row["n_events"], cohort["cohort_id"], cohort["n_trajectories"], trajectories)
    assert built["site=a/subject_id=9/code=X/cohort_id=zz"] == built["plain"]
    assert built["plain"][:2] == (4, 60)


def test_a_moved_warehouse_keeps_its_synthetic_dataset_current(wh, tmp_path):
    # Otherwise `dxr demo` in a moved warehouse would generate the same dataset again.
    from warehouse.store import Warehouse

    create_synthetic(wh, "synthetic", patients=60, seed=5, shard_size=60)
    moved = Warehouse(shutil.move(wh.root, tmp_path / "moved"))
    assert synthetic_is_current(moved, "synthetic", 60, 5)


def test_ingest_takes_hadm_id_as_the_encounter_id_of_a_mimic_iv_meds_export(wh_vocab, tmp_path):
    # MEDS-Extract's MIMIC-IV ETL (the MIMIC-IV MEDS convention) keeps the admission id as `hadm_id`.
    events = tiny_events()
    source = write_tiny_meds(tmp_path / "mimic_iv_meds", events.rename({"encounter_id": "hadm_id"}))
    row = ingest_meds(wh_vocab, source, "extract")
    assert (row["n_subjects"], row["n_events"]) == (events["subject_id"].n_unique(), events.height)
    gold = pl.read_parquet(wh_vocab.meds_dir("extract") / "data" / "**" / "*.parquet")
    assert gold["encounter_id"].to_list() == gold["hadm_id"].to_list()
    key = ["subject_id", "time", "code", "encounter_id"]
    assert gold.select(key).sort(key, nulls_last=False).equals(events.select(key).sort(key, nulls_last=False))
    assert build_cohort(wh_vocab, "extract", "main", CohortOptions(), seed=0)["cohort_id"]


def test_ingest_takes_shards_with_the_types_pandas_writes_and_stores_the_meds_types(wh_vocab, tmp_path):
    # pandas writes times in nanoseconds, values as float64 and an all-missing text_value as null; a subject id
    # may be int32. Same values, so ingest stores them with the MEDS types instead of refusing the dataset.
    source = write_tiny_meds(tmp_path / "pandas_meds")
    shard = source / "data" / "0.parquet"
    events = pq.read_table(shard)
    pandas_like = pa.table({
        "subject_id": events["subject_id"].cast(pa.int32()), "time": events["time"].cast(pa.timestamp("ns")),
        "code": events["code"].cast(pa.string()), "numeric_value": events["numeric_value"].cast(pa.float64()),
        "text_value": pa.nulls(events.num_rows), "encounter_id": events["encounter_id"]})
    pq.write_table(pandas_like, shard)
    ingest_meds(wh_vocab, source, "pandas")
    gold = pq.read_table(wh_vocab.meds_dir("pandas") / "data" / "0.parquet")
    assert [(f.name, str(f.type)) for f in gold.schema] == [
        ("subject_id", "int64"), ("time", "timestamp[us]"), ("code", "string"), ("numeric_value", "float"),
        ("text_value", "large_string"), ("encounter_id", "int64")]
    key = ["subject_id", "time", "code", "numeric_value", "encounter_id"]
    assert pl.from_arrow(gold).select(key).equals(pl.from_arrow(events).select(key))
    assert build_cohort(wh_vocab, "pandas", "main", CohortOptions(), seed=0)["n_trajectories"] == 3


def test_times_at_one_utc_offset_keep_the_wall_clock_time_they_show_and_mixed_offsets_are_refused(wh_vocab, tmp_path):
    # A single-zone export: its times order the events as they show them, as the MIMIC importers keep CSV times
    # written at one offset. Arrow stores such times as UTC instants, so 09:30 at -05:00 is stored as 14:30.
    source = write_tiny_meds(tmp_path / "zoned")
    shard = source / "data" / "0.parquet"
    events = pq.read_table(shard)
    zoned = pc.assume_timezone(events["time"], "-05:00").cast(pa.timestamp("ns", "-05:00"))  # as pandas writes it
    at_offset = events.set_column(1, "time", zoned)
    pq.write_table(at_offset, shard)
    row = ingest_meds(wh_vocab, source, "offset")
    assert (row["time_zone"], row["utc_offset"]) == ("-05:00", "-05:00")
    gold = pq.read_table(wh_vocab.meds_dir("offset") / "data" / "0.parquet")
    assert (str(gold.schema.field("time").type), gold["time"].equals(events["time"])) == ("timestamp[us]", True)
    pq.write_table(events.set_column(1, "time", events["time"].cast(pa.timestamp("us", "UTC"))), shard)
    ingest_meds(wh_vocab, source, "utc")  # its stored instants are the wall-clock times
    assert pq.read_table(wh_vocab.meds_dir("utc") / "data" / "0.parquet")["time"].equals(events["time"])
    # Daylight saving: a second shard at -04:00.
    first = pc.equal(at_offset["subject_id"], at_offset["subject_id"][0])
    pq.write_table(at_offset.filter(first), shard)
    later = at_offset.filter(pc.invert(first))
    pq.write_table(later.set_column(1, "time", later["time"].cast(pa.timestamp("ns", "-04:00"))),
                   source / "data" / "1.parquet")
    with pytest.raises(InputError) as raised:
        ingest_meds(wh_vocab, source, "mixed")
    assert str(raised.value) == (
        f"{source / 'data' / '1.parquet'}: column 'time' is timestamp[ns, tz=-04:00] but {shard} has "
        "timestamp[ns, tz=-05:00]: times at mixed offsets can misorder events; convert every time to one UTC offset "
        "(such as UTC itself) or to local time without an offset")
    (source / "data" / "1.parquet").unlink()
    pq.write_table(events.set_column(1, "time", pc.assume_timezone(events["time"], "America/New_York")), shard)
    with pytest.raises(InputError) as raised:
        ingest_meds(wh_vocab, source, "named")
    assert str(raised.value) == (
        f"{shard}: column 'time' (timestamp[us, tz=America/New_York]) names the time zone 'America/New_York', whose "
        "UTC offset changes from -05:00 to -04:00 on 1950-04-30, within the data's times (1950-01-01 to 2020-01-23): "
        "times at mixed offsets (daylight saving) can misorder events; convert every time to one UTC offset (such as "
        "UTC itself) or to local time without an offset")
    assert not wh_vocab.has_rows("datasets", dataset_id="mixed") and not wh_vocab.has_rows("datasets",
                                                                                             dataset_id="named")


def test_a_shard_of_static_rows_only_takes_no_part_in_the_time_zone_check(wh_vocab, tmp_path):
    # An export that writes its static rows (sex) to a shard of their own has no time there, so that shard's time
    # type may lack the zone the event shards are in (polars or pandas write a column of missing times naive).
    # Without a time it has no offset to disagree with: the dataset is taken as if the rows were in one shard.
    source = write_tiny_meds(tmp_path / "static_apart")
    shard = source / "data" / "0.parquet"
    events = pq.read_table(shard)
    static = pc.is_null(events["time"])
    timed = events.filter(pc.invert(static))
    pq.write_table(timed.set_column(1, "time", timed["time"].cast(pa.timestamp("us", "UTC"))), shard)
    pq.write_table(events.filter(static), source / "data" / "static.parquet")
    row = ingest_meds(wh_vocab, source, "static_apart")
    assert (row["n_events"], row["time_zone"], row["utc_offset"]) == (events.num_rows, "+00:00", "+00:00")
    gold = pl.read_parquet(wh_vocab.meds_dir("static_apart") / "data" / "**" / "*.parquet")
    key = ["subject_id", "time", "code", "encounter_id"]
    assert gold.select(key).sort(key, nulls_last=False).equals(
        pl.from_arrow(events).select(key).sort(key, nulls_last=False))
    assert build_cohort(wh_vocab, "static_apart", "main", CohortOptions(), seed=0)["n_trajectories"] == 3
    # The other way round: naive event times beside a static shard whose empty times carry a zone.
    pq.write_table(events.filter(pc.invert(static)), shard)
    static_rows = events.filter(static)
    pq.write_table(static_rows.set_column(1, "time", static_rows["time"].cast(pa.timestamp("us", "UTC"))),
                   source / "data" / "static.parquet")
    row = ingest_meds(wh_vocab, source, "static_zoned")
    assert (row["n_events"], row["time_zone"], row["utc_offset"]) == (events.num_rows, "", "")
    gold = pl.read_parquet(wh_vocab.meds_dir("static_zoned") / "data" / "**" / "*.parquet")
    assert gold.select(key).sort(key, nulls_last=False).equals(
        pl.from_arrow(events).select(key).sort(key, nulls_last=False))


def test_a_static_shard_whose_time_column_is_all_missing_as_null_type_is_taken(wh_vocab, tmp_path):
    # pandas (a column of None) and polars (pl.lit(None)) write a time column without any time as Arrow's null type,
    # as they do an all-missing text_value: a shard of static rows written apart has such a column.
    source = write_tiny_meds(tmp_path / "static_null_time")
    shard = source / "data" / "0.parquet"
    events = pq.read_table(shard)
    static = pc.is_null(events["time"])
    pq.write_table(events.filter(pc.invert(static)), shard)
    static_rows = events.filter(static)
    pq.write_table(static_rows.set_column(1, "time", pa.nulls(static_rows.num_rows)),
                   source / "data" / "static.parquet")
    row = ingest_meds(wh_vocab, source, "static_null_time")
    assert row["n_events"] == events.num_rows
    gold = wh_vocab.meds_dir("static_null_time") / "data"
    assert str(pq.read_schema(gold / "static.parquet").field("time").type) == "timestamp[us]"
    key = ["subject_id", "time", "code", "encounter_id"]
    assert pl.read_parquet(gold / "**" / "*.parquet").select(key).sort(key, nulls_last=False).equals(
        pl.from_arrow(events).select(key).sort(key, nulls_last=False))
    assert build_cohort(wh_vocab, "static_null_time", "main", CohortOptions(), seed=0)["n_trajectories"] == 3


def test_a_named_time_zone_at_one_utc_offset_over_the_data_keeps_its_wall_clock_times(wh_vocab, tmp_path):
    # Asia/Kolkata has been at +05:30 since 1945, before the data's first time (a 1950 birth): its times order the
    # events as a fixed offset's do. Arrow stores them as UTC instants, 05:30 earlier.
    source = write_tiny_meds(tmp_path / "kolkata")
    shard = source / "data" / "0.parquet"
    events = pq.read_table(shard)
    in_zone = events.set_column(1, "time", pc.assume_timezone(events["time"], "Asia/Kolkata"))
    first = pc.equal(events["subject_id"], events["subject_id"][0])
    pq.write_table(in_zone.filter(first), shard)
    # Another shard spelling the same offset: one offset for every time, as the rule asks.
    rest = in_zone.filter(pc.invert(first))
    pq.write_table(rest.set_column(1, "time", rest["time"].cast(pa.timestamp("us", "+05:30"))),
                   source / "data" / "1.parquet")
    row = ingest_meds(wh_vocab, source, "kolkata")
    assert (row["time_zone"], row["utc_offset"]) == ("Asia/Kolkata, +05:30", "+05:30")
    gold = pa.concat_tables(pq.read_table(wh_vocab.meds_dir("kolkata") / "data" / f"{n}.parquet") for n in (0, 1))
    assert (str(gold.schema.field("time").type), gold["time"].equals(events["time"])) == ("timestamp[us]", True)
    # Asia/Tokyo kept daylight saving until 1951: the 1950 birth lies before its first change.
    pq.write_table(events.set_column(1, "time", pc.assume_timezone(events["time"], "Asia/Tokyo")), shard)
    (source / "data" / "1.parquet").unlink()
    with pytest.raises(InputError) as raised:
        ingest_meds(wh_vocab, source, "tokyo")
    assert str(raised.value) == (
        f"{shard}: column 'time' (timestamp[us, tz=Asia/Tokyo]) names the time zone 'Asia/Tokyo', whose UTC offset "
        "changes from +09:00 to +10:00 on 1950-05-07, within the data's times (1950-01-01 to 2020-01-23): times at "
        "mixed offsets (daylight saving) can misorder events; convert every time to one UTC offset (such as UTC "
        "itself) or to local time without an offset")
    without_1950 = events.filter(pc.greater(events["time"], pa.scalar(datetime(1952, 1, 1), pa.timestamp("us"))))
    pq.write_table(without_1950.set_column(1, "time", pc.assume_timezone(without_1950["time"], "Asia/Tokyo")), shard)
    assert ingest_meds(wh_vocab, source, "tokyo")["utc_offset"] == "+09:00"
    assert pq.read_table(wh_vocab.meds_dir("tokyo") / "data" / "0.parquet")["time"].equals(without_1950["time"])
    pq.write_table(events.set_column(1, "time", events["time"].cast(pa.timestamp("us", "Mars/Olympus_Mons"))), shard)
    with pytest.raises(InputError, match=r"names the time zone 'Mars/Olympus_Mons', which the time zone database "
                                         r"does not know: write a zone name it has \(such as Asia/Tokyo\) or convert"):
        ingest_meds(wh_vocab, source, "mars")


def test_a_named_time_zone_without_a_zone_database_is_refused(tmp_path, monkeypatch):
    import zoneinfo

    source = write_tiny_meds(tmp_path / "kolkata")
    shard = source / "data" / "0.parquet"
    events = pq.read_table(shard)
    pq.write_table(events.set_column(1, "time", pc.assume_timezone(events["time"], "Asia/Kolkata")), shard)
    # Neither the system's database nor the tzdata package.
    for module in [name for name in sys.modules if name.split(".")[0] == "tzdata"] + ["tzdata"]:
        monkeypatch.setitem(sys.modules, module, None)  # its zone packages too: imported, they would be found
    zoneinfo.reset_tzpath(to=[])
    zoneinfo.ZoneInfo.clear_cache()
    try:
        with pytest.raises(InputError) as raised:
            validate_meds_dir(source)
    finally:
        zoneinfo.reset_tzpath()
        zoneinfo.ZoneInfo.clear_cache()
    assert str(raised.value) == (
        f"{shard}: column 'time' (timestamp[us, tz=Asia/Kolkata]) names the time zone 'Asia/Kolkata', but this "
        "system has no time zone database to tell its UTC offsets: install one (pip install tzdata) or convert "
        "every time to one UTC offset (such as UTC itself) or to local time without an offset")


def test_ingest_adds_the_optional_value_columns_that_no_shard_has(wh_vocab, tmp_path):
    # MEDS lets shards leave out numeric_value and text_value (exports before MEDS 0.3.3 have no text_value);
    # the cohort build selects both, so the gold copy gains them empty instead of the build failing.
    source = write_tiny_meds(tmp_path / "meds_0_3")
    shard = source / "data" / "0.parquet"
    events = pq.read_table(shard)
    pq.write_table(events.drop(["text_value"]), shard)
    ingest_meds(wh_vocab, source, "no_text")
    gold = pq.read_table(wh_vocab.meds_dir("no_text") / "data" / "0.parquet")
    assert (str(gold.schema.field("text_value").type), gold["text_value"].null_count) == ("large_string", 60)
    assert gold.drop(["text_value"]).equals(events.drop(["text_value"]))
    assert build_cohort(wh_vocab, "no_text", "main", CohortOptions(), seed=0)["n_trajectories"] == 3
    pq.write_table(events.drop(["numeric_value", "text_value"]), shard)
    ingest_meds(wh_vocab, source, "codes_only")
    gold = pq.read_table(wh_vocab.meds_dir("codes_only") / "data" / "0.parquet")
    assert [(f.name, str(f.type)) for f in gold.schema][-3:] == [
        ("encounter_id", "int64"), ("numeric_value", "float"), ("text_value", "large_string")]
    assert build_cohort(wh_vocab, "codes_only", "main", CohortOptions(), seed=0)["n_trajectories"] == 3


def test_ingest_takes_encounter_ids_that_pandas_wrote_as_floats(wh_vocab, tmp_path):
    # pandas turns an integer column with missing values (every static row has no admission) into float64.
    events = tiny_events()
    source = write_tiny_meds(tmp_path / "pandas_hadm", events.rename({"encounter_id": "hadm_id"}))
    shard = source / "data" / "0.parquet"
    table = pq.read_table(shard)
    floats = table.set_column(5, "hadm_id", table["hadm_id"].cast(pa.float64()))
    pq.write_table(floats, shard)
    ingest_meds(wh_vocab, source, "pandas")
    gold = pq.read_table(wh_vocab.meds_dir("pandas") / "data" / "0.parquet")
    assert gold.schema.field("encounter_id").type == pa.int64()
    assert gold["encounter_id"].to_pylist() == table["hadm_id"].to_pylist()
    assert build_cohort(wh_vocab, "pandas", "main", CohortOptions(), seed=0)["n_trajectories"] == 3
    named = floats.rename_columns([*floats.column_names[:5], "encounter_id"])
    pq.write_table(named, shard)
    ingest_meds(wh_vocab, source, "pandas_encounter")
    gold = pq.read_table(wh_vocab.meds_dir("pandas_encounter") / "data" / "0.parquet")
    assert gold.schema.field("encounter_id").type == pa.int64()
    assert gold["encounter_id"].to_pylist() == table["hadm_id"].to_pylist()
    fractional = floats.set_column(5, "hadm_id", pa.array([None, None, 101.5, *floats["hadm_id"].to_pylist()[3:]]))
    pq.write_table(fractional, shard)
    with pytest.raises(InputError, match=r"0\.parquet, row 3: hadm_id 101\.5 is not a whole number: encounter ids must "
                                         r"be integers \(write them as int64\)$"):
        ingest_meds(wh_vocab, source, "fractional")


def test_ingest_takes_dictionary_encoded_codes_and_unsigned_subject_ids(wh_vocab, tmp_path):
    # A polars Categorical or a pandas category column is stored dictionary-encoded; numpy ids may be unsigned.
    source = write_tiny_meds(tmp_path / "categorical")
    shard = source / "data" / "0.parquet"
    events = pq.read_table(shard)
    encoded = (events.set_column(0, "subject_id", events["subject_id"].cast(pa.uint32()))
               .set_column(2, "code", events["code"].cast(pa.string()).dictionary_encode())
               .set_column(4, "text_value", events["text_value"].cast(pa.string()).dictionary_encode()))
    pq.write_table(encoded, shard)
    ingest_meds(wh_vocab, source, "categorical")
    gold = pq.read_table(wh_vocab.meds_dir("categorical") / "data" / "0.parquet")
    assert [(f.name, str(f.type)) for f in gold.schema][:5] == [
        ("subject_id", "int64"), ("time", "timestamp[us]"), ("code", "string"), ("numeric_value", "float"),
        ("text_value", "large_string")]
    assert gold.equals(events)
    assert build_cohort(wh_vocab, "categorical", "main", CohortOptions(), seed=0)["n_trajectories"] == 3
    pq.write_table(events.set_column(0, "subject_id", events["subject_id"].cast(pa.uint64())), shard)
    with pytest.raises(InputError, match=r"0\.parquet: not the MEDS data schema \(.*subject_id \(want int64, got "
                                         r"uint64\)\): cast the columns to the MEDS types"):
        ingest_meds(wh_vocab, source, "unsigned64")


def test_ingest_refuses_shards_that_name_the_encounter_column_differently(wh_vocab, tmp_path):
    source = write_tiny_meds(tmp_path / "mixed")
    other = pq.read_table(source / "data" / "0.parquet").rename_columns(
        ["subject_id", "time", "code", "numeric_value", "text_value", "hadm_id"])
    pq.write_table(other.slice(0, 1).set_column(0, "subject_id", pa.array([999], pa.int64())),
                   source / "data" / "1.parquet")
    with pytest.raises(InputError, match=r"1\.parquet: the encounter column is 'hadm_id' but .*0\.parquet calls it "
                                         r"'encounter_id': use one name in every shard"):
        ingest_meds(wh_vocab, source, "mixed")


def test_codes_metadata_without_descriptions_is_a_dictionary_like_any_other(wh_vocab, tiny_meds):
    # `description` is optional in MEDS code metadata.
    codes = pl.DataFrame({"code": ["DIAGNOSIS//ICD//10//A000", "DIAGNOSIS//ICD//10//I10", "GENDER//F"]})
    codes.write_parquet(tiny_meds / "metadata" / "codes.parquet")
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    cohort = build_cohort(wh_vocab, "tiny", "main", CohortOptions(), seed=0)
    omega = wh_vocab.read("cohort_vocabulary", cohort_id=cohort["cohort_id"]).sort("code")
    assert omega.select("code", "title").rows() == [("DIAGNOSIS//ICD//10//A000", "Cholera due to Vibrio cholerae 01, "
                                                     "biovar cholerae"),
                                                    ("DIAGNOSIS//ICD//10//I10", "Essential (primary) hypertension")]


def test_codes_metadata_with_null_typed_descriptions_or_dictionary_encoded_codes_is_a_dictionary(wh_vocab, tiny_meds):
    # pandas writes a description column without any description as Arrow null; a polars Categorical or pandas
    # category code column is dictionary-encoded. Both are the same dictionary as plain strings.
    codes = pa.array(["DIAGNOSIS//ICD//10//A000", "DIAGNOSIS//ICD//10//I10", "GENDER//F"])
    expected = [("DIAGNOSIS//ICD//10//A000", "Cholera due to Vibrio cholerae 01, biovar cholerae"),
                ("DIAGNOSIS//ICD//10//I10", "Essential (primary) hypertension")]
    for name, table in (("null_descriptions", pa.table({"code": codes, "description": pa.nulls(3)})),
                        ("categorical", pa.table({"code": codes.dictionary_encode(), "description": pa.array(
                            [None, None, "female"]).dictionary_encode()}))):
        pq.write_table(table, tiny_meds / "metadata" / "codes.parquet")
        ingest_meds(wh_vocab, tiny_meds, name)
        cohort = build_cohort(wh_vocab, name, "main", CohortOptions(), seed=0)
        omega = wh_vocab.read("cohort_vocabulary", cohort_id=cohort["cohort_id"]).sort("code")
        assert (cohort["vocabulary_source"], omega.select("code", "title").rows()) == ("dataset_dictionary", expected)
    pq.write_table(pa.table({"code": codes, "description": pa.nulls(3).cast(pa.int32())}),
                   tiny_meds / "metadata" / "codes.parquet")
    with pytest.raises(InputError, match=r"codes\.parquet: column 'description' is int32, not text"):
        ingest_meds(wh_vocab, tiny_meds, "numbers")


def test_an_unreadable_codes_metadata_file_is_refused_at_ingest(wh_vocab, tiny_meds):
    codes = tiny_meds / "metadata" / "codes.parquet"
    codes.write_text("not parquet")
    with pytest.raises(InputError, match=r"codes\.parquet is not a readable Parquet file \(.*\): rewrite or remove it "
                                         r"\(the file is optional\)"):
        ingest_meds(wh_vocab, tiny_meds, "tiny")
    pl.DataFrame({"concept": ["GENDER//F"]}).write_parquet(codes)
    with pytest.raises(InputError, match=r"codes\.parquet: missing column 'code' \(columns found: concept\): MEDS code "
                                         r"metadata has code, description and parent_codes"):
        ingest_meds(wh_vocab, tiny_meds, "tiny")
    assert not wh_vocab.has_rows("datasets", dataset_id="tiny")


def test_codes_metadata_with_codes_that_are_not_text_is_refused_at_ingest(wh_vocab, tiny_meds):
    codes = tiny_meds / "metadata" / "codes.parquet"
    pl.DataFrame({"code": [4280], "description": ["Congestive heart failure"]}).write_parquet(codes)
    with pytest.raises(InputError, match=r"codes\.parquet: column 'code' is int64, not text: MEDS code metadata holds "
                                         r"codes and descriptions as strings"):
        ingest_meds(wh_vocab, tiny_meds, "tiny")


def respelled(code: str, prefix: str, dotted: bool = True) -> str:
    """A platform diagnosis code (DIAGNOSIS//ICD//{9|10}//<code>) as another ETL spells it: `prefix` and the code,
    with its dot when `dotted` (after the category: 4 characters for an ICD-9 E code, else 3)."""
    *_, version, raw = code.split("//")
    category = 4 if version == "9" and raw.startswith("E") else 3
    return spelled(prefix, version) + (f"{raw[:category]}.{raw[category:]}" if dotted and raw[category:] else raw)


def spelled(prefix: str, version: str | int) -> str:
    """`prefix` for an ICD version; `{cm9}` is CM for ICD-9 only (a bare ICD9 prefix may hold procedures)."""
    return prefix.format(version=version, cm9="CM" if str(version) == "9" else "")


# Procedures in the ICD systems' own spellings, and one under a bare ICD9 prefix with a diagnosis's shape: never
# diagnoses, whatever the spelling of the diagnoses.
ICD_PROCEDURES = pl.DataFrame([(1, t(21), "ICD10PCS/02HV33Z", None, None, 103),
                               (2, t(1), "ICD9Proc/38.93", None, None, 201),
                               (2, t(5), "ICD9PROC//3893", None, None, 202),
                               (2, t(5), "ICD9//3893", None, None, 202)], schema=tiny_events().schema, orient="row")
# ICD-9-CM diagnoses (an E code among them) in subject 2's encounters, so that both versions are rewritten.
ICD9_DIAGNOSES = pl.DataFrame([(2, t(3), "DIAGNOSIS//ICD//9//25000", None, None, 201),
                               (2, t(6), "DIAGNOSIS//ICD//9//E8781", None, None, 202),
                               (2, t(6), "DIAGNOSIS//ICD//9//V4581", None, None, 202)],
                              schema=tiny_events().schema, orient="row")


def cohort_outcome(wh, dataset: str) -> tuple[list, list]:
    """A dataset's default cohort as comparable across datasets: its trajectories and target codes without the
    cohort id."""
    cohort_id = build_cohort(wh, dataset, "default", CohortOptions(), seed=0)["cohort_id"]
    trajectories = wh.read("trajectories", cohort_id=cohort_id).select(
        "subject_id", "target_encounter_id", "cutoff_time", "split", "n_prior_encounters").sort(pl.all()).rows()
    targets = wh.read("targets", cohort_id=cohort_id).select(
        pl.col("trajectory_id").str.replace(f"^{cohort_id}:", ""), "code").sort(pl.all()).rows()
    return trajectories, targets


@pytest.mark.parametrize("prefix, dotted", [("ICD{version}CM/", True), ("ICD{version}CM//", True),
                                            ("ICD{version}CM//", False), ("ICD{version}{cm9}//", False),
                                            ("ICD{version}{cm9}/", True), ("DIAGNOSIS//ICD//{version}//", True)])
def test_ingest_rewrites_the_diagnosis_spellings_of_other_etls_to_the_platforms(wh_vocab, tmp_path, prefix, dotted):
    # meds_etl writes OMOP's ICD10CM/E11.9 and ICD9CM/250.00, other ETLs ICD10CM//E11.9 or ICD10//E119: refused as
    # "no diagnosis events" before. The copy holds them as the platform writes them, so the cohort is the one of the
    # same data in the platform's spelling, and the procedures stay procedures.
    canonical = pl.concat([tiny_events(), ICD9_DIAGNOSES, ICD_PROCEDURES]).sort("subject_id", "time", nulls_last=False)
    is_diagnosis = pl.col("code").str.starts_with("DIAGNOSIS//")
    other = canonical.with_columns(pl.when(is_diagnosis).then(pl.col("code").map_elements(
        lambda code: respelled(code, prefix, dotted), return_dtype=pl.String)).otherwise(pl.col("code")))
    # A dictionary in the same spelling, its descriptions kept, and its codes rewritten as the data's.
    dictionary = pl.DataFrame({"code": ["DIAGNOSIS//ICD//10//A000", "DIAGNOSIS//ICD//9//25000", "GENDER//F"],
                               "description": ["Cholera", "Diabetes", "female"]})
    for name, events in (("canonical", canonical), ("other", other)):
        root = write_tiny_meds(tmp_path / name, events)
        dictionary.with_columns(pl.when(is_diagnosis).then(pl.col("code").map_elements(
            lambda code: code if name == "canonical" else respelled(code, prefix, dotted), return_dtype=pl.String))
            .otherwise(pl.col("code"))).write_parquet(root / "metadata" / "codes.parquet")
        row = ingest_meds(wh_vocab, root, name)
    assert row["icd_versions"] == "9,10"
    assert {respelling.prefix for respelling in row["respelled"]} == {spelled(prefix, v) for v in (9, 10)}
    # Those written as the platform writes them (I10 has no dot) are not counted.
    assert sum(respelling.n_events for respelling in row["respelled"]) == (other["code"] != canonical["code"]).sum()
    gold = {name: pl.read_parquet(wh_vocab.meds_dir(name) / "data" / "**" / "*.parquet").select(canonical.columns)
            for name in ("canonical", "other")}
    assert gold["other"].equals(gold["canonical"])
    assert ICD_PROCEDURES["code"].is_in(gold["other"]["code"]).all()
    assert (pl.read_parquet(wh_vocab.meds_dir("other") / "metadata" / "codes.parquet").rows()
            == dictionary.rows())
    assert cohort_outcome(wh_vocab, "other") == cohort_outcome(wh_vocab, "canonical")


def test_a_dataset_mixing_the_platforms_spelling_with_another_gets_one_code_per_diagnosis(wh_vocab, tmp_path):
    # Half of the subjects exported by one ETL, half by another, and one encounter coded in both spellings: every
    # diagnosis becomes one code, so the targets are those of the data in one spelling.
    events = tiny_events()
    other_etl = pl.col("code").str.starts_with("DIAGNOSIS//") & pl.col("subject_id").is_in([1, 4])
    mixed = events.with_columns(pl.when(other_etl).then(pl.col("code").map_elements(
        lambda code: respelled(code, "ICD{version}CM/"), return_dtype=pl.String)).otherwise(pl.col("code")))
    twice = events.filter((pl.col("encounter_id") == 103) & pl.col("code").str.starts_with("DIAGNOSIS//"))
    write_tiny_meds(tmp_path / "one", events)
    write_tiny_meds(tmp_path / "mixed", pl.concat([mixed, twice]).sort("subject_id", "time", nulls_last=False))
    ingest_meds(wh_vocab, tmp_path / "one", "one")
    row = ingest_meds(wh_vocab, tmp_path / "mixed", "mixed")
    assert [(r.prefix, r.version) for r in row["respelled"]] == [("ICD10CM/", 10)]
    trajectories, targets = cohort_outcome(wh_vocab, "mixed")
    assert (trajectories, targets) == cohort_outcome(wh_vocab, "one")
    assert ("1:103", "DIAGNOSIS//ICD//10//I5023") in targets and len(targets) == len(set(targets))


def test_a_diagnosis_written_in_two_spellings_at_one_time_and_encounter_is_copied_once(wh_vocab, tmp_path,
                                                                                   monkeypatch):
    # A diagnosis in two spellings is one event: copied twice, it would be two rows of the cohort's event tables
    # to whatever counts their rows.
    # Only rows that the rewrite makes equal collapse: a code written twice in one spelling (a repeated measurement
    # MEDS allows), at another time or with another value stays, and of two spellings the one written more often
    # stays whole.
    base = tiny_events()

    def train_row(day: int, code: str, value: float | None = None, encounter: int = 201) -> tuple:
        return 2, t(day), code, value, None, encounter

    two_spellings = [train_row(3, "ICD10CM/E11.9"),  # E119 again (discharge of 201), another spelling: one event
                     train_row(3, dx("I10")),  # I10 again in its spelling: two
                     train_row(4, "ICD10CM/E11.9"),  # another time: another event
                     train_row(6, "ICD10CM/J18.9", 1.0, 202),  # another value: another event
                     *[train_row(6, "ICD10//I10", encounter=202)] * 2]  # twice beside once in the platform's: twice
    meant = [train_row(3, dx("I10")), train_row(4, dx("E119")), train_row(6, dx("J189"), 1.0, 202),
             train_row(6, dx("I10"), encounter=202)]

    def with_rows(rows: list[tuple]) -> pl.DataFrame:
        return pl.concat([base, pl.DataFrame(rows, schema=base.schema, orient="row")]).sort(
            "subject_id", "time", nulls_last=False, maintain_order=True)

    two = write_tiny_meds(tmp_path / "two", with_rows(two_spellings))
    # Batches of a few rows: the copy rewrites a shard a batch at a time, and the rows go by their number in the
    # shard. (Small row groups would not do: a batch spans row groups, so this shard would be one.)
    monkeypatch.setattr(meds_module, "_BATCH_ROWS", 4)
    ingest_meds(wh_vocab, two, "two")
    monkeypatch.undo()
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "meant", with_rows(meant)), "meant")
    gold = pl.read_parquet(wh_vocab.meds_dir("two") / "data" / "**" / "*.parquet").select(base.columns)
    assert gold.sort(pl.all(), nulls_last=True).equals(with_rows(meant).sort(pl.all(), nulls_last=True))
    train_events = {}
    for name in ("two", "meant"):
        cohort_id = build_cohort(wh_vocab, name, name, CohortOptions(), seed=0)["cohort_id"]
        train_events[name] = wh_vocab.read("train_events", cohort_id=cohort_id).drop("cohort_id")
    assert train_events["two"].equals(train_events["meant"])


def test_the_copy_finds_respelled_repeats_within_the_ingests_memory_limit(wh_vocab, tmp_path, monkeypatch):
    # Sorting a large shard's diagnoses without a limit lets DuckDB take 80% of the machine's memory.
    limits = []
    spilling = meds_module._spilling_connection

    def recording(what: str, memory_limit: str):
        limits.append((what.split(" of ")[0], memory_limit))
        return spilling(what, memory_limit)

    monkeypatch.setattr(meds_module, "_spilling_connection", recording)
    rows = pl.DataFrame([(2, t(3), "ICD10CM/E11.9", None, None, 201)], schema=tiny_events().schema, orient="row")
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "other", pl.concat([tiny_events(), rows])), "other",
                memory_limit="300MB")
    assert ("finding the diagnoses", "300MB") in limits
    assert {limit for _, limit in limits} == {"300MB"}


@pytest.mark.parametrize("code, problem", [
    ("icd10cm/j44.9", r"diagnosis code 'icd10cm/j44\.9' is not upper case: write it 'ICD10CM/J44\.9'"),
    # An ICD-9 procedure (two digits before the dot) under a diagnosis prefix: not read as a diagnosis.
    ("ICD9CM/38.93", r"diagnosis code 'ICD9CM/38\.93': no ICD-9 diagnosis code follows 'ICD9CM/' \(such as 250\.00, "
                     r"V45\.81 or 25000\): write the code so, or as DIAGNOSIS//ICD//9//<code without dot>; give a "
                     r"procedure its own prefix \(ICD9Proc/…\)"),
    ("ICD10CM/J44.9.1", r"diagnosis code 'ICD10CM/J44\.9\.1': no ICD-10 diagnosis code follows 'ICD10CM/'")])
def test_a_diagnosis_spelling_ingest_cannot_read_is_refused_naming_the_code(wh_vocab, tmp_path, code, problem):
    events = tiny_events().with_columns(pl.col("code").replace(dx("J449"), code))
    root = write_tiny_meds(tmp_path / "meds", events)
    row = pl.read_parquet(root / "data" / "0.parquet")["code"].to_list().index(code) + 1
    with pytest.raises(InputError, match=rf"0\.parquet, row {row}: {problem}.* \(2 events like it\)$"):
        ingest_meds(wh_vocab, root, "meds")


def test_data_without_diagnosis_codes_is_told_the_codes_it_has(wh_vocab, tmp_path):
    # A SNOMED-coded export was refused with "no diagnosis events" and no hint of what the data held instead.
    events = tiny_events().with_columns(pl.col("code").str.replace("^DIAGNOSIS//ICD//10//", "SNOMED/"))
    root = write_tiny_meds(tmp_path / "snomed", events)
    n_snomed, n_labs, n_admissions = (events.filter(pl.col("code").str.starts_with(prefix)).height
                                      for prefix in ("SNOMED/", "LAB//", "HOSPITAL_ADMISSION//"))
    with pytest.raises(InputError, match=rf"snomed: no diagnosis events \(codes DIAGNOSIS//ICD//9\|10//\.\.\., or "
                                         rf"ICD10CM/… and the other spellings ingest takes\); codes seen: SNOMED/… "
                                         rf"{n_snomed}, LAB//… {n_labs}, HOSPITAL_ADMISSION//… {n_admissions}, .*: "
                                         r"next-encounter forecasting needs ICD-9-CM or ICD-10-CM diagnosis codes; "
                                         r"write them as DIAGNOSIS//ICD//10//<code without dot>"):
        ingest_meds(wh_vocab, root, "snomed")


def test_the_cli_says_which_diagnosis_codes_it_rewrote(tmp_path):
    from click.testing import CliRunner

    from dxr.cli import main

    events = tiny_events().with_columns(pl.col("code").str.replace("^DIAGNOSIS//ICD//10//", "ICD10CM//"))
    root = write_tiny_meds(tmp_path / "meds", events)
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path / "wh"), "ingest", "meds", str(root),
                                       "--name", "omop"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    n_diagnoses = events.filter(pl.col("code").str.starts_with("ICD10CM//")).height
    assert (f"diagnosis codes: {n_diagnoses} rewritten from ICD10CM//… to DIAGNOSIS//ICD//10//… without the dot "
            "(e.g. ICD10CM//E119)") in result.output


def test_string_subject_ids_are_told_to_be_numbered(wh_vocab, tmp_path):
    # "cast the columns to the MEDS types" cannot turn P0001 into a number.
    events = tiny_events().with_columns(pl.format("P{}", pl.col("subject_id")).alias("subject_id"))
    root = tmp_path / "strings"
    write_tiny_meds(root)
    pq.write_table(events.to_arrow(), root / "data" / "0.parquet")
    with pytest.raises(InputError, match=r"0\.parquet: column 'subject_id' is large_string \(such as 'P1'\), not an "
                                         r"integer: number the subjects \(map each id to an integer, keeping the map "
                                         r"to look patients up\) and write those numbers as int64$"):
        ingest_meds(wh_vocab, root, "strings")


@pytest.mark.parametrize("column, fix", [
    ("visit_id", "the shard has 'visit_id': when its ids are hospital encounters (admissions), rename it to "
                 "encounter_id; when it counts outpatient visits too, write the admission id as encounter_id instead"),
    ("HADM_ID", "rename column 'HADM_ID' to hadm_id (column names are case-sensitive)")])
def test_an_encounter_column_under_another_name_is_named_as_the_one_to_rename(wh_vocab, tmp_path, column, fix):
    # meds_etl writes the encounter as visit_id; MIMIC's CSVs name it HADM_ID.
    root = write_tiny_meds(tmp_path / "meds", tiny_events().rename({"encounter_id": column}))
    with pytest.raises(InputError, match=re.escape(f"0.parquet: missing column 'encounter_id' (int64): {fix}")):
        ingest_meds(wh_vocab, root, "meds")


@pytest.mark.parametrize("column, written, why", [
    ("subject_id", "Subject_ID", "column names are case-sensitive"),
    ("time", "TIME", "column names are case-sensitive"),
    ("code", " code", "column names keep their spaces")])
def test_a_shard_column_in_another_case_or_with_spaces_is_named_as_the_one_to_rename(wh_vocab, tmp_path, column,
                                                                                        written, why):
    # Was "every MEDS shard needs it", which left the user to spot that the shard has the column under another spelling.
    root = write_tiny_meds(tmp_path / "meds")
    pq.write_table(tiny_events().rename({column: written}).to_arrow(), root / "data" / "0.parquet")
    with pytest.raises(InputError, match=re.escape(f"0.parquet: missing column '{column}' (") + r"[^)]*\): "
                       + re.escape(f"rename column {written!r} to {column} ({why})") + "$"):
        ingest_meds(wh_vocab, root, "meds")
    assert not wh_vocab.has_rows("datasets", dataset_id="meds")


@pytest.mark.parametrize("file, column", [("subject_splits.parquet", "subject_id"), ("subject_splits.parquet", "split"),
                                          ("codes.parquet", "code")])
def test_a_metadata_column_in_another_case_is_named_as_the_one_to_rename(wh_vocab, tiny_meds, file, column):
    path = tiny_meds / "metadata" / file
    pl.read_parquet(path).rename({column: column.upper()}).write_parquet(path)
    with pytest.raises(InputError, match=re.escape(f"{file}: missing column '{column}' (columns found: ")
                       + r".*\): " + re.escape(f"rename column '{column.upper()}' to {column} (column names are "
                                               "case-sensitive)") + "$"):
        ingest_meds(wh_vocab, tiny_meds, "meds")


@pytest.mark.parametrize("code, problem", [
    ("", "code is empty: every MEDS event needs a code"),
    ("  ", "code is empty: every MEDS event needs a code"),
    ("\t", "code is empty: every MEDS event needs a code"),
    ("DIAGNOSIS//ICD//10//J449\t", "diagnosis code 'DIAGNOSIS//ICD//10//J449\\t' has white space around it: write it "
     "'DIAGNOSIS//ICD//10//J449'"),
    (" DIAGNOSIS//ICD//10//J449", "diagnosis code ' DIAGNOSIS//ICD//10//J449' has white space around it: write it "
                                  "'DIAGNOSIS//ICD//10//J449'"),
    ("DIAGNOSIS//ICD//10//J449 ", "diagnosis code 'DIAGNOSIS//ICD//10//J449 ' has white space around it: write it "
                                  "'DIAGNOSIS//ICD//10//J449'"),
    (" ICD10CM/J44.9", "diagnosis code ' ICD10CM/J44.9' has white space around it: write it 'ICD10CM/J44.9'")])
def test_an_empty_code_or_a_diagnosis_with_spaces_around_it_is_refused_naming_the_row(wh_vocab, tmp_path, code,
                                                                                        problem):
    # Were taken: '' as a code of its own, ' DIAGNOSIS//…' as no diagnosis at all (or, every diagnosis so written,
    # "no diagnosis events"), 'DIAGNOSIS//… ' as "unknown code system".
    events = tiny_events()
    row = events["code"].to_list().index(dx("J449")) + 1
    root = write_tiny_meds(tmp_path / "meds", events)
    written = events.with_columns(pl.when(pl.int_range(pl.len()) == row - 1).then(pl.lit(code))
                                  .otherwise(pl.col("code")).alias("code"))
    pq.write_table(written.to_arrow(), root / "data" / "0.parquet")
    with pytest.raises(InputError, match=re.escape(f"0.parquet, row {row}: {problem}") + "$"):
        ingest_meds(wh_vocab, root, "meds")
    assert not wh_vocab.meds_dir("meds").exists()


def test_a_dictionary_diagnosis_code_with_spaces_around_it_is_refused(wh_vocab, tiny_meds):
    path = tiny_meds / "metadata" / "codes.parquet"
    pl.DataFrame({"code": ["LAB//HBA1C//%", dx("J449 ")], "description": ["HbA1c", "COPD"]}).write_parquet(path)
    with pytest.raises(InputError, match=re.escape(f"codes.parquet, row 2: diagnosis code '{dx('J449 ')}' has white "
                                                   f"space around it: write it '{dx('J449')}'") + "$"):
        ingest_meds(wh_vocab, tiny_meds, "meds")


def test_ingest_says_how_many_patients_its_split_file_leaves_out(tmp_path):
    # Such patients are in no cohort; the ingest said nothing, so a split file listing none of them passed
    # unnoticed until a cohort build found no trajectory.
    from click.testing import CliRunner

    from dxr.cli import main

    root = write_tiny_meds(tmp_path / "meds")
    splits = root / "metadata" / "subject_splits.parquet"
    pl.read_parquet(splits).filter(pl.col("subject_id") != 3).write_parquet(splits)
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path / "wh"), "ingest", "meds", str(root),
                                       "--name", "tiny"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (f"note: 1 of the {len(SPLITS)} patients is not in metadata/subject_splits.parquet: it is left out of "
            "every cohort (neither trained on nor forecast); give each a split there, or leave the file out for the "
            "seeded hash split") in result.output
    write_tiny_meds(root)  # every patient listed: no note
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path / "wh"), "ingest", "meds", str(root),
                                       "--name", "tiny"], catch_exceptions=False)
    assert result.exit_code == 0 and "subject_splits.parquet" not in result.output, result.output


def ingested(tmp_path: Path, root: Path) -> str:
    """The output of `dxr ingest meds` of `root`, which must succeed."""
    from click.testing import CliRunner

    from dxr.cli import main

    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path / "wh"), "ingest", "meds", str(root),
                                       "--name", "meds"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_the_tiny_dataset_ingests_without_a_note(tmp_path):
    assert "note:" not in ingested(tmp_path, write_tiny_meds(tmp_path / "meds"))


def test_ingest_notes_patients_born_after_their_first_event(tmp_path):
    # Taken without a word: the prior featurized the earlier visits at negative ages and Direct Forecast's record
    # said "Born: 2020" above a visit of 2020-01-01.
    events = tiny_events().with_columns(pl.when((pl.col("subject_id") >= 2) & (pl.col("code") == "MEDS_BIRTH"))
                                        .then(pl.lit(t(4))).otherwise(pl.col("time")).alias("time"))
    output = ingested(tmp_path, write_tiny_meds(tmp_path / "meds", events))
    assert ("note: 3 patients have a MEDS_BIRTH dated after their first other event (e.g. subject 2: born 2020-01-05 "
            "00:00:00, first event 2020-01-01 00:00:00): taken as written, the ages at earlier events are negative "
            "for the EHR prior, a record cut before the birth has none (the prior takes the train patients' mean "
            "age), and Direct Forecast's record names a birth year after visits it lists; correct the birth in the "
            "export\n") in output


def test_a_birth_after_the_first_event_is_told_at_the_wall_clock_times_of_a_time_zone(tmp_path):
    # Subject 2 born at 05:00 at +05:00 (00:00 UTC) and first seen at 04:00 (23:00 UTC the day before).
    events = tiny_events().filter(pl.col("subject_id") == 2).with_columns(
        pl.when(pl.col("code") == "MEDS_BIRTH").then(pl.lit(t(0))).otherwise(pl.col("time")).alias("time"))
    events = pl.concat([events, pl.DataFrame([(2, datetime(2019, 12, 31, 23), "LAB//HBA1C//%", 7.0, None, None)],
                                             schema=events.schema, orient="row")])
    root = write_tiny_meds(tmp_path / "meds", events)
    pl.read_parquet(root / "data" / "0.parquet").with_columns(
        pl.col("time").dt.replace_time_zone("UTC").dt.convert_time_zone("+05:00")).write_parquet(
        root / "data" / "0.parquet")
    assert ("(e.g. subject 2: born 2020-01-01 05:00:00, first event 2020-01-01 04:00:00)"
            in ingested(tmp_path, root))


@pytest.mark.parametrize("time, row_time", [(datetime(1700, 1, 1), "1700-01-01 00:00:00"),
                                            (datetime(2300, 1, 1), "2300-01-01 00:00:00"),
                                            (datetime(9999, 12, 31, 23, 59, 59), "9999-12-31 23:59:59")])
def test_ingest_notes_events_dated_before_1800_or_from_2300(tmp_path, time, row_time):
    events = tiny_events()
    row = events["code"].to_list().index("LAB//BNP//pg/mL") + 1
    root = write_tiny_meds(tmp_path / "meds", events)
    dated = events.with_columns(pl.when(pl.int_range(pl.len()) == row - 1).then(pl.lit(time))
                                .otherwise(pl.col("time")).alias("time"))
    pq.write_table(dated.to_arrow(), root / "data" / "0.parquet")
    assert (f"note: 1 event is dated before 1800 or in 2300 or later (e.g. data/0.parquet, row {row}: subject 1, "
            f"LAB//BNP//pg/mL at {row_time}): taken as dated, such an event precedes every cutoff of its patient or "
            "follows them all (an admission so dated makes the patient's last encounter, the target of --target "
            "final); a placeholder date? correct it in the export\n") in ingested(tmp_path, root)


def test_mimic_shifted_years_and_births_300_years_before_them_stay_quiet(tmp_path):
    # MIMIC shifts its years to 2100-2210; MIMIC-III moves the births of patients over 89 300 years before their
    # first admission (the demo's earliest: 1844).
    events = tiny_events().with_columns(pl.when(pl.col("code") == "MEDS_BIRTH").then(pl.lit(datetime(1800, 1, 1)))
                                        .otherwise(pl.col("time").dt.offset_by("190y")).alias("time"))
    assert "note:" not in ingested(tmp_path, write_tiny_meds(tmp_path / "meds", events))


@pytest.mark.parametrize("unit, times, written, row, problem", [
    # Epoch microseconds under a millisecond type: every time about year 51,969, a birth before 1970 about -18,031.
    ("ms", lambda us: us, None, 2, "time -631,152,000,000,000 ms from 1970 (year -18,031) is outside the years "
                                   "1 to 9999 that dates take (56 events like it): write the times in the unit of the "
                                   "column's type, timestamp[ms]"),
    # Beyond DuckDB's own range too: validation failed with its ConversionException.
    ("s", lambda us: us, "ms", 2, "time -631,152,000,000,000,000 ms from 1970 (year -19,998,441) is outside the "
                                  "years 1 to 9999 that dates take (56 events like it): write the times in the unit "
                                  "of the column's type, timestamp[ms]"),
    # Epoch nanoseconds under a microsecond type.
    ("us", lambda us: None if us is None else us * 1000, None, 2,
     "time -631,152,000,000,000,000 us from 1970 (year -18,031) is outside the years 1 to 9999 that dates take "
     "(56 events like it): write the times in the unit of the column's type, timestamp[us]")])
def test_times_beyond_the_years_dates_take_are_refused_naming_the_row(wh_vocab, tmp_path, unit, times, written, row,
                                                                      problem):
    # Taken, their cohort was built, and Direct Forecast failed rendering its first record ("year -18031 is out of
    # range"); under timestamp[s], validation ended in DuckDB's traceback.
    root = write_tiny_meds(tmp_path / "meds")
    events = tiny_events().to_arrow()
    numbers = pa.array([times(us) for us in events["time"].cast(pa.int64()).to_pylist()], pa.int64())
    pq.write_table(events.set_column(1, "time", numbers.cast(pa.timestamp(unit))), root / "data" / "0.parquet")
    assert pq.read_schema(root / "data" / "0.parquet").field("time").type == pa.timestamp(written or unit)
    with pytest.raises(InputError, match=re.escape(f"0.parquet, row {row}: {problem} (epoch microseconds as "
                                                   "timestamp[us]), or correct the value") + "$"):
        ingest_meds(wh_vocab, root, "meds")


def with_zoned_bnp(root: Path, zone: str, instant: datetime) -> int:
    """Rewrite `root`'s shard with its times in `zone` (the same instants) and the first BNP lab at `instant` (UTC);
    returns that lab's row (1-based)."""
    events = tiny_events()
    row = events["code"].to_list().index("LAB//BNP//pg/mL")
    dated = events.with_columns(pl.when(pl.int_range(pl.len()) == row).then(pl.lit(instant))
                                .otherwise(pl.col("time")).alias("time")).to_arrow()
    instants = dated["time"].cast(pa.int64()).cast(pa.timestamp("us", zone))
    pq.write_table(dated.set_column(1, "time", instants), root / "data" / "0.parquet")
    return row + 1


@pytest.mark.parametrize("zone, instant, wall_clock", [
    # A placeholder 9999-12-31 in UTC (as Spark writes times) was refused, as "about year 10,000", where the same
    # date without a zone is noted: a zoned time had a day to spare at either end, whatever its offset.
    ("UTC", datetime(9999, 12, 31), "9999-12-31 00:00:00"),
    ("+14:00", datetime(9999, 12, 31, 9, 59, 59), "9999-12-31 23:59:59"),
    ("Etc/GMT+12", datetime(1, 1, 1, 12), "0001-01-01 00:00:00")])  # a zone name, 12 hours behind UTC
def test_a_zoned_time_is_a_date_by_the_wall_clock_time_its_copy_keeps(tmp_path, zone, instant, wall_clock):
    root = write_tiny_meds(tmp_path / "meds")
    row = with_zoned_bnp(root, zone, instant)
    assert f"row {row}: subject 1, LAB//BNP//pg/mL at {wall_clock}): taken as dated" in ingested(tmp_path, root)


@pytest.mark.parametrize("zone, instant, problem", [
    ("+14:00", datetime(9999, 12, 31, 10), "time 253,402,250,400,000,000 us from 1970 (year 10,000)"),
    ("Etc/GMT+12", datetime(1, 1, 1, 11, 59, 59), "time -62,135,553,601,000,000 us from 1970 (year 0)")])
def test_a_zoned_time_whose_wall_clock_time_is_no_date_is_refused(tmp_path, zone, instant, problem):
    root = write_tiny_meds(tmp_path / "meds")
    row = with_zoned_bnp(root, zone, instant)
    time_type = pq.read_schema(root / "data" / "0.parquet").field("time").type
    with pytest.raises(InputError, match=re.escape(f"0.parquet, row {row}: {problem} is outside the years 1 to 9999 "
                                                   "that dates take: write the times in the unit of the column's "
                                                   f"type, {time_type} (epoch")):
        validate_meds_dir(root)


def test_a_patient_in_two_shards_is_noted_and_built_as_from_one(wh_vocab, tmp_path):
    # Every step reads the shards as one table: the cohort is the same as with the patient in one shard. Held-out
    # subject 1 is split by time; train subject 2 (its train events) with each encounter's diagnoses apart from the
    # encounter's other events.
    events = tiny_events()
    one = write_tiny_meds(tmp_path / "one", events)
    two = write_tiny_meds(tmp_path / "two", events.filter(~pl.col("subject_id").is_in([1, 2])))
    early = pl.col("time").fill_null(t(0)) < t(15)  # the static rows with the first encounters
    write_data_shard(two, "1", events.filter((pl.col("subject_id") == 1) & early))
    write_data_shard(two, "train/2", events.filter((pl.col("subject_id") == 1) & ~early))
    diagnosis = pl.col("code").str.starts_with("DIAGNOSIS//")
    write_data_shard(two, "train/3", events.filter((pl.col("subject_id") == 2) & ~diagnosis))
    write_data_shard(two, "train/4", events.filter((pl.col("subject_id") == 2) & diagnosis))
    assert ("note: 2 patients have events in more than one shard (e.g. subject 1 in data/1.parquet and "
            "data/train/2.parquet): dxr reads the shards as one table, so their events are joined, but MEDS keeps a "
            "subject in one shard, as other MEDS tools expect\n") in ingested(tmp_path, two)
    tables = ("trajectories", "pretarget_events", "train_events", "targets")
    cohorts = []
    for root in (one, two):
        ingest_meds(wh_vocab, root, root.name)
        cohort_id = build_cohort(wh_vocab, root.name, "default", CohortOptions(target="every"), seed=0)["cohort_id"]
        # Trajectory ids begin with the cohort id, which differs with the files (the dataset's fingerprint).
        cohorts.append([wh_vocab.read(table, cohort_id=cohort_id).drop("cohort_id").with_columns(
            pl.col("^trajectory_id$").str.replace(f"^{cohort_id}:", "")) for table in tables])
    assert [frame.height for frame in cohorts[0]] == [4, 41, 14, 9]
    for table, from_one, from_two in zip(tables, *cohorts):
        assert from_two.equals(from_one), f"{table}:\n{from_one}\n{from_two}"


def test_demographics_kept_in_a_shard_of_their_own_are_no_patient_in_two_shards(tmp_path):
    # A layout the time zone check takes (static rows apart) must not put every patient in the shards note: only
    # the clinical events, dated and other than the birth, say where a patient is.
    events = tiny_events()
    demographic = pl.col("time").is_null() | (pl.col("code") == "MEDS_BIRTH")
    root = write_tiny_meds(tmp_path / "apart", events.filter(~demographic))
    write_data_shard(root, "demographics", events.filter(demographic))
    assert "more than one shard" not in ingested(tmp_path, root)


def test_ingest_notes_files_under_data_that_no_step_reads(tmp_path):
    # A CSV export dropped beside the shards was left out without a word.
    root = write_tiny_meds(tmp_path / "meds")
    (root / "data" / "labs.csv").write_text("subject_id,time,code\n")
    (root / "data" / "0.parquet.tmp").write_bytes(b"")
    # Tools' own files are not counted: a file browser's, a notebook's, and Spark's and pyarrow's (named with "_").
    (root / "data" / ".DS_Store").write_bytes(b"")
    (root / "data" / ".ipynb_checkpoints").mkdir()
    (root / "data" / ".ipynb_checkpoints" / "labs-checkpoint.csv").write_text("subject_id,time,code\n")
    (root / "data" / "_SUCCESS").write_bytes(b"")
    (root / "data" / "_common_metadata").write_bytes(b"")
    output = ingested(tmp_path, root)
    assert ("note: 2 files under data/ are not named *.parquet, so no step reads them (e.g. data/0.parquet.tmp): MEDS "
            "keeps events in data/**/*.parquet; convert events written otherwise (a CSV) to Parquet there\n") in output


def test_ingest_notes_parquet_files_that_spark_and_pyarrow_skip_as_their_own(tmp_path):
    # A failed Spark write leaves its part files in data/_temporary/: read as events, they repeated the events of
    # subjects 3 and 4 without a word, where pyarrow.dataset and Spark would not read them.
    root = write_tiny_meds(tmp_path / "meds")
    write_data_shard(root, "_temporary/0/part-00000", tiny_events().filter(pl.col("subject_id") == 4))
    write_data_shard(root, ".ipynb_checkpoints/0-checkpoint", tiny_events().filter(pl.col("subject_id") == 3))
    assert ("note: 2 Parquet files under data/ are named, or in a folder named, with a leading . or _ (e.g. "
            "data/.ipynb_checkpoints/0-checkpoint.parquet): Spark and pyarrow skip such files as a tool's own, but "
            "dxr reads them as events; remove them if a tool left them (a failed write's part files repeat events)\n"
            ) in ingested(tmp_path, root)


def test_a_shard_written_as_a_directory_of_parts_is_read(tmp_path):
    # Spark, pyarrow and pandas write a Parquet dataset as a directory named *.parquet holding its part files, which
    # DuckDB's data/**/*.parquet reads: the directory was taken for a shard and refused as "not a readable Parquet
    # file (... is a directory): rewrite or remove it".
    root = write_tiny_meds(tmp_path / "meds")
    parts = root / "data" / "events.parquet"
    parts.mkdir()
    (root / "data" / "0.parquet").rename(parts / "part-00000.snappy.parquet")
    (parts / "_SUCCESS").write_bytes(b"")
    output = ingested(tmp_path, root)
    assert output.startswith(f"dataset meds: {len(SPLITS)} patients, {tiny_events().height} events,"), output
    assert "note:" not in output, output
    copied = tmp_path / "wh" / "gold" / "meds" / "meds" / "data"
    assert sorted(str(path.relative_to(copied)) for path in copied.rglob("*") if path.is_file()) == [
        "events.parquet/_SUCCESS", "events.parquet/part-00000.snappy.parquet"]


def test_ingest_notes_subjects_of_the_split_file_without_events(tmp_path):
    # A split file of another extract, or shards left behind, passed unnoticed: those subjects are in no cohort.
    root = write_tiny_meds(tmp_path / "meds")
    splits = root / "metadata" / "subject_splits.parquet"
    pl.concat([pl.read_parquet(splits), pl.DataFrame({"subject_id": [9, 7], "split": ["train", "held_out"]})]
              ).write_parquet(splits)
    assert ("note: 2 subjects of metadata/subject_splits.parquet (e.g. subject 7) have no event in data/: are shards "
            "missing, or is the file another extract's?\n") in ingested(tmp_path, root)


def test_doctests_of_the_meds_module():
    import doctest

    result = doctest.testmod(meds_module)
    assert result.failed == 0 and result.attempted > 0, result
