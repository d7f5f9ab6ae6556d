"""Flow `forecast-patient`: one patient end to end, for ad-hoc reruns (the Prefect UI, `dxr serve`).

Every requested system forecasts the patient's trajectories into one run, in the order given, so a
fused system finds the lists it fuses; the ranked codes then go to the flow run's log, where the
person who asked for the rerun reads them.
"""

from __future__ import annotations

import polars as pl
from prefect import flow
from prefect.logging import get_run_logger

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
    logger = get_run_logger()
    for line in ranking_lines(Warehouse(data_dir), run_id, systems):
        logger.info(line)
    return run_id


def ranking_lines(wh: Warehouse, run_id: str, systems: tuple[str, ...], codes: int = LOGGED_CODES) -> list[str]:
    """One line per (trajectory, system), systems in the order given: the top codes with their titles."""
    titles = wh.read("icd_codes").select("code", "dotted", "title")
    rankings = wh.read("rankings", run_id=run_id).join(titles, on="code", how="left").sort("rank")
    lines = []
    for trajectory_id in sorted(rankings["trajectory_id"].unique().to_list()):
        for system in systems:
            top = rankings.filter((pl.col("trajectory_id") == trajectory_id) & (pl.col("system") == system))
            shown = [code if dotted is None else f"{dotted} {title}"
                     for code, dotted, title in top.head(codes).select("code", "dotted", "title").iter_rows()]
            lines.append(f"{trajectory_id} {system}: {'; '.join(shown)}")
    return lines
