"""Flow `forecast-patient`: one patient end to end, for ad-hoc reruns (the Prefect UI, `dxr serve`).

Every requested system forecasts the patient's trajectories into one run, in the order given, so a
fused system finds the lists it fuses; the ranked codes then go to the flow run's log (the top 10 per
system) and to a table artifact `patient-<subject_id>` (every rank, a column per system), where the
person who asked for the rerun reads them in the Prefect UI.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger

from flows import flow_run_id
from flows.forecast import forecast_flow
from models.registry import check_system_order
from tasks.report import artifact_key, incomplete_lists, labelled_rankings, ranking_lines, ranking_table
from warehouse.store import Warehouse

# The forecasting pipeline as far as it is built: the EHR prior, Direct Forecast, and their fusion.
PATIENT_SYSTEMS = ("ehr_prior", "direct", "rrf_prior_direct")


@flow(name="forecast-patient", flow_run_name="patient-{subject_id}")
def forecast_patient_flow(data_dir: str, cohort: str, subject_id: int, systems: tuple[str, ...] = PATIENT_SYSTEMS,
                          k: int = 20, run_id: str | None = None) -> str:
    """Forecast one patient's trajectories (any split) with each system into one run; returns the run id.

    Args:
        data_dir: the warehouse's data directory (set by `dxr serve`).
        cohort: the cohort's name or id (`dxr cohort list`).
        subject_id: the patient's MEDS `subject_id`; each of the patient's trajectories in the cohort is forecast.
        systems: the systems to run, in order; a fused system (`rrf_prior_direct`) after the systems it fuses.
        k: codes per list.
        run_id: redo this run (its earlier lists are replaced); empty for a new run `patient-…`.
    """
    systems = tuple(systems)
    check_system_order(systems)
    run_id = run_id or flow_run_id("patient")
    for system in systems:
        forecast_flow(data_dir, cohort, system, split="all", k=k, run_id=run_id, subject_id=subject_id)
    wh = Warehouse(data_dir)
    rankings = labelled_rankings(wh, run_id)
    logger = get_run_logger()
    statuses = wh.read("ranking_status", run_id=run_id)
    for line in ranking_lines(rankings, statuses, systems):
        logger.info(line)
    incomplete = incomplete_lists(statuses, systems)
    note = f"; not ok: {incomplete} (the flow run's log says why)" if incomplete else ""
    create_table_artifact(table=ranking_table(rankings, systems), key=artifact_key("patient", str(subject_id)),
                          description=f"cohort {cohort}, patient {subject_id}: run {run_id}{note}")
    return run_id
