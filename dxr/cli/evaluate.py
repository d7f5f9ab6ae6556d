"""Evaluation commands: `dxr evaluate` (metrics into the warehouse) and `dxr report` (Markdown + HTML)."""

from __future__ import annotations

import click

from dxr.cli import main, valid, warehouse
from dxr.errors import InputError


def _names(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _evaluable(ctx: click.Context, param: click.Parameter, systems: list[str]) -> None:
    """An id that names no system a run can hold is a value outside the option's choices: a usage error (exit code
    2), as `dxr forecast --system` gives, with check_evaluable's message naming the ids that are."""
    from models.registry import check_evaluable

    with valid.usage_error(ctx, param):
        for system in systems:
            check_evaluable(system)


def _systems(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    systems = _names(value)
    if systems == []:  # `--systems ,` would otherwise evaluate nothing and fail deep in the metrics
        raise click.BadParameter(f"{value!r} names no system: give a comma-separated list such as global_frequency,"
                                 "repeat_history, or leave the option out for every system of the run", ctx, param)
    _evaluable(ctx, param, systems or [])
    return systems


def _ks(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    from tasks.evaluate import budgets

    try:
        ks = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        ks = []
    if not ks:  # `--k ,` would otherwise leave only the natural K, unasked
        raise click.BadParameter(f"{value!r} is not a list of comma-separated integers such as 10,20", ctx, param)
    with valid.usage_error(ctx, param):
        budgets(ks, natural=False)  # K >= 1
    return ks


def _pairs(ctx: click.Context, param: click.Parameter, given: tuple[str, ...]) -> list[tuple[str, str]] | None:
    pairs = []
    for value in given:
        parts = _names(value) or []
        if len(parts) != 2 or parts[0] == parts[1]:  # a system against itself differs by nothing
            raise click.BadParameter(f"{value!r} is not two different systems as a,b", ctx, param)
        pairs.append((parts[0], parts[1]))
    _evaluable(ctx, param, [system for pair in pairs for system in pair])
    return pairs or None


def _pools(ctx: click.Context, param: click.Parameter, given: tuple[str, ...]) -> list[tuple[str, ...]] | None:
    pools = []
    for value in given:
        parts = tuple(part.strip() for part in value.split("+"))
        # `--pool a+` was looked up as a system named ''; `--pool a,b` (a --pair's separator) as one named 'a,b'.
        if not all(parts) or "," in value:
            raise click.BadParameter(f"{value!r} is not one or more systems joined by +, as a+b", ctx, param)
        pools.append(parts)
    _evaluable(ctx, param, [system for pool in pools for system in pool])
    return pools or None


def _mean_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from tasks.evaluate import check_mean_name

    return valid.checked(ctx, param, value, check_mean_name)


def metrics_table(metrics, subset: str = "all", columns=("micro_f1", "recall_at_k", "precision_at_k")) -> str:
    """A fixed-width summary: one row per (system, K), the chosen metrics with their intervals."""
    import polars as pl

    from tasks.report import LABELS, k_label, with_interval

    rows = metrics.filter(pl.col("subset") == subset)
    header = ["run", "system", "K", "n", "n_runs"] + [LABELS[c] for c in columns]
    lines = []
    for (run_id, system, k), group in rows.group_by("run_id", "system", "k", maintain_order=True):
        values = {r["metric"]: r for r in group.iter_rows(named=True)}
        first = group.row(0, named=True)
        lines.append([run_id, system, k_label(k), str(first["n"]), str(first["n_runs"])]
                     + [with_interval(values[c]["value"], values[c]["ci_low"], values[c]["ci_high"]) for c in columns])
    run_order = {run_id: i for i, run_id in enumerate(dict.fromkeys(rows["run_id"].to_list()))}
    lines.sort(key=lambda r: (run_order[r[0]], r[2] == "|C|", int(r[2]) if r[2] != "|C|" else 0, r[1]))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*line) for line in lines])


@main.command("evaluate")
@click.option("--run", "run_ids", multiple=True, required=True, callback=valid.run_id,
              help="Run whose rankings are evaluated; repeat it to also average repeats of one configuration.")
@click.option("--systems", default=None, callback=_systems,
              help="Comma-separated systems (default: every system of the run, plus the gold-side oracles when the "
                   "cohort has them).")
@click.option("--k", "ks", default="10,20", callback=_ks, show_default=True, help="Comma-separated budgets K.")
@click.option("--bootstrap", "n_boot", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Bootstrap resamples (0: no intervals).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Bootstrap seed.")
@click.option("--natural/--no-natural", default=True, show_default=True,
              help="Also evaluate each system's whole list (variable cardinality, shown as K=|C|).")
@click.option("--pair", "pairs", multiple=True, callback=_pairs,
              help="Paired comparison a,b (repeatable; default: every pair), in each run and of the means under one "
                   "--run-id.")
@click.option("--pool", "pools", multiple=True, callback=_pools,
              help="Pool-oracle headroom over the union of systems a+b (repeatable; default: each system and all).")
@click.option("--run-id", "mean_id", default=None, callback=_mean_name,
              help="Run id of the mean over several --run values (default: one config-… id per configuration, "
                   "and so no paired comparison of the means); reuse it to replace that mean.")
@click.pass_context
def evaluate_command(ctx: click.Context, run_ids, systems, ks, n_boot, seed, natural, pairs, pools, mean_id) -> None:
    """Compute forecast metrics with bootstrap intervals and write them to the warehouse.

    Writes `metrics`, `paired_comparisons`, `headroom` and `evaluation_coverage` (a rerun replaces
    the run's whole earlier evaluation, every system's rows included) and prints the summary for
    the subset `all`. With several --run values, each
    run is evaluated and the mean over the runs (one configuration) of each forecasting system is
    written with n_runs (the gold-side oracles are the same in every run), under --run-id when given.
    Under --run-id the means are also compared in pairs as one run's systems are (--pair), the
    difference of the means with one patient resample for every run; without it each system's mean
    has its own config-… id, and no pair of means is compared (a note says so). A pair naming an
    oracle is compared in each run only (a note says so too).

    \b
    Example:
      dxr evaluate --run forecast-20260101T000000-abc123 --systems global_frequency,repeat_history --k 10,20
      dxr evaluate --run seed-1 --run seed-2 --run seed-3 --run-id seeds-mean
    """
    import polars as pl

    from tasks.evaluate import (check_has_rankings, check_mean_run_id, cohort_rebuilt_note, comparisons_named,
                                evaluate_repeated, evaluate_run, in_sample_note, incomplete_note, paired_means,
                                repeated_systems, run_superseded_note)

    # Options that do not go together are usage errors, found before the warehouse is looked at.
    if len(set(run_ids)) > 1:
        try:
            repeated_systems(systems)  # refuses a mean over runs of oracles alone
        except InputError as exc:
            raise click.UsageError(str(exc), ctx) from exc
    elif mean_id is not None:
        raise click.UsageError(f"--run-id names the mean over several --run values; the evaluation of the one run "
                               f"{run_ids[0]} is stored under its own id: leave --run-id out, or add the runs to "
                               "average", ctx)
    wh = warehouse(ctx, existing=True)
    if len(set(run_ids)) > 1 and mean_id is not None:
        check_mean_run_id(wh, mean_id)
    for run_id in run_ids:
        check_has_rankings(wh, run_id)
        comparisons_named(wh, run_id, systems, pairs, pools)
    frames = []
    for run_id in run_ids:
        click.echo(f"evaluating run {run_id} (K={','.join(map(str, ks))}, bootstrap {n_boot}) …", err=True)
        frames.append(evaluate_run(wh, run_id, systems, ks, n_boot, seed, natural, pairs, pools))
    unpaired = None
    if len(set(run_ids)) > 1:
        frames.append(evaluate_repeated(wh, list(dict.fromkeys(run_ids)), systems, ks, n_boot, seed, natural,
                                        run_id=mean_id, pairs=pairs))
        unpaired = paired_means(frames[-1], pairs)[1]
    click.echo(metrics_table(pl.concat(frames)))
    if unpaired:
        click.echo(f"note: {unpaired}", err=True)
    for run_id in dict.fromkeys(run_ids):
        if incomplete := incomplete_note(wh, run_id):
            click.echo(f"note: run {run_id}: {incomplete}", err=True)
    notes: dict[str, list[str]] = {}  # repeated runs of one configuration usually share one note
    for run_id in dict.fromkeys(run_ids):
        if note := in_sample_note(wh, run_id):
            notes.setdefault(note, []).append(run_id)
        if note := run_superseded_note(wh, run_id):
            notes.setdefault(note, []).append(run_id)
        if note := cohort_rebuilt_note(wh, run_id):
            notes.setdefault(note, []).append(run_id)
    for note, noted in notes.items():
        click.echo(f"note: run{'s' * (len(noted) > 1)} {', '.join(noted)}: {note}", err=True)  # stdout: the table


@main.command("report")
@click.option("--run", "run_id", required=True, callback=valid.run_id, help="Evaluated run (see `dxr evaluate`).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Output directory, replaced whole by the report: new, empty or holding a report "
                   "(default: <data_dir>/reports/<run>).")
@click.pass_context
def report_command(ctx: click.Context, run_id: str, out_dir: str | None) -> None:
    """Write report.md and a self-contained report.html (plots embedded) for an evaluated run.

    \b
    Example:
      dxr report --run forecast-20260101T000000-abc123 --out reports/forecast-20260101T000000-abc123
    """
    from tasks.report import render_report, report_notes

    wh = warehouse(ctx, existing=True)
    page = render_report(wh, run_id, out_dir)
    click.echo(f"report: {page}")
    click.echo(f"markdown: {page.with_name('report.md')}")
    for _, note in report_notes(wh, run_id):
        click.echo(f"note: run {run_id}: {note}", err=True)  # as `dxr evaluate` words its notes
