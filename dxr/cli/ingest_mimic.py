"""`dxr ingest mimic3` and `dxr ingest mimic4`: the official MIMIC files into a registered MEDS dataset."""

from __future__ import annotations

from pathlib import Path

import click

from dxr.cli import echo_err, settings, valid, warehouse
from dxr.cli.data import check_memory_limit, echo_ingest_notes, echo_refresh_note, ingest


def _import_and_register(ctx: click.Context, source: str, path: Path, name: str, seed: int | None, labs: bool,
                         memory_limit: str, run_id: str | None) -> None:
    from warehouse.datasets import ingest_mimic

    seed = settings(ctx).seed if seed is None else seed
    wh = warehouse(ctx)
    row, summary = ingest_mimic(wh, source, path, name, seed=seed, labs=labs,
                                log=lambda message: echo_err(f"  {message}"), run_id=run_id, memory_limit=memory_limit)
    click.echo(summary.table())
    click.echo(f"dataset {row['dataset_id']}: {row['n_subjects']:,} patients, {row['n_events']:,} events, "
               f"ICD versions {row['icd_versions']}")
    echo_ingest_notes(row)
    echo_refresh_note(wh, name, settings(ctx).seed)


def mimic_options(source: str):
    """The argument and options both MIMIC commands take, `source` (mimic3 or mimic4) naming the dataset by default."""
    options = [
        click.argument("path", type=click.Path(path_type=Path), callback=valid.mimic_directory(source)),
        click.option("--name", default=source, show_default=True, callback=valid.dataset_name,
                     help="Dataset name (lower-case letters, digits, _ and -)."),
        click.option("--seed", type=int, default=None, help="Seed of the hash split (default: setting seed)."),
        click.option("--labs", is_flag=True, help="Also import lab results (labevents, labels from d_labitems); the "
                     "largest table by far, so off by default."),
        click.option("--memory-limit", default="2GB", show_default=True, callback=check_memory_limit,
                     help="DuckDB memory of the import; beyond it DuckDB spills to a work directory beside the "
                     "dataset."),
        click.option("--run-id", default=None, callback=valid.run_id, help="Run id to register (generated when "
                     "absent)."),
    ]

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


@ingest.command("mimic3")
@mimic_options("mimic3")
@click.pass_context
def ingest_mimic3(ctx: click.Context, path: Path, name: str, seed: int | None, labs: bool, memory_limit: str,
                  run_id: str | None) -> None:
    """Import MIMIC-III (ADMISSIONS, PATIENTS, DIAGNOSES_ICD, …; .csv or .csv.gz) as a MEDS dataset.

    Diagnoses are ICD-9 at discharge time; procedures, prescriptions, sex, birth (ages above 89
    capped at 90) and death are imported too, lab results with --labs. See docs/bring-your-own-data.md.

    \b
    Example:
      dxr ingest mimic3 ../shared/data/mimic-iii-demo --name mimic3demo
    """
    _import_and_register(ctx, "mimic3", path, name, seed, labs, memory_limit, run_id)


@ingest.command("mimic4")
@mimic_options("mimic4")
@click.pass_context
def ingest_mimic4(ctx: click.Context, path: Path, name: str, seed: int | None, labs: bool, memory_limit: str,
                  run_id: str | None) -> None:
    """Import a MIMIC-IV `hosp` module (the release root or hosp/ itself; .csv or .csv.gz) as a MEDS dataset.

    Diagnoses keep their ICD version (9 or 10, mixed within patients); harmonize them when building
    a cohort (`dxr cohort build --harmonize icd10|icd10_closest|category`). Lab results come with --labs.
    See docs/bring-your-own-data.md.

    \b
    Example:
      dxr ingest mimic4 /data/mimic-iv-3.1 --name mimic4
    """
    _import_and_register(ctx, "mimic4", path, name, seed, labs, memory_limit, run_id)
