"""`dxr demo`: the main job on the embedded default data."""

from __future__ import annotations

import click

from dxr.cli import main, settings, valid


@main.command()
@click.option("--patients", type=click.IntRange(min=50), default=None,
              help="Synthetic patients (default: setting synth.patients, 5000).")
@click.option("--run-id", default=None, callback=valid.run_id, help="Run id (generated when absent).")
@click.option("--llm-sample", type=click.IntRange(min=0), default=4, show_default=True,
              help="held_out patients for Direct Forecast and Union + RRF with the configured LLM (0 skips).")
@click.pass_context
def demo(ctx: click.Context, patients: int | None, run_id: str | None, llm_sample: int) -> None:
    """Generate the synthetic dataset, build the default cohort, train the EHR prior, run the
    baselines and the prior, evaluate, report; then Direct Forecast and Union + RRF on a sample.

    Prints patient-averaged P@10/R@10/P@20/R@20 with 95% bootstrap intervals for every system
    (oracle included), the realism bands of the synthetic cohort, the LLM sample comparison
    (run `<run_id>-llm`: ehr_prior, direct, rrf_prior_direct on the same patients) and the
    reports' paths. With the embedded default model the LLM numbers prove the plumbing only.

    \b
    Example:
      dxr demo --patients 5000 --llm-sample 4
    """
    from flows.api_server import start_temporary_api
    from flows.demo import DEMO_SYSTEMS, LLM_SAMPLE_SYSTEMS, demo_flow
    from warehouse.runs import check_run_kind
    from warehouse.sql import format_table
    from warehouse.store import Warehouse

    cfg = settings(ctx)
    if patients:
        cfg = cfg.model_copy(update={"synth": cfg.synth.model_copy(update={"patients": patients})})
    if run_id is not None:  # checked here: the flow would refuse it only after the dataset, the cohort and the prior
        runs = {run_id: DEMO_SYSTEMS[0]} | ({f"{run_id}-llm": LLM_SAMPLE_SYSTEMS[0]} if llm_sample else {})
        for run, first_system in runs.items():
            check_run_kind(Warehouse(cfg.data_dir), run, f"forecast:{first_system}")
    start_temporary_api()
    result = demo_flow(cfg, run_id=run_id, llm_sample=llm_sample)
    cohort = result["cohort"]
    click.echo(f"\ncohort {cohort['name']} ({cohort['cohort_id']}): {cohort['n_trajectories']:,} trajectories; "
               f"run {result['run_id']} on held_out\n")
    click.echo(headline_table(result["metrics"]))
    realism = result["realism"]
    click.echo("\nRealism bands of the synthetic cohort (held_out, final-encounter targets):")
    click.echo(format_table(list(realism.columns), realism.rows()))
    click.echo(f"report: {result['report']}")
    if result["llm"] is not None:
        llm = result["llm"]
        click.echo(f"\nLLM sample ({cfg.llm.backend} backend, model {cfg.llm.model}): {llm_sample} held_out "
                   f"patient{'s' if llm_sample != 1 else ''}, run {llm['run_id']}")
        click.echo(headline_table(llm["metrics"]))
        statuses = "; ".join(f"{system} " + ", ".join(f"{n} {status}" for _, status, n in group.iter_rows())
                             for (system,), group in llm["status"].partition_by("system", as_dict=True).items())
        click.echo(f"ranking status: {statuses} (short = fewer than 20 valid codes after V(.), failed = no valid "
                   "reply; see ranking_status)")
        click.echo(f"report: {llm['report']}")
    if not realism["within_band"].all():
        raise click.ClickException(band_violation(realism, cfg.synth.patients))


def band_violation(realism, patients: int) -> str:
    """The demo's failure line: which bands missed, by how much, and what to do about it."""
    from dxr.config import SynthConfig

    missed = "; ".join(f"{r['band']} {r['value']:.3f} outside [{r['low']:g}, {r['high']:g}]"
                       for r in realism.iter_rows(named=True) if not r["within_band"])
    calibrated = SynthConfig.model_fields["patients"].default
    if patients < calibrated:
        # Fewer patients, fewer held_out trajectories: the statistics scatter more around the generator's values.
        fix = (f"the bands are set for {calibrated:,} patients and {patients:,} give noisy statistics: "
               f"rerun with --patients {calibrated}")
    else:
        fix = "the generator no longer produces the cohort its bands describe: see docs/synthetic.md#realism-bands"
    return f"realism band violated: {missed}; {fix}"


def headline_table(metrics) -> str:
    """System x {P@10, R@10, P@20, R@20} on all codes, each with its 95% bootstrap interval."""
    import polars as pl

    from tasks.report import with_interval
    from warehouse.sql import format_table

    wanted = [("precision_at_k", 10, "P@10"), ("recall_at_k", 10, "R@10"),
              ("precision_at_k", 20, "P@20"), ("recall_at_k", 20, "R@20")]
    rows = []
    subset = metrics.filter(pl.col("subset") == "all")
    for system in subset.sort("system")["system"].unique(maintain_order=True).to_list():
        cells = [system]
        for metric, k, _ in wanted:
            hit = subset.filter((pl.col("system") == system) & (pl.col("metric") == metric) & (pl.col("k") == k))
            if hit.is_empty():
                cells.append("")
                continue
            r = hit.row(0, named=True)
            cells.append(with_interval(r["value"], r["ci_low"], r["ci_high"]))
        cells.append(str(subset.filter(pl.col("system") == system)["n"].max()))
        rows.append(tuple(cells))
    return format_table(["system"] + [label for *_, label in wanted] + ["n"], rows)
