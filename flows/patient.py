"""Flow `forecast-patient`: one patient end to end, for ad-hoc reruns (the Prefect UI, `dxr serve`).

Every requested system forecasts the patient's trajectories into one run, in the order given, so a
fused system finds the lists it fuses; the ranked codes then go to the flow run's log (the top 10 per
system) and to a table artifact `patient-<subject_id>` (every rank, a column per system), where the
person who asked for the rerun reads them in the Prefect UI.
"""

from __future__ import annotations

import polars as pl
from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger

from flows.backfill import artifact_key
from flows.forecast import forecast_flow
from tasks.forecast import check_system_order
from warehouse.runs import new_run_id
from warehouse.store import Warehouse

# The forecasting pipeline as far as it is built: the EHR prior, Direct Forecast, and their fusion.
PATIENT_SYSTEMS = ("ehr_prior", "direct", "rrf_prior_direct")
LOGGED_CODES = 10


@flow(name="forecast-patient", flow_run_name="patient-{subject_id}")
def forecast_patient_flow(data_dir: str, cohort: str, subject_id: int, systems: tuple[str, ...] = PATIENT_SYSTEMS,
                          k: int = 20, run_id: str | None = None) -> str:
    """Forecast one patient's trajectories (any split) with each system into one run; returns the run id."""
    systems = tuple(systems)
    check_system_order(systems)
    run_id = run_id or new_run_id("patient")
    for system in systems:
        forecast_flow(data_dir, cohort, system, split="all", k=k, run_id=run_id, subject_id=subject_id)
    rankings = labelled_rankings(Warehouse(data_dir), run_id)
    logger = get_run_logger()
    for line in ranking_lines(rankings, systems):
        logger.info(line)
    create_table_artifact(table=ranking_table(rankings, systems), key=artifact_key("patient", str(subject_id)),
                          description=f"cohort {cohort}, patient {subject_id}: run {run_id}")
    return run_id


def labelled_rankings(wh: Warehouse, run_id: str) -> pl.DataFrame:
    """A run's rankings, each code shown as its dotted code and title (the MEDS code when it has none)."""
    titles = wh.read("icd_codes").select("code", "dotted", "title")
    return (wh.read("rankings", run_id=run_id).join(titles, on="code", how="left")
            .with_columns(pl.when(pl.col("dotted").is_null()).then(pl.col("code"))
                          .otherwise(pl.format("{} {}", "dotted", "title")).alias("shown"))
            .sort("trajectory_id", "rank"))


def ranking_lines(rankings: pl.DataFrame, systems: tuple[str, ...], codes: int = LOGGED_CODES) -> list[str]:
    """One line per (trajectory, system), systems in the order given: the top codes with their titles."""
    lines = []
    for trajectory_id in rankings["trajectory_id"].unique(maintain_order=True).to_list():
        for system in systems:
            top = rankings.filter((pl.col("trajectory_id") == trajectory_id) & (pl.col("system") == system))
            lines.append(f"{trajectory_id} {system}: {'; '.join(top['shown'].head(codes).to_list())}")
    return lines


def ranking_table(rankings: pl.DataFrame, systems: tuple[str, ...]) -> list[dict]:
    """One row per (trajectory, rank) with a column per system, in the order given: the Prefect artifact."""
    wide = rankings.pivot(on="system", index=["trajectory_id", "rank"], values="shown").sort("trajectory_id", "rank")
    return wide.select("trajectory_id", "rank", *[s for s in systems if s in wide.columns]).to_dicts()
