"""Benchmark: MIMIC-IV importer on a generated `hosp` file set at full scale.

Generates gzipped CSVs in the official MIMIC-IV layout (every official column, so parsing costs
what it costs on the real files) — by default about 300k patients, 431k admissions, 4.8M diagnosis
rows (ICD-9 and ICD-10 mixed within patients, some duplicates, a few missing dischtimes), 670k
procedures and 3M prescriptions, and with `--labevents N` that many lab results (imported with
`labs=True`) — then runs `import_mimic4` in a child process and reports wall time, rows/s and the
child's peak resident memory. Prints a table; writes JSON to benchmarks/results/mimic_import.json.

    python benchmarks/mimic_import.py                      # full scale, files in a temp dir
    python benchmarks/mimic_import.py --workdir /tmp/mb --keep   # keep and reuse the generated files
    python benchmarks/mimic_import.py --scale 0.05         # quick check
    python benchmarks/mimic_import.py --labevents 30000000 # with lab results (MIMIC-III has about 28M)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import duckdb

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from benchmarks.provenance import write_result  # noqa: E402
from warehouse import duck  # noqa: E402

# Full-scale sizes, close to MIMIC-IV v2.2 hosp (prescriptions there: 15.4M; pass --prescriptions).
FULL = {"patients": 300_000, "subjects_admitted": 180_000, "admissions": 431_000, "diagnoses_per_admission": 11,
        "procedure_share": 0.6, "prescriptions": 3_000_000}
ICD9_POOL, ICD10_POOL = 9_000, 16_000


def _uniform(salt: int, key: str = "i") -> str:
    """A deterministic pseudo-random number in [0, 1) from the row key (same rows on every run)."""
    return f"((hb({key}, {salt}) % 1000003) / 1000003.0)"


def generate(folder: Path, scale: float, prescriptions: int, labevents: int) -> dict[str, int]:
    """Write the seven hosp tables (nine with lab results) as .csv.gz into `folder`; returns rows per table."""
    folder.mkdir(parents=True, exist_ok=True)
    n_patients = int(FULL["patients"] * scale)
    n_admitted = int(FULL["subjects_admitted"] * scale)
    n_admissions = int(FULL["admissions"] * scale)
    con = duckdb.connect()
    # A signed hash keeps arithmetic and list indexing in BIGINT.
    con.execute("CREATE MACRO hb(key, salt) AS CAST(hash(key, salt) >> 1 AS BIGINT)")
    # Anchor year per subject index: admissions are placed around it, so ages and years stay coherent.
    anchor = "(2110 + hb(s, 11) % 100)"

    def copy(name: str, query: str) -> int:
        path = folder / f"{name}.csv.gz"
        con.execute(f"COPY ({query}) TO {duck.literal(path)} (HEADER, DELIMITER ',', COMPRESSION gzip)")
        # Read back as the importer reads a user's files: quoted, glob-escaped, without hive partitioning.
        return con.execute(f"SELECT count(*) FROM {duck.read('read_csv', path)}").fetchone()[0]

    rows = {}
    rows["patients"] = copy("patients", f"""
        SELECT 10000000 + s AS subject_id, CASE WHEN hb(s, 12) % 2 = 0 THEN 'F' ELSE 'M' END AS gender,
               CAST(18 + hb(s, 13) % 74 AS INTEGER) AS anchor_age, {anchor} AS anchor_year,
               '2011 - 2013' AS anchor_year_group,
               CASE WHEN hb(s, 14) % 10 = 0 THEN strftime(make_date({anchor} + 3, 1 + hb(s, 15) % 12, 1), '%Y-%m-%d')
               END AS dod
        FROM range({n_patients}) t(s)""")
    con.execute(f"""CREATE TABLE adm AS
        SELECT i, hadm_id, s, make_timestamp({anchor}, 1, 1, 0, 0, 0)
                              + to_minutes(CAST(hb(i, 22) % (60 * 24 * 365 * 3) AS BIGINT)) AS admittime
        FROM (SELECT i, 20000000 + i AS hadm_id, hb(i, 21) % {n_admitted} AS s FROM range({n_admissions}) t(i))""")
    rows["admissions"] = copy("admissions", f"""
        SELECT 10000000 + s AS subject_id, hadm_id, strftime(admittime, '%Y-%m-%d %H:%M:%S') AS admittime,
               CASE WHEN hb(i, 23) % 1000 <> 0
                    THEN strftime(admittime + to_minutes(CAST(600 + hb(i, 24) % 20000 AS BIGINT)), '%Y-%m-%d %H:%M:%S')
               END AS dischtime,
               NULL AS deathtime, ['EW EMER.', 'URGENT', 'ELECTIVE', 'OBSERVATION ADMIT'][1 + hb(i, 25) % 4]
                   AS admission_type,
               'P' || lpad(CAST(hb(i, 26) % 9999 AS VARCHAR), 5, '0') AS admit_provider_id,
               'EMERGENCY ROOM' AS admission_location,
               ['HOME', 'SKILLED NURSING FACILITY', 'HOME HEALTH CARE', 'REHAB'][1 + hb(i, 27) % 4]
                   AS discharge_location,
               'Medicare' AS insurance, 'ENGLISH' AS language, 'MARRIED' AS marital_status, 'WHITE' AS race,
               NULL AS edregtime, NULL AS edouttime, 0 AS hospital_expire_flag
        FROM adm""")
    # Skewed code choice (a few codes are frequent, as in real data); ICD-9 for ~45% of admissions.
    per = FULL["diagnoses_per_admission"]
    rows["diagnoses_icd"] = copy("diagnoses_icd", f"""
        WITH picks AS (
            SELECT a.s, a.hadm_id, a.i, n.k + 1 AS seq_num, hb(a.i, 31) % 100 < 45 AS icd9,
                   {_uniform(32, "a.i * 64 + n.k")} AS u
            FROM adm a, LATERAL (SELECT unnest(range(CAST(hb(a.i, 33) % {2 * per} AS INTEGER) + 1)) AS k) n
        )
        SELECT 10000000 + s AS subject_id, hadm_id, seq_num,
               CASE WHEN icd9 THEN lpad(CAST(CAST(u * u * {ICD9_POOL} AS INTEGER) AS VARCHAR), 5, '0')
                    ELSE chr(65 + CAST(u * u * {ICD10_POOL} AS INTEGER) % 26)
                         || lpad(CAST(CAST(u * u * {ICD10_POOL} AS INTEGER) // 26 AS VARCHAR), 3, '0') END AS icd_code,
               CASE WHEN icd9 THEN 9 ELSE 10 END AS icd_version
        FROM picks ORDER BY hadm_id, seq_num""")
    rows["d_icd_diagnoses"] = copy("d_icd_diagnoses", f"""
        SELECT lpad(CAST(k AS VARCHAR), 5, '0') AS icd_code, 9 AS icd_version,
               'Generated ICD-9 diagnosis ' || k AS long_title FROM range({ICD9_POOL}) t(k)
        UNION ALL
        SELECT chr(CAST(65 + k % 26 AS INTEGER)) || lpad(CAST(k // 26 AS VARCHAR), 3, '0'), 10,
               'Generated ICD-10 diagnosis ' || k FROM range({ICD10_POOL}) t(k)""")
    rows["procedures_icd"] = copy("procedures_icd", f"""
        SELECT 10000000 + s AS subject_id, hadm_id, n.k + 1 AS seq_num, strftime(admittime, '%Y-%m-%d') AS chartdate,
               CASE WHEN hb(i, 31) % 100 < 45 THEN lpad(CAST(hb(i * 8 + n.k, 41) % 3000 AS VARCHAR), 4, '0')
                    ELSE '0' || chr(CAST(65 + hb(i * 8 + n.k, 42) % 26 AS INTEGER)) || 'H'
                         || lpad(CAST(hb(i * 8 + n.k, 43) % 1000 AS VARCHAR), 3, '0') || 'Z'
               END AS icd_code,
               CASE WHEN hb(i, 31) % 100 < 45 THEN 9 ELSE 10 END AS icd_version
        FROM adm, LATERAL (SELECT unnest(range(CAST(hb(i, 44) % 5 AS INTEGER))) AS k) n
        WHERE hb(i, 45) % 100 < {int(FULL['procedure_share'] * 100)}""")
    rows["d_icd_procedures"] = copy("d_icd_procedures", """
        SELECT lpad(CAST(k AS VARCHAR), 4, '0') AS icd_code, 9 AS icd_version, 'Generated procedure ' || k AS long_title
        FROM range(3000) t(k)""")
    n_rx = int(prescriptions * scale)
    rows["prescriptions"] = copy("prescriptions", f"""
        WITH r AS (SELECT j, hb(j, 51) % {n_admissions} AS i FROM range({n_rx}) t(j))
        SELECT 10000000 + a.s AS subject_id, a.hadm_id, j AS pharmacy_id,
               CAST(a.hadm_id AS VARCHAR) || '-' || j AS poe_id,
               j % 100 AS poe_seq, 'P00001' AS order_provider_id,
               CASE WHEN hb(j, 52) % 200 <> 0
                    THEN strftime(a.admittime + to_minutes(CAST(hb(j, 53) % 5000 AS BIGINT)), '%Y-%m-%d %H:%M:%S') END
                   AS starttime,
               NULL AS stoptime, 'MAIN' AS drug_type, 'Drug ' || (hb(j, 54) % 4000) AS drug,
               'FORM' || (hb(j, 54) % 4000) AS formulary_drug_cd, NULL AS gsn,
               CASE WHEN hb(j, 55) % 10 = 0 THEN '0' ELSE lpad(CAST(hb(j, 54) % 4000 + 1 AS VARCHAR), 11, '0')
                    END AS ndc,
               '10 mg Tab' AS prod_strength, NULL AS form_rx, '10' AS dose_val_rx, 'mg' AS dose_unit_rx,
               '1' AS form_val_disp, 'TAB' AS form_unit_disp, 2 AS doses_per_24_hrs, 'PO' AS route
        FROM r JOIN adm a USING (i)""")
    n_labs = int(labevents * scale)
    if n_labs:
        # A quarter are outpatient draws (no hadm_id); one in twenty is a text result; frequent items dominate.
        rows["labevents"] = copy("labevents", f"""
            WITH r AS (SELECT j, hb(j, 61) % {n_admissions} AS i,
                              50800 + CAST({_uniform(62, "j")} * {_uniform(62, "j")} * 1000 AS INTEGER) AS itemid,
                              hb(j, 63) % 20 = 0 AS text_result FROM range({n_labs}) t(j)),
            timed AS (SELECT r.*, a.s, a.hadm_id,
                             strftime(a.admittime + to_minutes(CAST(hb(j, 64) % 5000 AS BIGINT)), '%Y-%m-%d %H:%M:%S')
                                 AS charttime
                      FROM r JOIN adm a USING (i))
            SELECT j AS labevent_id, 10000000 + s AS subject_id, CASE WHEN hb(j, 65) % 4 <> 0 THEN hadm_id END
                       AS hadm_id, j // 8 AS specimen_id, itemid, NULL AS order_provider_id, charttime,
                   charttime AS storetime,
                   CASE WHEN text_result THEN 'NEG' ELSE CAST(round({_uniform(66, "j")} * 200, 1) AS VARCHAR) END
                       AS value,
                   CASE WHEN NOT text_result THEN round({_uniform(66, "j")} * 200, 1) END AS valuenum,
                   CASE WHEN NOT text_result THEN ['mg/dL', 'mEq/L', 'K/uL', '%'][1 + itemid % 4] END AS valueuom,
                   NULL AS ref_range_lower, NULL AS ref_range_upper, NULL AS flag, 'ROUTINE' AS priority,
                   NULL AS comments
            FROM timed""")
        rows["d_labitems"] = copy("d_labitems", """
            SELECT 50800 + k AS itemid, 'Generated lab ' || k AS label, ['Blood', 'Urine'][1 + k % 2] AS fluid,
                   'Chemistry' AS category FROM range(1000) t(k)""")
    con.close()
    return rows


def run_import(src: Path, out: Path, memory_limit: str, labs: bool) -> dict:
    """Run the importer in this process (called in a child so peak memory is the import's alone)."""
    from warehouse.importers import import_mimic4

    summary = import_mimic4(src, out, seed=7, labs=labs, memory_limit=memory_limit)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"summary": asdict(summary), "peak_rss_mib": round(peak_kib / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the full-scale sizes")
    parser.add_argument("--prescriptions", type=int, default=FULL["prescriptions"],
                        help="prescription rows at scale 1 (MIMIC-IV v2.2 has 15.4M)")
    parser.add_argument("--labevents", type=int, default=0,
                        help="lab result rows at scale 1, imported with labs=True (default 0: no labs)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the generated files go (default: a temp dir)")
    parser.add_argument("--memory-limit", default="2GB", help="DuckDB memory limit given to the importer")
    parser.add_argument("--keep", action="store_true",
                        help="keep the generated files for the next run with the same sizes (the MEDS output is "
                             "removed either way)")
    parser.add_argument("--child", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_import(Path(args.child[0]), Path(args.child[1]), args.memory_limit, args.labevents > 0),
                         default=str))
        return

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mimic_bench_"))
    src, out = workdir / "mimic-iv" / "hosp", workdir / "meds"
    # Generation takes about as long as the import: reuse files made with the same sizes.
    marker = workdir / "generated.json"
    # Both are replaced by this run and removed after it: in a caller's directory they must be this script's own.
    foreign = [str(path) for path in (src.parent, out) if path.exists()] if not marker.is_file() else []
    if foreign:
        sys.exit(f"--workdir {workdir} holds {' and '.join(foreign)}, not generated by this script (no {marker.name}): "
                 "the run would replace and then remove them; pass a new or empty directory, or remove them if a "
                 "killed run of this script left them")
    wanted = {"scale": args.scale, "prescriptions": args.prescriptions, "labevents": args.labevents}
    started = time.perf_counter()
    if marker.is_file() and json.loads(marker.read_text())["sizes"] == wanted:
        rows = json.loads(marker.read_text())["rows"]
    else:
        shutil.rmtree(src, ignore_errors=True)  # files of other sizes (e.g. a labevents table) must not stay
        rows = generate(src, args.scale, args.prescriptions, args.labevents)
        marker.write_text(json.dumps({"sizes": wanted, "rows": rows}))
    generate_s = time.perf_counter() - started
    input_mib = sum(p.stat().st_size for p in src.iterdir()) / 2**20

    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    started = time.perf_counter()
    child = subprocess.run([sys.executable, __file__, "--memory-limit", args.memory_limit, "--labevents",
                            str(args.labevents), "--child", str(src.parent), str(out)],
                           capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - started
    if child.returncode != 0:
        sys.exit(f"import failed:\n{child.stderr}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    summary = result["summary"]
    output_mib = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
    rows_read = sum(summary["rows_read"].values())
    record = {
        "benchmark": "mimic_import", "scale": args.scale, "rows_per_table": rows,
        "input_mib_gz": round(input_mib, 1), "output_mib": round(output_mib, 1),
        "generate_s": round(generate_s, 1), "import_wall_s": round(wall_s, 1), "import_s": summary["seconds"],
        "stage_s": summary["stage_seconds"], "rows_read": rows_read,
        "rows_per_s": round(rows_read / summary["seconds"]), "meds_events": summary["n_events"],
        "events_per_s": round(summary["n_events"] / summary["seconds"]), "peak_rss_mib": result["peak_rss_mib"],
        "duckdb_memory_limit": args.memory_limit, "cpus": os.cpu_count(),
        "load_avg_1m_before": round(load_before, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "duckdb": duckdb.__version__, "admissions": summary["n_admissions"], "encounters": summary["n_encounters"],
        "diagnoses_written": summary["n_diagnoses"], "lab_results_written": summary["n_labs"],
        "subjects": summary["n_subjects"], "shards": summary["n_shards"],
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    table = [(f"input rows ({len(rows)} tables)", f"{rows_read:,}"), ("  admissions", f"{rows['admissions']:,}"),
             ("  diagnoses_icd", f"{rows['diagnoses_icd']:,}"), ("  prescriptions", f"{rows['prescriptions']:,}"),
             *((("  labevents", f"{rows['labevents']:,}"), ("lab results written", f"{summary['n_labs']:,}"))
               if "labevents" in rows else ()),
             ("input size (gzip)", f"{input_mib:,.0f} MiB"), ("MEDS events written", f"{summary['n_events']:,}"),
             ("MEDS size", f"{output_mib:,.0f} MiB"), ("import time", f"{summary['seconds']:.1f} s"),
             *((f"  {stage}", f"{seconds:.1f} s") for stage, seconds in summary["stage_seconds"].items()),
             ("rows read / s", f"{record['rows_per_s']:,}"), ("events written / s", f"{record['events_per_s']:,}"),
             ("peak memory (RSS)", f"{result['peak_rss_mib']:,.0f} MiB"),
             ("DuckDB memory limit", args.memory_limit), ("CPUs", str(os.cpu_count())),
             ("load average before / after", f"{record['load_avg_1m_before']} / {record['load_avg_1m_after']}")]
    width = max(len(k) for k, _ in table)
    print("\n".join(f"{k:<{width}}  {v:>14}" for k, v in table))
    write_result(RESULTS / "mimic_import.json", record)
    shutil.rmtree(out, ignore_errors=True)
    if args.keep:
        return
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:  # the caller's directory may hold other files: remove only what this script wrote there
        shutil.rmtree(src.parent, ignore_errors=True)
        marker.unlink(missing_ok=True)
        if not any(workdir.iterdir()):
            workdir.rmdir()


if __name__ == "__main__":
    main()
