"""Ad-hoc patient reruns and scheduled cohort backfills: the flows, their configuration, and `dxr serve`
executing a run that was requested through the Prefect API (what the UI's "Run" button does)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from dxr.cli import main
from dxr.config import load_settings
from dxr.errors import ConfigError, InputError
from flows.backfill import cohort_backfill_flow
from flows.forecast import forecast_flow
from flows.patient import forecast_patient_flow
from models.registry import check_system_order
from tasks.forecast import check_rerun, fitted_forecaster, forecast_config
from tasks.report import incomplete_lists, labelled_rankings, ranking_lines, report_path
from tests.conftest import THIRD_PARTY_NOISE, flow_run_names
from tests.sentinel import assert_no_leak, forecast_store_texts
from warehouse.cohorts import CohortOptions, build_cohort
from warehouse.datasets import ingest_meds


@pytest.fixture
def tiny_cohort_id(wh_vocab, tiny_meds):
    ingest_meds(wh_vocab, tiny_meds, "tiny")
    fitted_forecaster.cache_clear()  # fitted per (warehouse, cohort): earlier tests' warehouses are gone
    return build_cohort(wh_vocab, "tiny", "default", CohortOptions(target="every"), seed=7)["cohort_id"]


def test_patient_flow_forecasts_only_that_patient_and_no_target_event_reaches_it(planted_cohort):
    wh, cohort_id, sentinels = planted_cohort
    fitted_forecaster.cache_clear()
    trajectories = wh.read("trajectories", cohort_id=cohort_id)
    subject = trajectories.filter(pl.col("split") != "train")["subject_id"][0]  # a patient with a planted target
    run_id = forecast_patient_flow(str(wh.root), "default", subject, systems=("global_frequency", "repeat_history"))

    rankings = wh.read("rankings", run_id=run_id)
    assert set(rankings["trajectory_id"]) == set(trajectories.filter(pl.col("subject_id") == subject)["trajectory_id"])
    statuses = wh.read("ranking_status", run_id=run_id)
    assert sorted(statuses["system"]) == ["global_frequency", "repeat_history"]  # one trajectory, two systems
    assert set(rankings["system"]) == {"global_frequency", "repeat_history"}
    configs = [json.loads(c) for c in wh.read("runs", run_id=run_id)["config_json"]]
    assert {(c["system"], c["split"], c["subject_id"]) for c in configs} == {
        ("global_frequency", "all", subject), ("repeat_history", "all", subject)}
    assert_no_leak(sentinels, forecast_store_texts(wh.forecast_dir))

    lines = ranking_lines(labelled_rankings(wh, run_id), statuses, ("repeat_history", "global_frequency"))
    [trajectory_id] = statuses["trajectory_id"].unique()
    # The tiny cohort's lists are short of 20 codes; the log says so.
    assert [line.split("): ", 1)[0] for line in lines] == [f"{trajectory_id} repeat_history (short: 5 of 20 codes",
                                                           f"{trajectory_id} global_frequency (short: 3 of 20 codes"]
    first = rankings.filter((pl.col("system") == "repeat_history") & (pl.col("rank") == 1))["code"][0]
    dotted, title = wh.read("icd_codes").filter(pl.col("code") == first).select("dotted", "title").row(0)
    assert lines[0].split("): ", 1)[1].startswith(f"{dotted} {title}; ")

    [artifact] = artifacts(f"patient-{subject}")
    # The table cannot show a list that is not whole; the description names them.
    assert artifact.description == (f"cohort default, patient {subject}: run {run_id}; not ok: global_frequency 1 "
                                    "short; repeat_history 1 short (the flow run's log says why)")
    table = json.loads(artifact.data)
    assert [list(row) for row in table[:1]] == [["trajectory_id", "rank", "global_frequency", "repeat_history"]]
    assert table[0]["repeat_history"] == f"{dotted} {title}" and table[0]["rank"] == 1
    assert len(table) == rankings.group_by("system").len()["len"].max()


def test_a_patient_rerun_logs_why_a_system_gave_no_or_too_few_codes():
    # A failed Direct Forecast has no rankings rows; its log line read `t1 direct: ` with no reason.
    rankings = pl.DataFrame({"trajectory_id": ["t1", "t1", "t1"], "system": ["ehr_prior", "ehr_prior", "rrf"],
                             "shown": ["I10 Essential (primary) hypertension", "E03.9 Hypothyroidism", "I10 x"]})
    statuses = pl.DataFrame({"trajectory_id": ["t1", "t1", "t1", "t2", "t2", "t2"],
                             "system": ["ehr_prior", "direct", "rrf", "ehr_prior", "direct", "rrf"],
                             "status": ["ok", "failed", "short", "failed", "failed", "failed"],
                             "detail": [None, "direct reply stayed invalid after 3 attempts", "1 of 20 codes",
                                        None, "timed out", None]})
    assert ranking_lines(rankings, statuses, ("ehr_prior", "direct", "rrf")) == [
        "t1 ehr_prior: I10 Essential (primary) hypertension; E03.9 Hypothyroidism",
        "t1 direct (failed: direct reply stayed invalid after 3 attempts): ",
        "t1 rrf (short: 1 of 20 codes): I10 x",
        "t2 ehr_prior (failed): ",
        "t2 direct (failed: timed out): ",
        "t2 rrf (failed): "]
    assert incomplete_lists(statuses, ("ehr_prior", "direct", "rrf")) == (
        "ehr_prior 1 failed; direct 2 failed; rrf 1 short, 1 failed")
    assert incomplete_lists(statuses.filter(pl.col("system") == "ehr_prior").head(1), ("ehr_prior",)) == ""


def test_a_stray_patient_or_a_bad_k_or_limit_is_refused_before_a_run_is_registered(wh_vocab, tiny_cohort_id):
    trajectories = wh_vocab.read("trajectories", cohort_id=tiny_cohort_id)
    train_subject = trajectories.filter(pl.col("split") == "train")["subject_id"][0]
    with pytest.raises(InputError, match=rf"patient {train_subject} has no trajectory in cohort "
                                         rf"{tiny_cohort_id} in split held_out \(split all covers every split\)"):
        forecast_flow(str(wh_vocab.root), "default", "repeat_history", split="held_out", subject_id=train_subject,
                      run_id="r-split")
    with pytest.raises(InputError, match="patient 999999 has no trajectory"):
        forecast_flow(str(wh_vocab.root), "default", "repeat_history", split="all", subject_id=999999, run_id="r-none")
    result = CliRunner().invoke(main, ["--data-dir", str(wh_vocab.root), "forecast", "--cohort", "default", "--system",
                                       "repeat_history", "--subject-id", str(train_subject), "--run-id", "r-cli"])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f"Error: patient {train_subject} has no trajectory in cohort {tiny_cohort_id} in split held_out (split all "
        "covers every split): check the subject id against the cohort's trajectories table"]
    # Parameters typed into the Prefect UI reach the flow without the CLI's checks.
    with pytest.raises(InputError, match="k must be at least 1, got 0"):
        forecast_flow(str(wh_vocab.root), "default", "repeat_history", split="all", k=0, run_id="r-k")
    with pytest.raises(InputError, match="limit must be at least 1 .* got -2"):
        forecast_flow(str(wh_vocab.root), "default", "repeat_history", split="all", limit=-2, run_id="r-limit")
    assert wh_vocab.read("runs").filter(
        pl.col("run_id").is_in(["r-split", "r-none", "r-cli", "r-k", "r-limit"])).is_empty()


def test_a_run_of_one_patient_cannot_be_redone_as_a_cohort_run(wh_vocab, tiny_cohort_id):
    subject = wh_vocab.read("trajectories", cohort_id=tiny_cohort_id)["subject_id"][0]
    forecast_flow(str(wh_vocab.root), "default", "repeat_history", split="all", subject_id=subject, run_id="r1")
    check_rerun(wh_vocab, "r1", forecast_config(tiny_cohort_id, "repeat_history", "all", 20, None, subject))
    with pytest.raises(InputError, match=f"other options \\(subject_id {subject} -> None\\)"):
        check_rerun(wh_vocab, "r1", forecast_config(tiny_cohort_id, "repeat_history", "all", 20, None))


@pytest.mark.parametrize(("systems", "message"), [
    ((), "no system given"),
    (("repeat_history", "nosuch"), "unknown system 'nosuch'"),
    (("ehr_prior", "rrf_prior_direct", "direct"), "rrf_prior_direct fuses the lists of ehr_prior, direct: put "
                                                  "direct before it in systems"),
    # A second forecast of a system redoes the first; after a fused system it would delete the fused lists.
    (("ehr_prior", "direct", "rrf_prior_direct", "ehr_prior"), "ehr_prior is listed twice in systems: list each "
                                                               "system once"),
])
def test_system_order_is_checked(systems, message):
    with pytest.raises(InputError, match=message):
        check_system_order(systems)


def test_backfill_flow_forecasts_every_system_into_one_new_run_and_evaluates_it(wh_vocab, tiny_cohort_id):
    # Two backfills of one cohort, as two `[[backfills]]` tables with other systems would fire them.
    first = cohort_backfill_flow(str(wh_vocab.root), "default", systems=("global_frequency", "repeat_history"),
                                 split="all", name="nightly")
    second = cohort_backfill_flow(str(wh_vocab.root), "default", systems=("repeat_history",), split="all",
                                  name="nightly_history")
    assert first != second and first.startswith("backfill-")
    runs = wh_vocab.read("runs").filter(pl.col("run_id") == first)
    assert sorted(runs["kind"]) == ["evaluate", "forecast:global_frequency", "forecast:repeat_history"]
    metrics = wh_vocab.read("metrics", run_id=first)
    assert {"global_frequency", "repeat_history"} <= set(metrics["system"])
    n_trajectories = wh_vocab.read("trajectories", cohort_id=tiny_cohort_id).height
    assert set(metrics.filter(pl.col("subset") == "all")["n"]) == {n_trajectories}
    assert report_path(wh_vocab, first).is_file() and report_path(wh_vocab, second).is_file()
    # One artifact key per backfill: keyed by the cohort, the second backfill's firing became the first one's latest.
    [nightly] = artifacts("backfill-nightly")
    [history] = artifacts("backfill-nightly-history")
    assert f"Run `{first}`" in nightly.data and "| global_frequency |" in nightly.data
    assert f"Run `{second}`" in history.data and "| global_frequency |" not in history.data
    assert not any(first in a.data or second in a.data for a in artifacts("backfill-default"))
    # The UI lists the firings by flow run name: the cohort's, not a random one (the run id ends with the
    # flow run id's last six characters).
    assert flow_run_names("cohort-backfill", (first, second)) == ["backfill-default", "backfill-default"]


def test_a_backfill_artifact_key_is_its_name_in_prefect_key_characters():
    from flows.backfill import backfill_artifact_key

    assert backfill_artifact_key("nightly", "default") == "backfill-nightly"
    assert backfill_artifact_key("nightly_icd10", "default") == "backfill-nightly-icd10"
    assert backfill_artifact_key("weekly", "default") != backfill_artifact_key("nightly", "default")
    # A flow run without a name (called directly, not from a deployment) goes under its cohort.
    assert backfill_artifact_key(None, "MIMIC IV_demo") == "backfill-mimic-iv-demo"


def test_backfills_whose_names_make_one_artifact_key_are_refused(tmp_path, monkeypatch):
    from flows.deployments import build_deployments

    backfill = '[[backfills]]\nname = "{}"\ncohort = "default"\ncron = "0 2 * * *"\n'
    write_config(tmp_path, monkeypatch, backfill.format("nightly-a") + backfill.format("nightly_a"))
    with pytest.raises(ConfigError, match="^backfills 'nightly-a' and 'nightly_a' would publish under one Prefect "
                                          "artifact key 'backfill-nightly-a' \\(underscores become dashes there\\): "
                                          "rename one$"):
        build_deployments(load_settings(data_dir=tmp_path / "wh"))


def test_a_backfill_with_lists_shorter_than_20_is_evaluated_at_its_own_k(wh_vocab, tiny_cohort_id):
    # k = 3: every list holds 3 codes and is `ok`; evaluating at the default K = 20 refused every firing.
    run_id = cohort_backfill_flow(str(wh_vocab.root), "default", systems=("repeat_history",), split="all", k=3)
    assert set(wh_vocab.read("ranking_status", run_id=run_id)["status"]) == {"ok"}
    assert set(wh_vocab.read("metrics", run_id=run_id)["k"]) == {3, 0}
    latest = artifacts("backfill-default")[0]
    assert f"Run `{run_id}`, K = 3, all codes" in latest.data and "| repeat_history |" in latest.data


@pytest.mark.parametrize("flow_name", ["forecast", "backfill", "patient"])
def test_a_retried_flow_run_resumes_its_own_run(wh_vocab, tiny_cohort_id, monkeypatch, flow_name):
    import flows.backfill
    import flows.patient
    import tasks.forecast

    # The first attempt fails (a full disk, a lost API) after it has started its run: Prefect retries the
    # same flow run, as the UI's Retry button or a flow's `retries` does.
    module, step = {"forecast": (tasks.forecast, "shard_inputs"), "backfill": (flows.backfill, "render_report_task"),
                    "patient": (flows.patient, "create_table_artifact")}[flow_name]
    real_step, attempts = getattr(module, step), []

    def fails_the_first_time(*args, **kwargs):
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("no space left on device")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(module, step, fails_the_first_time)
    systems = ("global_frequency", "repeat_history")
    subject = wh_vocab.read("trajectories", cohort_id=tiny_cohort_id)["subject_id"][0]
    flow, arguments = {"forecast": (forecast_flow, {"system": "repeat_history", "split": "all"}),
                       "backfill": (cohort_backfill_flow, {"systems": systems, "split": "all"}),
                       "patient": (forecast_patient_flow, {"subject_id": subject, "systems": systems})}[flow_name]
    run_id = flow.with_options(retries=1, retry_delay_seconds=0)(str(wh_vocab.root), "default", **arguments)

    assert len(attempts) >= 2
    runs = wh_vocab.read("runs").filter(pl.col("run_id").str.starts_with(f"{flow_name}-"))
    assert runs["run_id"].unique().to_list() == [run_id]  # no second run beside the first attempt's
    assert set(runs["status"]) == {"finished"}


def artifacts(key: str) -> list:
    """The Prefect artifacts of a key, newest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                     sort=ArtifactSort.CREATED_DESC)


def write_config(tmp_path: Path, monkeypatch, text: str) -> Path:
    path = tmp_path / "dxr.toml"
    path.write_text(text)
    monkeypatch.setenv("DXR_CONFIG", str(path))
    return path


BACKFILL = '[[backfills]]\nname = "nightly"\ncohort = "default"\ncron = "{cron}"\ntimezone = "{tz}"\n'


@pytest.mark.parametrize(("cron", "tz", "message"), [
    ("0 25 * * *", "UTC", "invalid setting 'backfills.0.cron' .*Invalid cron string: \"0 25 \\* \\* \\*\""),
    ("0 2 * * *", "Mars/Base", "invalid setting 'backfills.0.timezone' .*Invalid timezone: \"Mars/Base\""),
])
def test_a_bad_backfill_schedule_is_a_config_error_naming_the_key(tmp_path, monkeypatch, cron, tz, message):
    write_config(tmp_path, monkeypatch, BACKFILL.format(cron=cron, tz=tz))
    with pytest.raises(ConfigError, match=message):
        load_settings()


@pytest.mark.parametrize(("systems", "message"), [
    ('["repeat_history", "repeat_histry"]',
     "unknown system 'repeat_histry'; available: dense_prior, direct, ehr_prior, global_frequency, gru, "
     "repeat_history, rrf_prior_direct, transition"),
    ('["rrf_prior_direct", "ehr_prior", "direct"]', "rrf_prior_direct fuses the lists of ehr_prior, direct: put "
                                                    "ehr_prior, direct before it in systems"),
])
def test_the_systems_of_a_backfill_are_checked_with_the_settings(tmp_path, monkeypatch, systems, message):
    # `dxr config show` printed a backfill whose systems `dxr serve` then refused at its start; both now refuse the
    # configuration with one line, and serve before it needs a Prefect server.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    path = write_config(tmp_path, monkeypatch,
                        BACKFILL.format(cron="0 2 * * *", tz="UTC") + f"systems = {systems}\n")
    line = (f"Error: invalid setting 'backfills.0.systems' (from {path}): {message} (got "
            f"{json.loads(systems)!r}); `dxr config show` lists the valid keys and defaults")
    with temporary_settings(updates={PREFECT_API_URL: None}):
        for command in (["config", "show"], ["serve"]):
            result = CliRunner().invoke(main, ["--data-dir", str(tmp_path), *command])
            assert (result.exit_code, result.output.splitlines()) == (1, [line]), command


def test_checking_the_systems_of_a_backfill_imports_no_stage(tmp_path, monkeypatch):
    # Every command loads the settings: a backfill's systems checked through the forecast stage cost each command of a
    # scheduled deployment's users (`dxr sql` included) a second of importing the stages and scipy.
    write_config(tmp_path, monkeypatch, BACKFILL.format(cron="0 2 * * *", tz="UTC") + 'systems = ["repeat_history"]\n')
    probe = ("import sys; from dxr.config import load_settings; print(load_settings().backfills[0].systems, "
             "sorted(name for name in sys.modules if name.split('.')[0] in ('tasks', 'flows', 'scipy')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parents[1])
    assert result.stdout.split("\n")[0] == "['repeat_history'] []", result.stdout + result.stderr


def test_backfill_names_are_unique(tmp_path, monkeypatch):
    write_config(tmp_path, monkeypatch, BACKFILL.format(cron="0 2 * * *", tz="UTC") * 2)
    with pytest.raises(ConfigError, match="backfill names must be unique; repeated: nightly"):
        load_settings()


def test_deployments_are_the_patient_rerun_prior_training_and_one_per_backfill(tmp_path, monkeypatch):
    from prefect.utilities.callables import parameter_schema

    from flows.deployments import build_deployments
    from flows.train_prior import train_prior_flow

    write_config(tmp_path, monkeypatch, BACKFILL.format(cron="30 2 * * 1-5", tz="Europe/Berlin")
                 + 'systems = ["ehr_prior", "direct", "rrf_prior_direct"]\nlimit = 100\n')
    settings = load_settings(data_dir=tmp_path / "wh")
    patient, training, nightly = build_deployments(settings)
    assert (patient.flow_name, patient.name, patient.schedules) == ("forecast-patient", "adhoc", [])
    assert patient.entrypoint == "flows.patient.forecast_patient_flow"
    assert patient.parameters == {"data_dir": str(tmp_path / "wh")}
    assert (training.flow_name, training.name, training.schedules) == ("train_prior", "adhoc", [])
    assert training.entrypoint == "flows.train_prior.train_prior_flow"
    # The configured prior settings are the run form's defaults; cohort (required) and systems are chosen per run.
    assert training.parameters == {"data_dir": str(tmp_path / "wh"), "cfg": settings.prior.model_dump()}
    form = parameter_schema(train_prior_flow)  # what the UI's run form is built from
    assert form.required == ["data_dir", "cohort"] and "PriorConfig" in form.definitions
    assert (nightly.flow_name, nightly.name, nightly.entrypoint) == ("cohort-backfill", "nightly",
                                                                    "flows.backfill.cohort_backfill_flow")
    assert [(s.schedule.cron, s.schedule.timezone) for s in nightly.schedules] == [("30 2 * * 1-5", "Europe/Berlin")]
    assert nightly.parameters == {"data_dir": str(tmp_path / "wh"), "cohort": "default", "split": "held_out", "k": 20,
                                  "systems": ["ehr_prior", "direct", "rrf_prior_direct"], "limit": 100,
                                  "name": "nightly", "refresh": False}
    assert nightly.description.startswith("Forecast held_out of cohort default with ehr_prior, direct, ")


def test_a_refreshing_backfill_deployment_says_so_and_passes_refresh(tmp_path, monkeypatch):
    from flows.deployments import build_deployments

    write_config(tmp_path, monkeypatch, BACKFILL.format(cron="0 2 * * *", tz="UTC") + "refresh = true\n")
    nightly = build_deployments(load_settings(data_dir=tmp_path / "wh"))[-1]
    assert nightly.parameters["refresh"] is True
    assert nightly.description == (
        "First build the cohort again if its dataset was registered again since it was built, older rules cut it or "
        "a build of it was cut short, and train its learned systems that have no model for it. Forecast held_out of cohort default with global_frequency, repeat_history, "
        "ehr_prior into a new run, evaluate it and render its report.")


def test_every_parameter_of_a_deployed_flow_is_described_in_the_run_form():
    """The UI's run form shows each parameter's description, which Prefect reads from the flow's Args section."""
    from prefect.utilities.callables import parameter_schema

    from flows.backfill import cohort_backfill_flow
    from flows.patient import forecast_patient_flow
    from flows.train_prior import train_prior_flow

    for deployed in (forecast_patient_flow, cohort_backfill_flow, train_prior_flow):
        form = parameter_schema(deployed)
        undescribed = [name for name, field in form.properties.items() if not field.get("description")]
        assert undescribed == [], (deployed.name, undescribed)
    form = parameter_schema(forecast_patient_flow)
    assert form.properties["subject_id"]["description"].startswith("the patient's MEDS `subject_id`")


def test_serve_needs_a_prefect_server(tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: None}):
        result = CliRunner().invoke(main, ["--data-dir", str(tmp_path), "serve"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: dxr serve needs a Prefect server: start one with `prefect server start --host 127.0.0.1` and export "
        "PREFECT_API_URL=http://127.0.0.1:4200/api"]


def test_serve_refuses_a_data_dir_without_a_warehouse(tmp_path, monkeypatch):
    import flows.serving

    # Started in another directory (the default data dir `data` is relative), it re-pointed the deployments a
    # server already had at an empty folder, where every patient rerun and scheduled backfill then failed.
    def serves(deployments, limit):
        raise AssertionError(f"served {len(deployments)} deployments of a data dir without a warehouse")

    monkeypatch.setattr(flows.serving, "serve_until_stopped", serves)
    (tmp_path / "none.toml").write_text("")
    monkeypatch.setenv("DXR_CONFIG", str(tmp_path / "none.toml"))
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path / "elsewhere"), "serve"])
    assert result.exit_code == 1, result.output
    assert result.output.splitlines() == [
        f"Error: no warehouse at {tmp_path / 'elsewhere'}: pass the right --data-dir (or DXR_DATA_DIR), or create one "
        "with `dxr synth` or `dxr ingest`"]


def test_serve_warns_of_each_backfill_whose_cohort_is_not_built(wh_vocab, tiny_cohort_id, tmp_path, monkeypatch):
    import flows.serving

    # Served silently, such a backfill failed at every firing; the cohort may still be built later, so it is served.
    served = []
    monkeypatch.setattr(flows.serving, "serve_until_stopped",
                        lambda deployments, limit: served.extend(d.name for d in deployments))
    backfill = '[[backfills]]\nname = "{}"\ncohort = "{}"\ncron = "0 2 * * *"\n'
    write_config(tmp_path, monkeypatch, backfill.format("by-name", "default") + backfill.format("by-id", tiny_cohort_id)
                 + backfill.format("typo", "defualt") + backfill.format("later", "big"))
    result = CliRunner().invoke(main, ["--data-dir", str(wh_vocab.root), "serve"])
    assert result.exit_code == 0, result.output
    assert served == ["adhoc", "adhoc", "by-name", "by-id", "typo", "later"]
    assert result.stderr.splitlines() == [
        f"warning: backfill {name!r}: cohort {cohort!r} is not in the warehouse at {wh_vocab.root} (yet), and every "
        f"firing fails until it is: build it with `dxr cohort build --dataset DATASET --name {cohort}`"
        for name, cohort in (("typo", "defualt"), ("later", "big"))]


def test_serve_refuses_a_refreshing_backfill_of_a_cohort_given_by_id(wh_vocab, tiny_cohort_id, tmp_path, monkeypatch):
    import flows.serving

    # Served, it was refused at every firing (an id stays on the files it was built from); by name it is served.
    served = []
    monkeypatch.setattr(flows.serving, "serve_until_stopped",
                        lambda deployments, limit: served.extend(d.name for d in deployments))
    backfill = '[[backfills]]\nname = "{}"\ncohort = "{}"\ncron = "0 2 * * *"\nrefresh = {}\n'
    write_config(tmp_path, monkeypatch, backfill.format("by-name", "default", "true")
                 + backfill.format("by-id", tiny_cohort_id, "false"))
    assert CliRunner().invoke(main, ["--data-dir", str(wh_vocab.root), "serve"]).exit_code == 0
    assert served == ["adhoc", "adhoc", "by-name", "by-id"]
    write_config(tmp_path, monkeypatch, backfill.format("by-id", tiny_cohort_id, "true"))
    result = CliRunner().invoke(main, ["--data-dir", str(wh_vocab.root), "serve"])
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        f"Error: backfills 'by-id': cohort {tiny_cohort_id} is named by its id, which stays on the files it was built "
        "from, so refresh = true could never refresh it: set cohort = 'default' (its name) or refresh = false"]
    assert served == ["adhoc", "adhoc", "by-name", "by-id"]


@pytest.mark.parametrize("command", [["serve"], ["forecast", "--cohort", "default", "--system", "repeat_history"]])
def test_a_prefect_server_that_does_not_answer_is_one_line(wh_vocab, tiny_cohort_id, command):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:1/api"}):  # nothing listens on port 1
        result = CliRunner().invoke(main, ["--data-dir", str(wh_vocab.root), *command])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: no Prefect server answers at PREFECT_API_URL=http://127.0.0.1:1/api ([Errno 111] Connection refused): "
        "start it with `prefect server start --host 127.0.0.1`, or correct PREFECT_API_URL (commands other than "
        "`dxr serve` run without it)"]


def wait_for_deployment(name: str, log: Path, timeout: float = 180) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            try:
                client.read_deployment_by_name(name)
                return
            except ObjectNotFound:
                if time.monotonic() > deadline:
                    raise AssertionError(f"dxr serve registered no {name} within {timeout} s:\n{log.read_text()}")
                time.sleep(0.5)


def flow_run_log(flow_run_id, expected: str, timeout: float = 60) -> list[str]:
    """The messages a flow run logged to the API, once one contains `expected` (logs arrive in batches)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            messages = [entry.message for entry in logs]
            if any(expected in m for m in messages) or time.monotonic() > deadline:
                return messages
            time.sleep(0.5)


def test_serve_executes_a_patient_rerun_requested_through_the_prefect_api(wh_vocab, tiny_cohort_id, tmp_path):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL

    subject = wh_vocab.read("trajectories", cohort_id=tiny_cohort_id)["subject_id"][0]
    (tmp_path / "none.toml").write_text("")
    # Polled every second, not 10: a requested run starts at once.
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "DXR_CONFIG": str(tmp_path / "none.toml"),
           "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log = tmp_path / "serve.log"
    dxr = Path(sys.executable).parent / "dxr"
    with log.open("w") as out:  # a file, not a pipe: nobody reads the runner's log while the test waits
        server = subprocess.Popen([str(dxr), "--data-dir", str(wh_vocab.root), "serve"], env=env, cwd=tmp_path,
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_deployment("forecast-patient/adhoc", log)
        # Requested as the UI's Run button does; the deployment adds the parameters it fixes (data_dir).
        flow_run = run_deployment("forecast-patient/adhoc", timeout=300, poll_interval=0.5, parameters={
            "cohort": "default", "subject_id": subject, "systems": ["repeat_history"]})
        assert flow_run.state.is_completed(), (flow_run.state, log.read_text())
        rankings = wh_vocab.read("rankings").filter(pl.col("run_id").str.starts_with("patient-"))
        assert rankings["trajectory_id"].str.split(":").list.get(1).cast(pl.Int64).unique().to_list() == [subject]
        # A mistyped patient fails the run with the one-line error in its log, and no traceback.
        failed = run_deployment("forecast-patient/adhoc", timeout=300, poll_interval=0.5, parameters={
            "cohort": "default", "subject_id": 987654, "systems": ["repeat_history"]})
        assert failed.state.is_failed(), (failed.state, log.read_text())
        messages = flow_run_log(failed.id, "has no trajectory in cohort")
        assert any("InputError: patient 987654 has no trajectory in cohort" in m for m in messages), messages
        assert not any("Traceback" in m for m in messages), messages
        # Retraining from the UI: a challenger registered without moving the alias.
        trained = run_deployment("train_prior/adhoc", timeout=300, poll_interval=0.5, parameters={
            "cohort": "default", "systems": ["gru"],
            "cfg": {"epochs": 1, "d_model": 16, "n_heads": 2, "expert_hidden": 16, "promote": False}})
        assert trained.state.is_completed(), (trained.state, log.read_text())
        runs = wh_vocab.read("runs").filter(pl.col("kind") == "train:gru")
        assert runs["status"].to_list() == ["finished"]
        result = json.loads(runs["config_json"][0])["result"]
        assert (result["version"], result["alias"], result["system"]) == ("1", None, "gru")
        # Settings the run form's types allow but the model refuses: Prefect's own parameter check fails the run,
        # and its log says why in one line instead of ending in a traceback of Prefect's engine.
        refused = run_deployment("train_prior/adhoc", timeout=300, poll_interval=0.5, parameters={
            "cohort": "default", "systems": ["gru"], "cfg": {"d_model": 30, "n_heads": 4}})
        assert refused.state.is_failed(), (refused.state, log.read_text())
        messages = flow_run_log(refused.id, "must be a multiple")
        assert "Engine execution exited with unexpected exception: Flow run received invalid parameters: cfg: Value " \
               "error, d_model 30 must be a multiple of n_heads 4" in messages, messages
        assert not any("Traceback" in m for m in messages), messages
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    output = log.read_text()
    assert output.startswith("deployment forecast-patient/adhoc: ad hoc\n")
    assert "Pausing all deployments" in output
    # The served training logs dxr's epoch line, and none of what Lightning, torch and MLflow print around it.
    assert re.search(r"gru epoch 1/1: train loss \d+\.\d{4}", output), output
    for noise, pattern in THIRD_PARTY_NOISE.items():
        assert not re.search(pattern, output), f"{noise} in the output of dxr serve:\n{output}"


def child_processes(pid: int) -> set[int]:
    """The processes `pid` started and the processes they started, whatever process group or session they joined."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the command name, in parentheses, may hold spaces: the fields after it are split safely
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process ended while being read
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


# How a shell in a terminal starts a command: SIGINT and SIGHUP handled, not ignored. A test run may itself have been
# started ignoring them (`nohup` ignores SIGHUP, a script's background job SIGINT), and so would serve: it rightly goes
# on ignoring what it was started ignoring, and the test waited for a stop that never came.
FROM_A_TERMINAL = ["env", "--default-signal=INT,HUP"]


def test_ctrl_c_in_a_terminal_stops_serve_as_sigterm_does_cancelling_the_run_in_progress(wh_vocab, tiny_cohort_id,
                                                                                         tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.settings import PREFECT_API_URL

    from warehouse.locks import held

    subject = wh_vocab.read("trajectories", cohort_id=tiny_cohort_id)["subject_id"][0]
    (tmp_path / "none.toml").write_text("")
    # Polled every second, not 10: a requested run starts at once.
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "DXR_CONFIG": str(tmp_path / "none.toml"),
           "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log = tmp_path / "serve.log"
    with log.open("w") as out:  # a process group of its own, as a shell gives a command it starts in a terminal
        server = subprocess.Popen([*FROM_A_TERMINAL, sys.executable, "-m", "dxr", "--data-dir", str(wh_vocab.root),
                                   "serve"], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        with get_client(sync_client=True) as client, \
                held(wh_vocab, "run-register:patient-held", shared=False, busy="the test"):
            deadline = time.monotonic() + 180
            # Registered by this serve (an earlier test's serve registered the name with its own data dir).
            while not any(d.parameters.get("data_dir") == str(wh_vocab.root) for d in client.read_deployments()):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
            deployment = client.read_deployment_by_name("forecast-patient/adhoc")
            flow_run = client.create_flow_run_from_deployment(deployment.id, parameters={
                "cohort": "default", "subject_id": subject, "systems": ["repeat_history"], "run_id": "patient-held"})
            # The forecast waits (up to 10 s) for the run's registration lock, which this test holds.
            while not client.read_flow_runs(flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id]))):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            children = child_processes(server.pid)
            assert children, log.read_text()
            # Outside the terminal's foreground process group, which its Ctrl-C signals as a whole: only serve decides
            # when a flow run ends.
            assert all(os.getpgid(pid) != server.pid for pid in children), log.read_text()
            os.killpg(server.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its whole foreground process group
            assert server.wait(timeout=60) == 130, log.read_text()
            state = client.read_flow_run(flow_run.id).state
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    output = log.read_text()
    # Unwinding out of Prefect's event loop printed an asyncio traceback and killed the run's process outright: its
    # flow run stayed Running in the UI for good, where it can be neither retried nor rerun. The terminal's SIGINT
    # also reached the flow run's process itself, which crashed instead of being cancelled, or printed a
    # KeyboardInterrupt traceback (raised while it was still starting, or inside a finalizer, where it is ignored).
    # (The runner's SIGTERM can still land in a finalizer of that process: Prefect's handler raising there prints
    # "Exception ignored in ... TerminationSignal", and the run goes on until it ends or Prefect kills it.)
    assert state.is_cancelled(), (state, output)
    assert "KeyboardInterrupt" not in output and "interrupt signal" not in output, output
    assert "asyncio - Exception in callback" not in output and "SystemExit" not in output, output
    assert "SIGINT received" in output and "All deployments have been paused!" in output, output
    assert output.rstrip().endswith("dxr: stopped by SIGINT"), output
    deadline = time.monotonic() + 10
    while survivors := [pid for pid in children if Path(f"/proc/{pid}").exists()]:
        assert time.monotonic() < deadline, f"processes {survivors} of the flow run outlived serve"
        time.sleep(0.2)


# A stop signal while the runner registers the deployments and starts (Prefect's handler then called sys.exit(0) inside
# its event loop), and again while it stops: delivered at exactly those moments by wrapping the runner's own steps.
SIGNAL_WHILE_STARTING_AND_STOPPING = """
import faulthandler, os, signal, sys
from prefect.runner.runner import Runner
faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the test with every thread's stack
start, stop = Runner.__aenter__, Runner.astop
signum = signal.Signals[sys.argv[2]]

async def interrupted_start(self):
    os.kill(os.getpid(), signum)
    return await start(self)

async def interrupted_stop(self):
    os.kill(os.getpid(), signum)
    await stop(self)

Runner.__aenter__, Runner.astop = interrupted_start, interrupted_stop
from dxr.cli import main
main(["--data-dir", sys.argv[1], "serve"])
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP])  # Ctrl-C, a closed terminal
def test_a_stop_signal_while_serve_starts_or_stops_still_stops_it_gracefully(wh_vocab, tiny_cohort_id, tmp_path,
                                                                             signum):
    from prefect.settings import PREFECT_API_URL

    (tmp_path / "none.toml").write_text("")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "DXR_CONFIG": str(tmp_path / "none.toml")}
    result = subprocess.run([*FROM_A_TERMINAL, sys.executable, "-c", SIGNAL_WHILE_STARTING_AND_STOPPING,
                             str(wh_vocab.root), signum.name], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=150)
    output = result.stdout + result.stderr
    # It exited 0 at once, without pausing the schedules (or hung at interpreter exit); SIGHUP ended it outright.
    assert result.returncode == 128 + signum, output
    assert output.count(f"{signum.name} received") == 1 and "All deployments have been paused!" in output, output
    assert "Traceback" not in output and output.rstrip().endswith(f"dxr: stopped by {signum.name}"), output


def test_deployments_served_under_a_name_end_in_it_as_do_their_artifact_keys(tmp_path, monkeypatch):
    from flows.backfill import backfill_artifact_key
    from flows.deployments import build_deployments

    write_config(tmp_path, monkeypatch, BACKFILL.format(cron="0 2 * * *", tz="UTC"))
    settings = load_settings(data_dir=tmp_path / "wh")
    assert [f"{d.flow_name}/{d.name}" for d in build_deployments(settings)] == [
        "forecast-patient/adhoc", "train_prior/adhoc", "cohort-backfill/nightly"]
    patient, training, nightly = build_deployments(settings, "hosp_2")
    assert [f"{d.flow_name}/{d.name}" for d in (patient, training, nightly)] == [
        "forecast-patient/adhoc-hosp_2", "train_prior/adhoc-hosp_2", "cohort-backfill/nightly-hosp_2"]
    # Another data dir's backfill of the same name publishes under a key of its own.
    assert nightly.parameters["name"] == "nightly-hosp_2"
    assert backfill_artifact_key(nightly.parameters["name"], "default") == "backfill-nightly-hosp-2"
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path), "serve", "--name", "Hosp 2"])
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == (
        "Error: Invalid value for '--name': 'Hosp 2' is no name of lower-case letters, digits, '-' and '_' that starts "
        "with a letter or digit, such as hosp2 (usage: main serve -h)")


def served_deployment(client, name: str, data_dir: Path, log: Path, timeout: float = 180):
    """Deployment `name` once the serve of `data_dir` has registered it and polled it."""
    from prefect.client.schemas.objects import DeploymentStatus
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    while True:
        try:
            deployment = client.read_deployment_by_name(name)
            if deployment.parameters.get("data_dir") == str(data_dir) and deployment.status == DeploymentStatus.READY:
                return deployment
        except ObjectNotFound:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)


def test_a_second_serve_leaves_the_deployments_of_a_first_one_alone(wh_vocab, tiny_cohort_id, tmp_path, monkeypatch):
    import shutil

    import flows.serving
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    # Two serves of one Prefect server (one per data dir, or one started twice) shared the deployment names: the
    # second re-pointed the first one's deployments at its own data dir, both executed their runs, and stopping the
    # second paused the schedules the first was still serving.
    other = tmp_path / "other"
    shutil.copytree(wh_vocab.root, other)
    config = write_config(tmp_path, monkeypatch, BACKFILL.format(cron="0 2 * * *", tz="UTC"))
    # Polled every 2 s, a live serve shows itself to the second one within 7 s.
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "DXR_CONFIG": str(config),
           "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    dxr = [sys.executable, "-m", "dxr", "--data-dir"]
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with first_log.open("w") as out:
        first = subprocess.Popen([*dxr, str(wh_vocab.root), "serve"], env=env, cwd=tmp_path, stdout=out,
                                 stderr=subprocess.STDOUT)
    second, refusals = None, []
    try:
        with get_client(sync_client=True) as client:
            served_deployment(client, "cohort-backfill/nightly", wh_vocab.root, first_log)
            # The same data dir started twice, or another one: both at once, as each waits 7 s for the first's poll.
            refusals = [subprocess.Popen([*dxr, str(data_dir), "serve"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True) for data_dir in (wh_vocab.root, other)]
            for refusal in refusals:
                stdout, stderr = refusal.communicate(timeout=120)
                assert refusal.returncode == 1, stdout + stderr
                assert stderr.splitlines()[-1] == (
                    f"Error: forecast-patient/adhoc is being served by another dxr serve, of data dir {wh_vocab.root}: "
                    "stop that one first, or give this one deployment names of its own with `dxr serve --name NAME`")
            with second_log.open("w") as out:
                second = subprocess.Popen([*dxr, str(other), "serve", "--name", "other"], env=env, cwd=tmp_path,
                                          stdout=out, stderr=subprocess.STDOUT)
            served_deployment(client, "cohort-backfill/nightly-other", other, second_log)
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=60) == 0, second_log.read_text()
            assert "All deployments have been paused!" in second_log.read_text()
            assert client.read_deployment_by_name("cohort-backfill/nightly-other").paused
            # Paused, the first one's backfill would have lost its scheduled firings.
            for name in ("forecast-patient/adhoc", "train_prior/adhoc", "cohort-backfill/nightly"):
                deployment = client.read_deployment_by_name(name)
                assert (deployment.paused, deployment.parameters["data_dir"]) == (False, str(wh_vocab.root)), name
    finally:
        for serve in (first, second, *refusals):
            if serve is not None and serve.poll() is None:
                serve.send_signal(signal.SIGTERM)
                serve.wait(timeout=60)
    # Once the first has stopped, another data dir may take its names over, and is told it does.
    served = []
    monkeypatch.setattr(flows.serving, "serve_until_stopped",
                        lambda deployments, limit: served.extend(d.name for d in deployments))
    result = CliRunner().invoke(main, ["--data-dir", str(other), "serve"])
    assert result.exit_code == 0, result.output
    assert served == ["adhoc", "adhoc", "nightly"]
    assert result.stderr.splitlines() == [
        f"note: forecast-patient/adhoc, train_prior/adhoc, cohort-backfill/nightly served data dir {wh_vocab.root} "
        f"until now, and {other} from now on (serve each data dir under a name of its own, `dxr serve --name NAME`, "
        "to keep both)"]
