"""Run commands: `dxr run list` (the run registry, newest first) and `dxr run delete` (one run and all it wrote)."""

from __future__ import annotations

import click

from dxr.cli import main, valid, warehouse
from warehouse.choices import OUTPUT_FORMATS


@main.group("run")
def run_group() -> None:
    """List the registered runs, and delete one with everything it wrote.

    \b
    Example:
      dxr run list --cohort default --kind forecast --limit 10
    """


def recorded_kinds() -> dict[str, tuple[str, ...]]:
    """The kinds of run the commands record, by the part before the colon, each with the parts they put after it
    (none: that part is the whole kind): what `synth`, `ingest`, `cohort build`, `forecast`, `evaluate`, `prior train`,
    `prior promote` and `corpus ingest|build` pass to `registered_run` or `record_run`."""
    from models.prior.config import ARCHS
    from models.registry import forecastable_systems
    from warehouse.importers.mimic import MIMIC3, MIMIC4
    from warehouse.runs import EVALUATE_KIND

    return {"synth": (), "ingest": ("meds", MIMIC3.source, MIMIC4.source), "cohort": (),
            "forecast": tuple(forecastable_systems()), EVALUATE_KIND: (), "train": tuple(ARCHS),
            "promote": tuple(ARCHS), "corpus": ("ingest", "build")}


def recorded_kind(ctx: click.Context, param: click.Parameter, kind: str | None) -> str | None:
    """A kind that no command records lists no run, ever: a usage error (exit code 2) naming the kinds, rather than
    an empty table that reads as "no such runs yet"."""
    if kind is None:
        return None
    kinds = recorded_kinds()
    family, colon, part = kind.partition(":")
    if family in kinds and (not colon or part in kinds[family]):
        return kind
    if family in kinds and kinds[family]:
        raise click.BadParameter(f"no command records runs of kind {kind!r}; the {family} kinds: {family}, "
                                 + ", ".join(f"{family}:{part}" for part in kinds[family]), ctx, param)
    spelt = [f"{name}[:{'|'.join(parts)}]" if parts else name for name, parts in sorted(kinds.items())]
    raise click.BadParameter(f"no command records runs of kind {kind!r}; kinds: {', '.join(spelt)}", ctx, param)


@run_group.command("list")
@click.option("--cohort", default=None, callback=valid.cohort_key,
              help="Only the runs on this cohort (its id, or a name: every cohort of it).")
@click.option("--kind", default=None, callback=recorded_kind,
              help="Only the runs of this kind (`forecast` takes every `forecast:<system>`; evaluate, cohort, "
                   "train:ehr_prior, ...).")
@click.option("--limit", type=click.IntRange(min=1), default=None, metavar="N",
              help="At most N rows, the newest (default: all).")
@click.option("--format", "fmt", type=click.Choice(OUTPUT_FORMATS), default="table", show_default=True,
              help="An aligned table, CSV, or JSON lines, spelt as `dxr sql` spells them.")
@click.pass_context
def run_list(ctx: click.Context, cohort: str | None, kind: str | None, limit: int | None, fmt: str) -> None:
    """List the registered runs, newest first.

    Each row: run id, kind, status, cohort name and id, start and end (UTC). A run id holds a row
    for each kind recorded under it (each system's forecast, its evaluation, ...). A run whose
    process was killed (SIGKILL, the out-of-memory killer) is marked `killed` first, with a note
    on stderr, as the next command to start a run would.

    \b
    Example:
      dxr run list --cohort default --kind forecast --limit 10
    """
    from warehouse.runs import run_list as listed

    for text in listed(warehouse(ctx, existing=True), cohort=cohort, kind=kind, limit=limit, fmt=fmt):
        click.echo(text, nl=False)


@run_group.command("delete")
@click.argument("run_id", metavar="RUN_ID", callback=valid.run_id)
@click.option("--dry-run", is_flag=True,
              help="Print what would be removed (rows by table, directories); change nothing.")
@click.pass_context
def run_delete(ctx: click.Context, run_id: str, dry_run: bool) -> None:
    """Delete a run with everything it wrote.

    That is its `runs` rows and what every table partitioned by run holds under its id (rankings,
    statuses, candidates, metrics, LLM calls, the ledger, ...), in both stores, and its report in the
    default place (<data_dir>/reports/RUN_ID). Its cohort, the prediction cache, the LLM response
    cache and MLflow stay. Only forecast and evaluation runs go so: an ingest, a cohort's build or a
    training is refused (exit code 2), as is a run that a mean over repeated runs averages, until
    those means are deleted; deleting a mean removes only the mean's rows. The
    removal is one commit: a delete killed midway leaves the run whole or gone, and a rerun finishes it.

    \b
    Example:
      dxr run delete r1 --dry-run
    """
    from warehouse.run_deletion import NotAResult, RunInMeans, delete_run, run_deletion_summary

    wh = warehouse(ctx, existing=True)
    try:
        plan = delete_run(wh, run_id, dry_run=dry_run)
    except (RunInMeans, NotAResult) as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(run_deletion_summary(wh, plan, dry_run), nl=False)
