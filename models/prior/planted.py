"""A tiny cohort with planted structure, written straight into warehouse tables.

For unit tests and smoke runs when no generated dataset is at hand. Every patient carries one
chronic diagnosis at every visit (repeat signal) and, at each visit, a trigger diagnosis `T{j}`
whose planted successor `S{j}` appears at the next visit (new-onset signal), plus one noise code.
Splits are assigned round-robin (train, train, train, tuning, held_out), so small cohorts still
have every split. The target encounter is each patient's last visit. With `sex_linked`, each
patient's second visit also carries `F0` (women) or `M0` (men): a new code that only the static
`GENDER//…` row foretells.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta

import polars as pl

from warehouse.cohorts import assign_shards
from warehouse.store import Warehouse

N_CHRONIC, N_TRIGGER, N_NOISE = 4, 6, 8
SPLIT_CYCLE = ("train", "train", "train", "tuning", "held_out")


def dx(name: str) -> str:
    return f"DIAGNOSIS//ICD//10//{name}"


def planted_vocabulary(sex_linked: bool = False) -> list[str]:
    names = ([f"C{i}" for i in range(N_CHRONIC)] + [f"T{j}" for j in range(N_TRIGGER)]
             + [f"S{j}" for j in range(N_TRIGGER)] + [f"N{i}" for i in range(N_NOISE)]
             + (["F0", "M0"] if sex_linked else []))
    return sorted(dx(n) for n in names)


def planted_events(n_patients: int, seed: int, sex_linked: bool = False) -> pl.DataFrame:
    """MEDS-like events (subject_id, time, code, numeric_value, text_value, encounter_id)."""
    rng = random.Random(seed)
    rows = []
    for subject in range(1, n_patients + 1):
        birth = datetime(1940, 1, 1) + timedelta(days=rng.randrange(15000))
        sex = rng.choice("FM")
        rows.append((subject, None, "GENDER//" + sex, None))
        rows.append((subject, birth, "MEDS_BIRTH", None))
        chronic = rng.randrange(N_CHRONIC)
        time = datetime(2015, 1, 1) + timedelta(days=rng.randrange(365))
        previous_trigger = None
        for visit in range(rng.randint(3, 6)):
            encounter = subject * 100 + visit
            discharge = time + timedelta(days=3)
            rows.append((subject, time, "HOSPITAL_ADMISSION//EMERGENCY", encounter))
            codes = {dx(f"C{chronic}"), dx(f"N{rng.randrange(N_NOISE)}")}
            if previous_trigger is not None:
                codes.add(dx(f"S{previous_trigger}"))
            trigger = rng.randrange(N_TRIGGER)
            codes.add(dx(f"T{trigger}"))
            if sex_linked and visit == 1:
                codes.add(dx(f"{sex}0"))
            previous_trigger = trigger
            rows.extend((subject, discharge, code, encounter) for code in sorted(codes))
            rows.append((subject, discharge, f"PROCEDURE//ICD//10//P{trigger}", encounter))
            rows.append((subject, time + timedelta(days=1), f"MEDICATION//NAME//drug{chronic}", encounter))
            rows.append((subject, discharge, "HOSPITAL_DISCHARGE//HOME", encounter))
            time = discharge + timedelta(days=rng.randint(20, 200))
    return pl.DataFrame(rows, schema={"subject_id": pl.Int64, "time": pl.Datetime("us"), "code": pl.String,
                                      "encounter_id": pl.Int64}, orient="row").with_columns(
        pl.lit(None, pl.Float32).alias("numeric_value"), pl.lit(None, pl.String).alias("text_value"))


def write_planted_cohort(wh: Warehouse, n_patients: int = 200, seed: int = 0, cohort_id: str = "cplanted",
                         shard_size: int = 50, extra_target_codes: dict[int, str] | None = None,
                         sex_linked: bool = False) -> str:
    """Write every cohort table (forecasting and gold) for a planted cohort; returns its id.

    `extra_target_codes` maps subject → a code added to that patient's target encounter only
    (used by boundary sentinel tests: such a code must never reach training).
    """
    events = planted_events(n_patients, seed, sex_linked)
    last_encounter = (events.filter(pl.col("encounter_id").is_not_null())
                      .group_by("subject_id").agg(pl.col("encounter_id").max().alias("target_encounter_id")))
    if extra_target_codes:
        discharge = events.filter(pl.col("code") == "HOSPITAL_DISCHARGE//HOME").join(
            last_encounter, left_on=["subject_id", "encounter_id"], right_on=["subject_id", "target_encounter_id"])
        extra = discharge.join(pl.DataFrame({"subject_id": list(extra_target_codes),
                                             "extra": list(extra_target_codes.values())}), on="subject_id")
        events = pl.concat([events, extra.select("subject_id", "time", pl.col("extra").alias("code"), "encounter_id",
                                                 "numeric_value", "text_value")])
    splits = pl.DataFrame({"subject_id": range(1, n_patients + 1),
                           "split": [SPLIT_CYCLE[i % len(SPLIT_CYCLE)] for i in range(n_patients)]},
                          schema={"subject_id": pl.Int64, "split": pl.String})
    starts = (events.filter(pl.col("code").str.starts_with("HOSPITAL_ADMISSION//"))
              .select("encounter_id", pl.col("time").alias("cutoff_time")))
    trajectories = (last_encounter.join(starts, left_on="target_encounter_id", right_on="encounter_id")
                    .join(splits, on="subject_id").sort("subject_id")
                    .with_columns(pl.lit(cohort_id).alias("cohort_id"),
                                  pl.format("{}:{}:{}", pl.lit(cohort_id), "subject_id", "target_encounter_id")
                                  .alias("trajectory_id"),
                                  (pl.col("target_encounter_id") % 100).cast(pl.Int32).alias("n_prior_encounters"),
                                  pl.lit(False).alias("birth_time_imputed")))
    trajectories = assign_shards(trajectories, shard_size)
    joined = events.join(trajectories.select("subject_id", "trajectory_id", "target_encounter_id", "cutoff_time",
                                             "shard"), on="subject_id")
    pretarget = joined.filter((pl.col("time").is_null() | (pl.col("time") < pl.col("cutoff_time")))
                              & (pl.col("encounter_id").is_null()
                                 | (pl.col("encounter_id") != pl.col("target_encounter_id"))))
    omega = sorted(set(planted_vocabulary(sex_linked)) | set((extra_target_codes or {}).values()))
    wh.write("cohort_vocabulary", pl.DataFrame({"cohort_id": cohort_id, "code": omega, "icd_version": 10,
                                                "title": omega}), cohort_id=cohort_id)
    wh.write("trajectories", trajectories, cohort_id=cohort_id)
    for shard in sorted(trajectories["shard"].unique()):
        wh.write("pretarget_events", pretarget.filter(pl.col("shard") == shard).with_columns(
            pl.lit(cohort_id).alias("cohort_id")), cohort_id=cohort_id, shard=shard)
    train = events.join(splits.filter(pl.col("split") == "train"), on="subject_id", how="semi")
    wh.write("train_events", train.with_columns(pl.lit(cohort_id).alias("cohort_id")), cohort_id=cohort_id)
    targets = (joined.filter((pl.col("encounter_id") == pl.col("target_encounter_id"))
                             & pl.col("code").str.starts_with("DIAGNOSIS//"))
               .select(pl.lit(cohort_id).alias("cohort_id"), "trajectory_id", "code").unique()
               .sort("trajectory_id", "code"))
    wh.write("targets", targets, cohort_id=cohort_id)
    wh.write("cohorts", pl.DataFrame([{
        "cohort_id": cohort_id, "dataset_id": "planted", "name": cohort_id, "target_rule": "final",
        "harmonization": "native", "min_history": 1, "created_at": datetime(2026, 1, 1),
        "n_trajectories": trajectories.height, "vocabulary_size": len(omega), "vocabulary_source": "planted",
        "options_json": "{}", "dataset_fingerprint": None,
        "cut_rule_version": None}]), cohort_id=cohort_id)
    return cohort_id
