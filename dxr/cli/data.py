"""Data commands: synthetic generation, ingestion, cohorts, SQL and configuration."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click

from dxr.cli import echo_err, main, settings, valid, warehouse
from dxr.config import MEMORY_LIMIT_PATTERN
from warehouse.choices import HARMONIZATIONS, OUTPUT_FORMATS, TARGET_RULES


def check_memory_limit(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A `--memory-limit` callback: a DuckDB size such as 2GB (None when the option was left to a setting)."""
    if value is not None and not re.fullmatch(MEMORY_LIMIT_PATTERN, value):
        raise click.BadParameter(f"{value!r} is not a size such as 2GB or 512MB", ctx, param)
    return value


def echo_refresh_note(wh, dataset_id: str, seed_in_force: int) -> None:
    """After a dataset is registered: name its cohorts that were built from earlier files of it (a refreshed
    extract) and the command that builds each again from these files (`seed_in_force`: the `seed` setting)."""
    from warehouse.cohorts import (built_under_size_fingerprint, earlier_rule_clause, rebuild_command,
                                   superseded_cohorts)
    from warehouse.datasets import get_dataset

    dataset = get_dataset(wh, dataset_id)
    for cohort in superseded_cohorts(wh, dataset_id):
        named = f"cohort {cohort['name']} ({cohort['cohort_id']})"
        if built_under_size_fingerprint(wh, dataset, cohort):
            built = (f"{named} was built under dataset {dataset_id}'s fingerprint of before 2026-12-05, of sizes and "
                     f"row counts, which these files match (likely the same files){earlier_rule_clause(cohort)}; "
                     "their fingerprint is now of their contents. The cohort keeps its tables, and its runs and models "
                     "stay on its id")
        else:
            built = (f"{named} was built from earlier files of dataset {dataset_id}; it keeps them, and its runs their "
                     "scores")
        click.echo(f"note: {built}. To forecast these files, run `{rebuild_command(cohort, seed_in_force)}`: a new "
                   f"cohort id, which --cohort {cohort['name']} then names")


@main.group()
def config() -> None:
    """Show the configuration in force.

    \b
    Example:
      dxr config show
    """


@config.command("show")
@click.pass_context
def config_show(ctx: click.Context) -> None:
    """Print every setting with its value (TOML file + DXR_* environment + defaults).

    \b
    Example:
      DXR_DATA_DIR=/tmp/wh dxr config show
    """
    from dxr.config import config_path

    values = settings(ctx).model_dump(mode="json")
    path = config_path()
    click.echo(f"# config file: {path if path else '(none; ./dxr.toml or DXR_CONFIG)'}")
    click.echo(json.dumps(values, indent=2))


@main.command()
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(OUTPUT_FORMATS), default="table", show_default=True,
              help="An aligned table, CSV, or JSON lines; csv and json write the rows as they come (large exports). "
                   "Every format spells a value alike: times as SQL and DuckDB do (2026-12-05 09:25:19.5, a space "
                   "before the time, no trailing zeros), structs, lists and maps as JSON (in a table or CSV cell its "
                   "text), blobs as base64, intervals as seconds (25.5), decimals with their exact digits (JSON "
                   "numbers: DECIMAL(18,3) 1.250 as 1.250), booleans as true/false. NULL is NULL in a table, an empty "
                   "field in CSV (an empty string is \"\" there, as DuckDB writes it) and null in JSON.")
@click.option("--with-gold", is_flag=True, help="Also open the gold store (targets, raw MEDS, oracle).")
@click.option("--run", "run_id", default=None, metavar="RUN_ID", callback=valid.run_id,
              help="Show only this run's rows of the tables partitioned by run (runs, rankings, metrics, ledger, "
                   "llm_calls, ...): the query then opens that run's files only.")
@click.pass_context
def sql(ctx: click.Context, query: str, fmt: str, with_gold: bool, run_id: str | None) -> None:
    """Run read-only SQL over the warehouse views.

    \b
    Example:
      dxr sql "SELECT system, count(*) FROM rankings GROUP BY ALL" --format csv
      dxr sql --run r1 "SELECT stage, sum(tokens_in) FROM llm_calls GROUP BY ALL"
    """
    from warehouse.sql import stream_query

    for text in stream_query(warehouse(ctx, existing=True), query, fmt=fmt, with_gold=with_gold, run_id=run_id):
        click.echo(text, nl=False)


@main.command()
@click.option("--name", default="synthetic", show_default=True, callback=valid.dataset_name,
              help="Dataset name to register.")
@click.option("--patients", type=click.IntRange(min=1), default=None,
              help="Number of patients (default: setting synth.patients, 5000).")
@click.option("--seed", type=int, default=None, help="Generator seed (default: setting seed).")
@click.option("--run-id", default=None, callback=valid.run_id, help="Run id to register (generated when absent).")
@click.pass_context
def synth(ctx: click.Context, name: str, patients: int | None, seed: int | None, run_id: str | None) -> None:
    """Generate the synthetic MEDS dataset (with its exact oracle) and register it.

    \b
    Example:
      dxr synth --patients 5000 --seed 7 --name synthetic
    """
    from warehouse.datasets import create_synthetic

    cfg, wh = settings(ctx), warehouse(ctx)
    row = create_synthetic(wh, name, patients or cfg.synth.patients, cfg.seed if seed is None else seed,
                           cfg.synth.shard_size, progress=True, log=echo_err, run_id=run_id)
    click.echo(f"dataset {row['dataset_id']}: {row['n_subjects']:,} patients, {row['n_events']:,} events "
               f"({row['meds_dir']})")
    echo_refresh_note(wh, name, settings(ctx).seed)


@main.group()
def ingest() -> None:
    """Register a dataset: any MEDS directory, or the official MIMIC files.

    \b
    Example:
      dxr ingest meds /data/my_meds --name mydata
    """


@ingest.command("meds")
@click.argument("path", type=click.Path(path_type=Path), callback=valid.meds_directory)
@click.option("--name", required=True, callback=valid.dataset_name,
              help="Dataset name (lower-case letters, digits, _ and -).")
@click.option("--memory-limit", default="2GB", show_default=True, callback=check_memory_limit,
              help="DuckDB memory of the validation; beyond it DuckDB spills to the system's temporary directory.")
@click.option("--run-id", default=None, callback=valid.run_id, help="Run id to register (generated when absent).")
@click.pass_context
def ingest_meds_cmd(ctx: click.Context, path: Path, name: str, memory_limit: str, run_id: str | None) -> None:
    """Validate a MEDS directory, copy it into the gold store and register it.

    The directory needs data/**/*.parquet with the MEDS columns plus `encounter_id` (or `hadm_id`, as
    MEDS-Extract's MIMIC-IV ETL names it); diagnosis codes are DIAGNOSIS//ICD//9//... or
    DIAGNOSIS//ICD//10//... without dots, or ICD-9-CM/ICD-10-CM codes spelled as other ETLs write them
    (ICD10CM/E11.9, ICD9CM//250.00, ICD10//E119, the platform's prefix with a dot), which the copy rewrites so.

    \b
    Example:
      dxr ingest meds ./exports/meds --name hospital_a
    """
    from warehouse.datasets import ingest_meds

    wh = warehouse(ctx)
    row = ingest_meds(wh, path, name, run_id=run_id, memory_limit=memory_limit)
    click.echo(f"dataset {row['dataset_id']}: {row['n_subjects']:,} patients, {row['n_events']:,} events, "
               f"ICD versions {row['icd_versions']}")
    if row["time_zone"]:
        click.echo(f"note: times are in {row['time_zone']} (UTC offset {row['utc_offset']} throughout the data): kept "
                   "as the wall-clock times they show there, without the zone")
    for respelling in row["respelled"]:
        click.echo(f"diagnosis codes: {respelling.n_events:,} rewritten from {respelling.prefix}… to "
                   f"DIAGNOSIS//ICD//{respelling.version}//… without the dot (e.g. {respelling.example})")
    echo_ingest_notes(row)
    echo_refresh_note(wh, name, settings(ctx).seed)


def echo_ingest_notes(row: dict) -> None:
    """The notes of every ingest command (its `register_dataset` row) on what it takes although an expert would
    correct it in the export: none breaks a step, and one patient should not hold back a 300,000-patient extract.
    A MIMIC import writes none of these cases itself, but the release it reads may hold them (a placeholder date)."""
    from warehouse.meds import PLAUSIBLE_YEARS

    def counted(n: int, one: str, more: str) -> str:
        return f"{n:,} {one if n == 1 else more}"

    if row["n_diagnoses_without_encounter"]:
        click.echo(f"note: {row['n_diagnoses_without_encounter']:,} diagnosis events have no encounter_id; they stay "
                   "in patients' histories but never form or join a target encounter")
    if row["n_subjects_without_split"]:
        n = row["n_subjects_without_split"]
        are, they_are = ("are", "they are") if n > 1 else ("is", "it is")
        click.echo(f"note: {n:,} of the {row['n_subjects']:,} patients {are} not in metadata/subject_splits.parquet: "
                   f"{they_are} left out of every cohort (neither trained on nor forecast); give each a split there, "
                   "or leave the file out for the seeded hash split")
    if row["n_listed_without_events"]:
        click.echo(f"note: {counted(row['n_listed_without_events'], 'subject', 'subjects')} of "
                   f"metadata/subject_splits.parquet (e.g. subject {row['listed_without_events']}) "
                   f"{'has' if row['n_listed_without_events'] == 1 else 'have'} no event in data/: are shards "
                   "missing, or is the file another extract's?")
    if other := row["other_files"]:
        click.echo(f"note: {counted(len(other), 'file under data/ is', 'files under data/ are')} not named "
                   f"*.parquet, so no step reads {'it' if len(other) == 1 else 'them'} (e.g. {other[0]}): MEDS keeps "
                   "events in data/**/*.parquet; convert events written otherwise (a CSV) to Parquet there")
    if tools := row["bookkeeping_shards"]:
        it = "it" if len(tools) == 1 else "them"
        click.echo(f"note: {counted(len(tools), 'Parquet file under data/ is', 'Parquet files under data/ are')} "
                   f"named, or in a folder named, with a leading . or _ (e.g. {tools[0]}): Spark and pyarrow skip "
                   f"such files as a tool's own, but dxr reads {it} as events; remove {it} if a tool left {it} (a "
                   "failed write's part files repeat events)")
    if late := row["born_after_events"]:
        click.echo(f"note: {counted(row['n_born_after_events'], 'patient has', 'patients have')} a MEDS_BIRTH dated "
                   f"after their first other event (e.g. subject {late.subject_id}: born {late.birth}, first event "
                   f"{late.first_event}): taken as written, the ages at earlier events are negative for the EHR "
                   "prior, a record cut before the birth has none (the prior takes the train patients' mean age), and "
                   "Direct Forecast's record names a birth year after visits it lists; correct the birth in the export")
    if spread := row["in_several_shards"]:
        click.echo(f"note: {counted(row['n_subjects_in_several_shards'], 'patient has', 'patients have')} events in "
                   f"more than one shard (e.g. subject {spread.subject_id} in {spread.first_shard} and "
                   f"{spread.last_shard}): dxr reads the shards as one table, so their events are joined, but MEDS "
                   "keeps a subject in one shard, as other MEDS tools expect")
    if odd := row["implausible_time"]:
        first, last = PLAUSIBLE_YEARS
        click.echo(f"note: {counted(row['n_implausible_times'], 'event is', 'events are')} dated before {first} or "
                   f"in {last} or later (e.g. {odd.shard}, row {odd.row:,}: subject {odd.subject_id}, {odd.code} at "
                   f"{odd.time}): taken as dated, such an event precedes every cutoff of its patient or follows them "
                   "all (an admission so dated makes the patient's last encounter, the target of --target final); a "
                   "placeholder date? correct it in the export")


@main.group()
def cohort() -> None:
    """Build, list and delete cohorts of trajectories (patient cut before a target encounter).

    \b
    Example:
      dxr cohort build --dataset synthetic --name default
    """


@cohort.command("build")
@click.option("--dataset", required=True, callback=valid.dataset_name, help="Registered dataset name.")
@click.option("--name", required=True, callback=valid.cohort_name, help="Cohort name.")
@click.option("--target", type=click.Choice(TARGET_RULES), default=None,
              help="Target encounter: each patient's final one, or every encounter with enough history.")
@click.option("--harmonize", type=click.Choice(HARMONIZATIONS), default=None,
              help="ICD harmonization of codes and vocabulary.")
@click.option("--min-history", type=click.IntRange(min=0), default=None,
              help="Earlier encounters whose diagnoses are in a trajectory's record (begun and coded "
                   "before its cutoff) that it needs (default 1).")
@click.option("--memory-limit", default=None, callback=check_memory_limit,
              help="DuckDB memory of the build; beyond it DuckDB spills to a work directory in the gold store "
                   "(default: setting cohort.memory_limit, 2GB).")
@click.option("--run-id", default=None, callback=valid.run_id, help="Run id to register (generated when absent).")
@click.pass_context
def cohort_build(ctx: click.Context, dataset: str, name: str, target: str | None, harmonize: str | None,
                 min_history: int | None, memory_limit: str | None, run_id: str | None) -> None:
    """Build a cohort: trajectories, pre-target records, vocabulary Ω, gold targets (and the synthetic oracles).

    \b
    Example:
      dxr cohort build --dataset synthetic --name default --target final --harmonize native --min-history 1
    """
    import meds
    import polars as pl

    from warehouse.cohorts import CohortOptions, build_cohort, split_counts

    cfg, wh = settings(ctx), warehouse(ctx, existing=True)  # its dataset lives in a warehouse made by synth or ingest
    options = CohortOptions(target=target or cfg.cohort.target, harmonize=harmonize or cfg.cohort.harmonize,
                            min_history=cfg.cohort.min_history if min_history is None else min_history)
    row = build_cohort(wh, dataset, name, options, seed=cfg.seed, shard_size=cfg.cohort.shard_size,
                       oracle_draws=cfg.synth.oracle_draws, memory_limit=memory_limit or cfg.cohort.memory_limit,
                       progress=True, log=echo_err, run_id=run_id)
    splits = split_counts(wh, row["cohort_id"])
    earlier = wh.read("cohorts").filter((pl.col("name") == name) & (pl.col("cohort_id") != row["cohort_id"]))
    click.echo(f"cohort {row['name']} ({row['cohort_id']}): {row['n_trajectories']:,} trajectories "
               f"({', '.join(f'{split} {n:,}' for split, n in splits.items())}), "
               f"|Ω| = {row['vocabulary_size']:,} ({row['vocabulary_source']})")
    if row["dictionary_set_aside"]:
        # Otherwise a trimmed d_icd_diagnoses (a hospital extract's, or a test's) passes for no dictionary at all.
        click.echo(f"note: the dataset's metadata/codes.parquet (d_icd_diagnoses, for a MIMIC import) lists "
                   f"{row['dictionary_set_aside']:,} diagnosis codes, each used by the data: taken for a list made "
                   "from the data, which would put codes found only in held-out targets into Ω, not for a dictionary, "
                   f"so Ω is {row['vocabulary_source']}; to have Ω from your dictionary, ship it whole")
    if row["n_trajectories"] and not splits[meds.held_out_split]:
        # Said here, not first by a refused `dxr forecast`: a small dataset (the MIMIC-III demo) has no such patient.
        click.echo(f"note: no trajectory is in {meds.held_out_split}, the split dxr forecast takes by default: "
                   "forecast --split all (or another split) and read the scores of train patients as in-sample")
    if earlier.height:
        click.echo(f"note: --cohort {name} now names this cohort; the {earlier.height:,} earlier one(s) of the name "
                   f"({', '.join(sorted(earlier['cohort_id']))}: other options, or earlier files of a dataset) keep "
                   "their tables and runs, by their ids")
    if row["previous_name"]:
        click.echo(f"note: these options of dataset {dataset} were cohort {row['previous_name']}, which is now named "
                   f"{row['name']}: a cohort's id is its dataset, options and seed, so --cohort "
                   f"{row['previous_name']} no longer finds it (use the id or the new name)")
    built = json.loads(row["options_json"])
    if built["unmapped_diagnosis_codes"]:
        why = {"icd10": "not in the GEM, or NoDx only", "icd10_closest": "GEM NoDx only, no common ICD-10 ancestor"}
        click.echo(f"note: {built['unmapped_diagnosis_codes']:,} diagnosis codes of the data have no "
                   f"{options.harmonize} rendering ({why[options.harmonize]}): their events are "
                   f"dropped from histories and targets; most frequent first: {code_counts(row['unmapped'])}")
    if built["subjects_without_split"]:
        click.echo(f"note: {built['subjects_without_split']:,} patient(s) of the data have no split in "
                   "metadata/subject_splits.parquet: they are left out of the cohort (neither trained on nor forecast)")
    if built["diagnosis_codes_outside_vocabulary"]:
        click.echo(f"note: {built['diagnosis_codes_outside_vocabulary']:,} diagnosis codes of the data are not in Ω "
                   f"({row['vocabulary_source']}): no forecast can name them, so where they are targets every "
                   f"system misses them; most frequent first: {code_counts(row['outside_vocabulary'])}")
    if row["unknown_to_icd"]:
        # A mistyped code passes the import (it has a code's shape) and would otherwise be one more of those above.
        click.echo(f"note: {len(row['unknown_to_icd']):,} diagnosis code(s) of the data are in no ICD-9-CM or "
                   f"ICD-10-CM table: {code_counts(row['unknown_to_icd'])}; correct them in the export (a typo?), "
                   "or list a local code with its title in the dataset's dictionary (d_icd_diagnoses, codes.parquet) "
                   "to forecast it")


def code_counts(counted: list[tuple[str, int]], shown: int = 5) -> str:
    """The first `shown` of (code, events) pairs with their events, and how many more there are."""
    listed = ", ".join(f"{code} ({n:,} event{'' if n == 1 else 's'})" for code, n in counted[:shown])
    return listed + (f", and {len(counted) - shown:,} more" if len(counted) > shown else "")


@cohort.command("list")
@click.pass_context
def cohort_list(ctx: click.Context) -> None:
    """List built cohorts.

    cut_rule_version is the version of the rules that cut a cohort's trajectories, targets and pre-target
    records; one other than this dxr's is shown with the current one, "none (now <current>)" for a cohort built
    before versions were recorded. Such a cohort keeps its cuts (a forecast of it warns) until it is built again with
    dxr cohort build and its options.

    gem_rule, for an icd10 cohort, is the rule its ICD-9 codes were mapped by: every_target (each code to every
    target of its GEM rows), or "icd10_closest (earlier icd10)" for one built before 2026-12-06, when icd10
    meant that rule.

    A cohort whose build was killed or failed midway is not listed: a note on stderr names it, the build, and the
    command that builds it again (commands refuse its name until then, or until dxr cohort delete removes it). One
    whose name a later build of other options took is refused by its id only: its note names that cohort and the
    dxr cohort delete that removes the tables it left half written.

    \b
    Example:
      dxr cohort list
    """
    from warehouse.cohorts import cohort_list, unbuilt_cohorts

    wh = warehouse(ctx, existing=True)
    click.echo(cohort_list(wh), nl=False)
    for unbuilt in unbuilt_cohorts(wh):  # stdout: the table
        echo_err(f"note: {unbuilt}")


@cohort.command("delete")
@click.argument("cohort_key", metavar="COHORT", callback=valid.cohort_key)
@click.option("--with-runs", is_flag=True,
              help="Also delete the runs recorded on the cohort (forecasts, evaluations) and all they wrote: rankings, "
                   "statuses, candidates, metrics, LLM calls, the ledger, reports in the default place. Without it, a "
                   "cohort with runs is refused.")
@click.option("--dry-run", is_flag=True,
              help="Print what would be removed (rows by table, directories); change nothing.")
@click.pass_context
def cohort_delete(ctx: click.Context, cohort_key: str, with_runs: bool, dry_run: bool) -> None:
    """Delete a cohort (by id, or by a name only it has): its tables in both stores and its prediction cache.

    A cohort whose build was killed or failed midway (half built; dxr cohort list names it) goes the same way.

    Registered MLflow models of its priors stay (their names are printed, with the command that removes
    one), and so do their MLflow runs: those that killed trainings left RUNNING are ended as KILLED;
    datasets and shared caches stay too. The removal is one commit: a delete killed midway leaves
    the cohort whole or gone, and a rerun finishes it.

    \b
    Example:
      dxr cohort delete c1a2b3c4d5e6 --with-runs --dry-run
    """
    from warehouse.cohort_deletion import RunsOnCohort, delete_cohort, deletion_summary

    cfg, wh = settings(ctx), warehouse(ctx, existing=True)
    ended: list[str] = []

    def end_killed(trainings: list[dict]) -> None:
        from tasks.prior import end_killed_trainings  # MLflow is slow to import: only for a cohort with killed ones

        ended.extend(end_killed_trainings(str(wh.root), cfg.prior, trainings))

    try:
        plan = delete_cohort(wh, cohort_key, with_runs=with_runs, dry_run=dry_run, end_killed_trainings=end_killed)
    except RunsOnCohort as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(deletion_summary(wh, plan, dry_run), nl=False)
    if plan.registered_models:
        from models.prior.tracking import tracking_uri

        uri = tracking_uri(wh.root, cfg.prior.tracking_uri)
        for name in plan.registered_models:
            # Quoted for Python and then for the shell: a data dir may be `/srv/o'brien`.
            removal = (f"from mlflow import MlflowClient; MlflowClient({json.dumps(uri, ensure_ascii=False)})"
                       f".delete_registered_model({json.dumps(name)})")
            click.echo(f"note: registered MLflow model {name} (if still registered) stays in {uri}; remove it with "
                       f"`.venv/bin/python -c {shlex.quote(removal)}`")
    if ended:
        click.echo(f"note: MLflow run(s) {', '.join(sorted(ended))} of the cohort's killed trainings, left RUNNING, "
                   "ended as KILLED (the runs and their artifacts stay)")
