"""Benchmark companion: where the learned priors lose against the oracles, on a run `benchmarks/prior.py` wrote.

Reads one forecast run (by default the newest `bench-prior-…` run of the evaluated split) with the oracles of its
synthetic cohort, through the same loader as `dxr evaluate` (`tasks.evaluate.load_run`), and splits every target
code of the run's trajectories into three kinds by the trajectory's pre-target diagnoses:

- `repeated`: the code itself is among them (the `repeated` subset of the metrics);
- `sibling`: a new code whose ICD category (its version and category, as `--harmonize category` cuts it) is among
  them, e.g. a new stage of a coded kidney disease, another BMI class, a specified form of a coded condition;
- `new_category`: neither.

Per system it prints the share of each kind's target codes in its top K (pooled over trajectories, so not the
patient-averaged recall of the metrics table), how many of its K places go to codes of the pre-target record and
how often those places and the others hit. Then the ICD categories of new-onset targets where the oracle's
top K gains most over ehr_prior's. JSON to benchmarks/results/prior-gap[-<name>].json.

    python benchmarks/prior_gap.py --data-dir /tmp/prior_bench/wh5k [--run bench-prior-…] [--k 20] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from benchmarks.provenance import write_result  # noqa: E402
import polars as pl  # noqa: E402

from tasks.evaluate import load_run  # noqa: E402
from warehouse.store import Warehouse  # noqa: E402
from warehouse.vocab import category, parse_meds_code  # noqa: E402

KINDS = ("repeated", "sibling", "new_category")


def icd_category(code: str) -> str:
    """A diagnosis code's ICD category with its version, as the cohort's `category` harmonization cuts it.

    >>> [icd_category(c) for c in ("DIAGNOSIS//ICD//10//N184", "DIAGNOSIS//ICD//9//E8497")]
    ['10:N18', '9:E849']
    """
    _, version, raw = parse_meds_code(code)
    return f"{version}:{category(version, raw)}"


CATEGORY = pl.col("code").map_elements(icd_category, return_dtype=pl.String)


def newest_benchmark_run(wh: Warehouse) -> str:
    """The newest run `benchmarks/prior.py` scored (it writes rankings without a `runs` row)."""
    con = wh.connect()
    runs = [r for (r,) in con.sql("SELECT DISTINCT run_id FROM rankings WHERE run_id LIKE 'bench-prior-%' "
                                  "AND run_id NOT LIKE '%-all' ORDER BY run_id").fetchall()]
    con.close()
    if not runs:
        raise SystemExit(f"{wh.root}: no bench-prior-… rankings; run benchmarks/prior.py first or pass --run")
    return runs[-1]


def pretarget_diagnoses(wh: Warehouse, cohort_id: str, trajectory_ids: list[str]) -> pl.DataFrame:
    """(trajectory_id, code): the distinct diagnosis codes of each trajectory's pre-target record."""
    con = wh.connect()
    con.register("wanted", pl.DataFrame({"trajectory_id": trajectory_ids}).to_arrow())
    history = pl.from_arrow(con.sql(
        "SELECT DISTINCT p.trajectory_id, p.code FROM pretarget_events p JOIN wanted USING (trajectory_id) "
        "WHERE p.cohort_id = ? AND p.code LIKE 'DIAGNOSIS//%'", params=[cohort_id]).to_arrow_table())
    con.close()
    return history


def target_kinds(targets: pl.DataFrame, history: pl.DataFrame) -> pl.DataFrame:
    """(trajectory_id, code) of every target → the same with `category` and `kind`, given the pre-target
    diagnoses.

    >>> history = pl.DataFrame({"trajectory_id": ["t"], "code": ["DIAGNOSIS//ICD//10//N183"]})
    >>> targets = pl.DataFrame({"trajectory_id": ["t"] * 3, "code": [
    ...     "DIAGNOSIS//ICD//10//N183", "DIAGNOSIS//ICD//10//N184", "DIAGNOSIS//ICD//9//5853"]})
    >>> target_kinds(targets, history)["kind"].to_list()
    ['repeated', 'sibling', 'new_category']
    """
    seen_codes = history.with_columns(pl.lit(True).alias("seen_code"))
    seen_categories = (history.select("trajectory_id", CATEGORY.alias("category")).unique()
                       .with_columns(pl.lit(True).alias("seen_category")))
    return (targets.with_columns(CATEGORY.alias("category"))
            .join(seen_codes, on=["trajectory_id", "code"], how="left", maintain_order="left")
            .join(seen_categories, on=["trajectory_id", "category"], how="left", maintain_order="left")
            .with_columns(pl.when(pl.col("seen_code")).then(pl.lit("repeated"))
                          .when(pl.col("seen_category")).then(pl.lit("sibling"))
                          .otherwise(pl.lit("new_category")).alias("kind"))
            .select("trajectory_id", "code", "category", "kind"))


def gap_summary(wh: Warehouse, run_id: str, k: int = 20, top: int = 25) -> dict:
    """Per system the share of each kind's target codes in its top k, the places it gives to codes of the
    record and their hit rates; the `top` ICD categories of new-onset targets by the oracle's gain over
    ehr_prior (by count of targets when either is absent)."""
    run = load_run(wh, run_id, ks=(k,))
    history = pretarget_diagnoses(wh, run.cohort_id, run.trajectory_ids)
    targets = target_kinds(run.labelled.filter(pl.col("subset") == "all").select("trajectory_id", "code"), history)
    top_k = run.rankings.filter(pl.col("position") <= k).select("system", "trajectory_id", "code")
    kinds = dict(targets.group_by("kind").len().iter_rows())
    hits = dict(((system, kind), n) for system, kind, n in
                top_k.join(targets, on=["trajectory_id", "code"]).group_by("system", "kind").len().iter_rows())
    places = (top_k.join(history.with_columns(pl.lit(True).alias("in_record")), on=["trajectory_id", "code"],
                         how="left")
              .join(targets.select("trajectory_id", "code", pl.lit(True).alias("hit")), on=["trajectory_id", "code"],
                    how="left")
              .with_columns(pl.col("in_record", "hit").fill_null(False))
              .group_by("system").agg(
                  (pl.col("in_record").sum() / len(run.trajectory_ids)).alias("record_places"),
                  pl.col("hit").filter(pl.col("in_record")).mean().alias("record_place_hits"),
                  pl.col("hit").filter(~pl.col("in_record")).mean().alias("other_place_hits")))
    oracles = [s for s in ("oracle", "record_oracle") if s in run.systems]
    systems = []
    for system in oracles + sorted(set(run.systems) - set(oracles)):
        row = {"system": system, **{kind: hits.get((system, kind), 0) / kinds[kind] if kinds.get(kind) else None
                                    for kind in KINDS}}
        spent = places.filter(pl.col("system") == system).drop("system")
        # A system with no ranked code at all (every trajectory failed) spends no place.
        row.update(spent.row(0, named=True) if spent.height else dict.fromkeys(spent.columns))
        systems.append(row)

    shown = [s for s in ("ehr_prior", "gru", "record_oracle", "oracle") if s in run.systems]
    new_onset = targets.filter(pl.col("kind") != "repeated")
    found = (top_k.filter(pl.col("system").is_in(shown)).join(new_onset, on=["trajectory_id", "code"])
             .group_by("category", "system").len())
    by_category = new_onset.group_by("category").len("targets").with_columns(
        pl.col("targets").cast(pl.Int64), *(pl.lit(0, pl.Int64).alias(s) for s in shown))
    for system in shown:  # counts as signed ints: the gain below may be negative
        counts = found.filter(pl.col("system") == system).select("category", pl.col("len").cast(pl.Int64).alias("n"))
        by_category = (by_category.join(counts, on="category", how="left")
                       .with_columns(pl.col("n").fill_null(0).alias(system)).drop("n"))
    if "oracle" in shown and "ehr_prior" in shown:
        by_category = (by_category.with_columns((pl.col("oracle") - pl.col("ehr_prior")).alias("oracle_gain"))
                       .sort("oracle_gain", "category", descending=[True, False]))
    else:
        by_category = by_category.sort("targets", "category", descending=[True, False])
    return {"run_id": run_id, "cohort_id": run.cohort_id, "trajectories": len(run.trajectory_ids), "k": k,
            "targets": {kind: kinds.get(kind, 0) for kind in KINDS}, "systems": systems,
            "categories": by_category.head(top).to_dicts()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--run", default=None, help="forecast run id (default: the newest bench-prior run)")
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--top", type=int, default=25, help="ICD categories to list")
    parser.add_argument("--name", default=None, help="results file suffix")
    args = parser.parse_args()

    wh = Warehouse(args.data_dir)
    gap = gap_summary(wh, args.run or newest_benchmark_run(wh), args.k, args.top)

    def share(v, digits: int = 3) -> str:
        return "—" if v is None else f"{v:.{digits}f}"

    print(f"run {gap['run_id']}, cohort {gap['cohort_id']}: {gap['trajectories']} trajectories, K = {gap['k']}")
    print(" | ".join(["target codes"] + [f"{kind} {gap['targets'][kind]}" for kind in KINDS]))
    print("\nsystem | " + " | ".join(f"{kind} hit share" for kind in KINDS)
          + " | record places | their hit rate | other places' hit rate")
    for row in gap["systems"]:
        print(" | ".join([row["system"]] + [share(row[kind]) for kind in KINDS]
                         + [share(row["record_places"], 1), share(row["record_place_hits"]),
                            share(row["other_place_hits"])]))
    print(f"\nnew-onset target codes by ICD category: hits in each top {gap['k']}")
    if gap["categories"]:
        print(" | ".join(gap["categories"][0]))
    for row in gap["categories"]:
        print(" | ".join(str(v) for v in row.values()))

    write_result(RESULTS / f"prior-gap{'-' + args.name if args.name else ''}.json", gap, indent=1)


if __name__ == "__main__":
    main()
