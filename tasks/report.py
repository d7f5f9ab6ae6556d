"""Report stage: one run's stored evaluation as Markdown and a self-contained HTML page with plots.

The report is built once as a list of blocks (headings, paragraphs, tables, figures) and rendered
twice: `report.md` (figures as PNG files next to it) and `report.html` (figures embedded as base64
data URIs, inline CSS, no external URL: it opens offline). The K-sweep (K = 1..20, point values)
is recomputed from `rankings` and the gold targets (a mean over repeated runs averages its runs'
sweeps); everything else is read from the tables that `dxr evaluate` wrote. A render writes no
clock time (the run registry table says when the evaluation ran), so the same stored evaluation
renders the same bytes.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never open a window or need a display
import matplotlib.pyplot as plt  # noqa: E402
import polars as pl  # noqa: E402
from prefect import task  # noqa: E402

from dxr.config import load_settings  # noqa: E402
from dxr.errors import InputError, NotFoundError  # noqa: E402
from models.llm.config import ModelPrice  # noqa: E402
from tasks.efficiency import efficiency_notes, run_efficiency, run_systems  # noqa: E402
from tasks.evaluate import (FREQUENCY_BUCKETS, NATURAL_K, changed_since_mean, cohort_rebuilt_note,  # noqa: E402
                            estimate, evaluate_again, in_sample_note, load_run, metric_rows, not_a_forecast,
                            outdated_evaluation_note, run_superseded_note, system_counts)
from warehouse.cohorts import cohort_provenance  # noqa: E402
from warehouse.locks import beside_held  # noqa: E402
from warehouse.meds import replace_dir  # noqa: E402
from warehouse.runs import EVALUATE_KIND, holding_run, unknown_run  # noqa: E402
from warehouse.scratch import naming, remove_abandoned, scratch  # noqa: E402
from warehouse.store import Warehouse  # noqa: E402

SWEEP_MAX_K = 20
# Every file a report writes: its figures (`Figure.name` + .png) and its two pages.
REPORT_FILES = ("comparison.png", "k_sweep.png", "frequency.png", "onset.png", "report.md", "report.html")
# A render waits this long for another one to finish swapping its files into the same directory (a rename).
SWAP_WAIT_SECONDS = 10.0
LABELS = {"precision_at_k": "P@K", "recall_at_k": "R@K", "micro_precision": "micro-P", "micro_recall": "micro-R",
          "micro_f1": "micro-F1", "macro_f1": "macro-F1"}
HEADLINE = ("precision_at_k", "recall_at_k", "micro_f1", "macro_f1")


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Paragraph:
    text: str


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    name: str        # file stem of the PNG written next to report.md
    caption: str
    png: bytes


# ---- formatting ------------------------------------------------------------------------------

def with_interval(value: float, low: float | None, high: float | None) -> str:
    """`0.412 [0.398, 0.427]`, or the bare value without an interval.

    >>> with_interval(0.41234, 0.4, 0.425), with_interval(0.5, None, None)
    ('0.412 [0.400, 0.425]', '0.500')
    """
    if low is None or high is None:
        return f"{value:.3f}"
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def k_label(k: int) -> str:
    return "|C|" if k == NATURAL_K else str(k)


def system_table(metrics: pl.DataFrame, coverage: pl.DataFrame, k: int, subset: str = "all") -> Table:
    """One row per system (best micro-F1 first): headline metrics with intervals, n, short/failed, native share.

    `short` and `failed` are disjoint, as in `dxr forecast`'s summary: `short` is the trajectories whose list has
    fewer than K codes (`n_below_k`) less the failed ones, which have no codes and so are below every K; a list
    recorded `short` of the largest K may be complete at a smaller one.
    """
    rows = metrics.filter((pl.col("k") == k) & (pl.col("subset") == subset))
    order = (rows.filter(pl.col("metric") == "micro_f1").sort(["value", "system"], descending=[True, False])
             ["system"].to_list())
    cov = {r["system"]: r for r in coverage.filter(pl.col("k") == k).iter_rows(named=True)}
    out = []
    for system in order:
        mine = {r["metric"]: r for r in rows.filter(pl.col("system") == system).iter_rows(named=True)}
        cells = [system] + [with_interval(mine[m]["value"], mine[m]["ci_low"], mine[m]["ci_high"]) for m in HEADLINE]
        c = cov.get(system)
        share = "" if c is None or c["native_share"] is None else f"{c['native_share']:.3f}"
        short = "" if c is None else str(0 if k == NATURAL_K else c["n_below_k"] - c["n_failed"])  # |C|: none below
        cells += [str(mine["micro_f1"]["n"]), short, str(c["n_failed"]) if c else "", share]
        out.append(cells)
    return Table(["system"] + [LABELS[m] for m in HEADLINE] + ["n", "short", "failed", "native share"], out)


def subset_table(metrics: pl.DataFrame, k: int, metric: str, subsets: list[str]) -> Table:
    rows = metrics.filter((pl.col("k") == k) & (pl.col("metric") == metric))
    systems = sorted(rows["system"].unique().to_list())
    present = [s for s in subsets if s in set(rows["subset"])]
    cells = []
    for system in systems:
        mine = {r["subset"]: r for r in rows.filter(pl.col("system") == system).iter_rows(named=True)}
        cells.append([system] + [with_interval(mine[s]["value"], mine[s]["ci_low"], mine[s]["ci_high"])
                                 if s in mine else "" for s in present])
    n = {r["subset"]: r["n"] for r in rows.iter_rows(named=True)}
    return Table(["system"] + [f"{s} (n={n[s]})" for s in present], cells)


def paired_table(paired: pl.DataFrame, k: int, metric: str = "micro_f1") -> Table:
    rows = (paired.filter((pl.col("k") == k) & (pl.col("metric") == metric) & (pl.col("subset") == "all"))
            .sort(["difference", "system_a", "system_b"], descending=[True, False, False]))
    difference = "a − b [95% CI]" if rows["ci_low"].null_count() < rows.height else "a − b"
    return Table(["a", "b", f"{LABELS[metric]} a", f"{LABELS[metric]} b", difference, "improved",
                  "worsened", "tied", "sign test p"],
                 [[r["system_a"], r["system_b"], f"{r['value_a']:.3f}", f"{r['value_b']:.3f}",
                   with_interval(r["difference"], r["ci_low"], r["ci_high"]), str(r["n_improved"]),
                   str(r["n_worsened"]), str(r["n_tied"]), f"{r['sign_test_p']:.3g}"]
                  for r in rows.iter_rows(named=True)])


def headroom_table(headroom: pl.DataFrame, metrics: pl.DataFrame, k: int) -> Table:
    """Pool oracle micro-F1 against the best system inside the pool: the reachable gain by reordering."""
    rows = headroom.filter((pl.col("k") == k) & (pl.col("metric") == "micro_f1") & (pl.col("subset") == "all"))
    achieved = dict(metrics.filter((pl.col("k") == k) & (pl.col("metric") == "micro_f1") & (pl.col("subset") == "all"))
                    .select("system", "value").iter_rows())
    out = []
    for r in rows.sort("pool").iter_rows(named=True):
        best = max(achieved.get(s, float("nan")) for s in r["pool"].split("+"))
        out.append([r["pool"], f"{r['mean_pool_size']:.1f}", with_interval(r["value"], r["ci_low"], r["ci_high"]),
                    f"{best:.3f}", f"{r['value'] - best:+.3f}"])
    return Table(["pool", "mean pool size", "pool-oracle micro-F1", "best system in pool", "headroom"], out)


def _value(value, spec: str, missing: str = "n/a") -> str:
    """A number in `spec`, or `missing` for null.

    >>> _value(0.00331, ".6f"), _value(None, ".1f")
    ('0.003310', 'n/a')
    """
    return missing if value is None else format(value, spec)


def efficiency_blocks(wh: Warehouse, run_id: str, prices: dict[str, ModelPrice] | None = None,
                      systems: list[str] | None = None) -> list:
    """Spec §6 per system on the run's matched patients: LLM calls, tokens, cost, throughput, retrieval, micro-F1@20.

    Cost is the one each call stored; `prices` (default: the configured `llm.prices` table) prices the calls
    written before costs were stored. `systems` are the evaluated systems (default: every system of the run); the
    others are named as left out, not listed.
    """
    if prices is None:
        prices = load_settings(data_dir=wh.root).llm.prices
    ranked = run_systems(wh, run_id)
    left_out = [] if systems is None else [s for s in ranked if s not in systems]
    frame = run_efficiency(wh, run_id, prices, systems)
    blocks: list = [Heading("Efficiency (per patient, same patients)")]
    if not ranked:
        return blocks + [Paragraph("No per-patient telemetry: this run id has no rankings of its own (an aggregate "
                                   "of repeated runs); each underlying run's report has its own.")]
    if frame.is_empty():
        return blocks + [Paragraph("No per-patient telemetry: no system with lists in this run was evaluated (left "
                                   f"out by `dxr evaluate --systems`: {', '.join(left_out)}).")]
    rows = frame.to_dicts()
    patients, trajectories = max(r["patients"] for r in rows), max(r["trajectories"] for r in rows)
    matched = (f"{patients} matched patients" if trajectories == patients else
               f"{patients} matched patients with {trajectories} trajectories; a patient forecast at several target "
               "encounters counts once, with the work of all its trajectories")
    blocks += [
        Paragraph(f"Totals over each system's trajectories of the run divided by the number of their patients "
                  f"({matched}). "
                  "Calls count cache hits; backend calls do not (a cache hit sends no request: no tokens, latency or "
                  "cost). Cost per patient sums the cost each call stored at the `llm.prices` entry in force "
                  "when it was made (calls recorded before costs were stored: the configured table now; US dollars; "
                  "n/a = a model without a price). Patients/hour is observed from the clock named in the last column "
                  "(a registered run's wall clock includes fitting and writing). A system that fuses other systems' "
                  "lists of the run counts their calls and clocks too. micro-F1@20 is the evaluated value on the "
                  "same patients (n/a when K = 20 was not evaluated)."),
        Table(["system", "patients", "micro-F1@20", "LLM calls/pt", "backend calls/pt", "cache hits",
               "cost/pt (USD)", "patients/h", "clock"],
              [[r["system"], str(r["patients"]), _value(r["micro_f1_at_20"], ".3f"),
                f"{r['calls_per_patient']:.2f}", f"{r['backend_calls_per_patient']:.2f}", str(r["cache_hits"]),
                _value(r["cost_per_patient_usd"], ".6f"), _value(r["patients_per_hour"], ",.0f"), r["clock"]]
               for r in rows])]
    if left_out:
        blocks.append(Paragraph("Not listed (lists in this run, but left out of its evaluation by `dxr evaluate "
                                f"--systems`): {', '.join(left_out)}."))
    superseded = [r for r in rows if r["superseded_calls"]]
    if superseded:
        blocks += [Heading("Superseded attempts", 3),
                   Paragraph("Calls made by earlier attempts of a system in this run (killed, failed or redone) "
                             "whose outputs a rerun under the same run id replaced: paid for, but behind no list "
                             "above, so they are not in the per-patient numbers. Totals in US dollars, counted on "
                             "the same patients and stages as the kept calls; spent = the kept calls' cost + the "
                             "superseded attempts' (n/a when a model had no price)."),
                   Table(["system", "superseded calls", "superseded cost (USD)", "kept cost (USD)", "spent (USD)"],
                         [[r["system"], str(r["superseded_calls"]), _value(r["superseded_cost_usd"], ".6f"),
                           _value(r["cost_usd"], ".6f"), _value(spent(r), ".6f")] for r in superseded])]
    llm = [r for r in rows if r["llm_calls"]]
    if llm:
        blocks += [Heading("LLM tokens and latency per patient", 3),
                   Paragraph("Backend calls only; reasoning tokens (when a backend reports them) are already part of "
                             "the output tokens and are shown on their own. A call's latency is its time in flight at "
                             "the backend over every transport attempt (waiting for a concurrency slot, the rate "
                             "limit and retry backoff excluded), so serial patients/hour assumes one call at a time "
                             "with no queueing."),
                   Table(["system", "LLM stages", "tokens in", "cached in", "out", "reasoning", "latency p50 (ms)",
                          "latency total (s)", "serial patients/h"],
                         [[r["system"], r["llm_stages"], f"{r['tokens_in_per_patient']:.1f}",
                           f"{r['tokens_cached_in_per_patient']:.1f}", f"{r['tokens_out_per_patient']:.1f}",
                           f"{r['tokens_reasoning_per_patient']:.1f}", _value(r["latency_ms_p50"], ".0f"),
                           f"{r['latency_ms_total'] / 1000:.1f}", _value(r["patients_per_hour_serial"], ",.0f")]
                          for r in llm])]
    searched = [r for r in rows if r["retrieval"]]
    if any(r["queries_per_patient"] or r["retrieval_operations_per_patient"] for r in searched):
        blocks += [Heading("Retrieval per patient", 3),
                   Paragraph("Unique queries within a patient, retrieval operations (search job × engine), source "
                             "accesses (records that opened a source, every state but no_result) and records that "
                             "support their hypothesis; every other system made none."),
                   Table(["system", "queries", "retrieval operations", "source accesses", "supported records"],
                         [[r["system"], f"{r['queries_per_patient']:.2f}",
                           f"{r['retrieval_operations_per_patient']:.2f}", f"{r['source_accesses_per_patient']:.2f}",
                           f"{r['supported_records_per_patient']:.2f}"] for r in searched])]
    else:
        blocks.append(Paragraph(f"No retrieval in this run: no search jobs or ledger rows under run {run_id} are "
                                "attributed to its systems, so queries, retrieval operations and source accesses "
                                "are 0 for every system."))
    notes = efficiency_notes(wh, run_id, systems)
    if notes:
        blocks.append(Paragraph("Not counted above: " + " ".join(notes)))
    return blocks


def spent(row: dict) -> float | None:
    """What a system of the run cost in all (`run_efficiency` row): its kept calls' cost and its superseded ones'.

    >>> spent({"cost_usd": 0.5, "superseded_cost_usd": 0.25}), spent({"cost_usd": None, "superseded_cost_usd": 0.25})
    (0.75, None)
    """
    known = row["cost_usd"] is not None and row["superseded_cost_usd"] is not None
    return row["cost_usd"] + row["superseded_cost_usd"] if known else None


# ---- figures ---------------------------------------------------------------------------------

def _png(fig) -> bytes:
    buffer = io.BytesIO()
    # No Software metadata: the page must not carry any URL, not even inside an image.
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def _errors(frame: pl.DataFrame) -> list[list[float]]:
    """Asymmetric error bar lengths; zero where an interval is missing."""
    values, low, high = (frame["value"], frame["ci_low"].fill_null(frame["value"]),
                         frame["ci_high"].fill_null(frame["value"]))
    return [(values - low).clip(lower_bound=0).to_list(), (high - values).clip(lower_bound=0).to_list()]


def comparison_figure(metrics: pl.DataFrame, k: int, intervals: bool) -> bytes:
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * metrics["system"].n_unique() + 1.5), sharey=True)
    order = (metrics.filter((pl.col("k") == k) & (pl.col("subset") == "all") & (pl.col("metric") == "micro_f1"))
             .sort("value")["system"].to_list())
    for ax, metric in zip(axes, ("micro_f1", "recall_at_k")):
        rows = (metrics.filter((pl.col("k") == k) & (pl.col("subset") == "all") & (pl.col("metric") == metric))
                .join(pl.DataFrame({"system": order, "pos": range(len(order))}), on="system").sort("pos"))
        ax.errorbar(rows["value"], rows["pos"], xerr=_errors(rows), fmt="o", capsize=3)
        ax.set_yticks(range(len(order)), order)
        ax.set_xlabel(f"{LABELS[metric]} at K={k_label(k)}" + (" (95% CI)" if intervals else ""))
        ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def sweep_figure(sweep: pl.DataFrame) -> bytes:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("micro_f1", "recall_at_k")):
        rows = sweep.filter((pl.col("metric") == metric) & (pl.col("subset") == "all"))
        for system in sorted(rows["system"].unique().to_list()):
            line = rows.filter(pl.col("system") == system).sort("k")
            ax.plot(line["k"], line["value"], marker=".", label=system)
        ax.set_xlabel("K")
        ax.set_ylabel(LABELS[metric])
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="best")
    return _png(fig)


def grouped_figure(metrics: pl.DataFrame, k: int, subsets: list[str], metric: str = "recall_at_k") -> bytes:
    rows = metrics.filter((pl.col("k") == k) & (pl.col("metric") == metric) & pl.col("subset").is_in(subsets))
    present = [s for s in subsets if s in set(rows["subset"])]
    systems = sorted(rows["system"].unique().to_list())
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(present) * max(1, len(systems)) ** 0.5 + 3), 4))
    width = 0.8 / max(1, len(systems))
    for j, system in enumerate(systems):
        mine = (pl.DataFrame({"subset": present, "x": range(len(present))})
                .join(rows.filter(pl.col("system") == system), on="subset").sort("x"))
        ax.bar(mine["x"] + j * width - 0.4 + width / 2, mine["value"], width, yerr=_errors(mine), capsize=2,
               label=system)
    ax.set_xticks(range(len(present)), present)
    ax.set_ylabel(f"{LABELS[metric]} at K={k_label(k)}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    return _png(fig)


# ---- assembly and rendering ------------------------------------------------------------------

def k_sweep(wh: Warehouse, run_id: str, systems: list[str], max_k: int) -> pl.DataFrame:
    """Point values (no bootstrap) of every metric at K = 1..max_k for the subset `all`.

    Only `all` is counted: the counts are (systems, subsets, K, trajectories) float64 arrays, so the other
    eight subsets at twenty K values would take ~10 GB for 16 systems at 50,000 trajectories.
    """
    run = load_run(wh, run_id, systems, ks=range(1, max_k + 1))
    return metric_rows(estimate(system_counts(run, tuple(range(1, max_k + 1)), subsets=("all",)), None))


def mean_k_sweep(wh: Warehouse, run_ids: list[str], systems: list[str], max_k: int) -> pl.DataFrame:
    """The K-sweep of a mean over repeated runs: each run's point values averaged, as its stored metrics are."""
    sweeps = pl.concat([k_sweep(wh, run_id, systems, max_k) for run_id in run_ids])
    return sweeps.group_by("system", "subset", "k", "metric").agg(pl.col("value").mean())


def averaged_runs(wh: Warehouse, run_id: str) -> list[str]:
    """The runs whose mean `run_id` is (`evaluate_repeated`), or [] for a run of its own (or not evaluated)."""
    evaluation = wh.read("runs", run_id=run_id, kind=EVALUATE_KIND)
    return [] if evaluation.is_empty() else json.loads(evaluation["config_json"][0]).get("runs", [])


def report_notes(wh: Warehouse, run_id: str) -> list[tuple[str, str]]:
    """(label, note) of what a reader of a run's report must know before its numbers: what in it is of an earlier
    version than the warehouse's or this dxr's now, its cohort (`run_superseded_note`), its cohort's build
    (`cohort_rebuilt_note`) and its evaluation (`outdated_evaluation_note`), and that it scores train patients
    (`in_sample_note`). The report opens with them and `dxr report` repeats them on stderr, where a scheduled or
    scripted run's reader sees them."""
    # A mean has no trajectories of its own; the runs it averages all cover the same ones (`evaluate_repeated`).
    notes = [("Earlier cohort", run_superseded_note(wh, run_id)),
             ("Cohort built again", cohort_rebuilt_note(wh, run_id)),
             ("Earlier evaluation rules", outdated_evaluation_note(wh, run_id)),
             ("In-sample", in_sample_note(wh, (averaged_runs(wh, run_id) or [run_id])[0]))]
    return [(label, note) for label, note in notes if note]


def build_report(wh: Warehouse, run_id: str) -> list:
    metrics = wh.read("metrics", run_id=run_id)
    if metrics.is_empty():
        # Evaluating first helps only a run that exists: a mistyped id (or another data dir) is named as such.
        if not wh.has_rows("runs", run_id=run_id) and not wh.has_rows("rankings", run_id=run_id):
            raise unknown_run(wh, run_id)
        raise not_a_forecast(wh, run_id) or NotFoundError(f"run {run_id!r} has no stored metrics: run "
                                                          f"`dxr evaluate --run {run_id}` first")
    # A forecast rerun of one system removes only that system's metrics and marks the evaluation stale; an
    # evaluation killed among its writes leaves old and new rows mixed. Either would report a partial table.
    evaluation = wh.read("runs", run_id=run_id, kind=EVALUATE_KIND)
    averaged = averaged_runs(wh, run_id)
    again = evaluate_again(wh, run_id)
    if not evaluation.is_empty() and evaluation["status"][0] != "finished":
        raise InputError(f"the evaluation of run {run_id!r} is {evaluation['status'][0]} (a system was forecast into "
                         f"the run since, anew or again, or its writes were cut short): run `{again}` again, then the "
                         "report")
    # The K-sweep reads the cohort's targets now: against a build made since the evaluation it would disagree with
    # the stored tables wherever the build changed them (other cut rules, other oracle draws).
    cohorts = wh.read("cohorts", cohort_id=metrics["cohort_id"][0])
    if not evaluation.is_empty() and cohorts.height and cohorts["created_at"][0] > evaluation["started_at"][0]:
        raise InputError(f"the evaluation of run {run_id!r} was taken before cohort {cohorts['name'][0]} "
                         f"({cohorts['cohort_id'][0]}) was built again on {cohorts['created_at'][0]:%Y-%m-%d %H:%M} "
                         f"UTC: run `{again}` again, then the report")
    # A mean is stored under its own id, which no forecast rerun of the runs it averages touches.
    changed = changed_since_mean(wh, run_id)
    if changed:
        raise InputError(f"the mean over repeated runs {run_id!r} is out of date ({changed}): run `{again}` with "
                         "the same options again, then the report")
    coverage = wh.read("evaluation_coverage", run_id=run_id)
    paired = wh.read("paired_comparisons", run_id=run_id)
    headroom = wh.read("headroom", run_id=run_id)
    fixed = sorted(k for k in metrics["k"].unique() if k != NATURAL_K)
    k = fixed[-1] if fixed else NATURAL_K
    systems = sorted(metrics["system"].unique().to_list())
    n = metrics.filter(pl.col("subset") == "all")["n"].max()
    has_interval = metrics["ci_low"].null_count() < metrics.height
    n_runs = int(metrics["n_runs"].max())
    natural = NATURAL_K in set(metrics["k"])
    blocks: list = [
        Heading(f"Evaluation report — run {run_id}", 1),
        Paragraph(f"Cohort {cohort_provenance(wh, metrics['cohort_id'][0])}; {n} trajectories; "
                  f"{len(systems)} systems "
                  f"({', '.join(systems)}). K values: {', '.join(k_label(x) for x in sorted(metrics['k'].unique()))}"
                  + (" (|C| = each system's whole list). " if natural else ". ")
                  + ("Intervals are 95% patient-cluster bootstrap percentile intervals."
                     if has_interval else "No bootstrap intervals were computed.")
                  + (f" Values are means of {n_runs} repeated runs of one configuration." if n_runs > 1 else "")),
    ]
    blocks += [Paragraph(f"{label}: {note}.") for label, note in report_notes(wh, run_id)]
    runs = wh.read("runs", run_id=run_id).sort("kind")
    if not runs.is_empty():
        blocks += [Heading("Run registry"), Table(
            ["kind", "status", "code version", "started (UTC)", "seconds", "config"],
            [[r["kind"], r["status"], r["code_version"], f"{r['started_at']:%Y-%m-%d %H:%M:%S}",
              f"{(r['finished_at'] - r['started_at']).total_seconds():.1f}" if r["finished_at"] else "",
              r["config_json"]] for r in runs.iter_rows(named=True)])]
    for i, kk in enumerate(fixed[::-1] + ([NATURAL_K] if natural else [])):
        blocks += [Heading(f"Systems at K = {k_label(kk)}")]
        if i == 0:
            over_runs = (f" Over the {n_runs} runs: short and failed count the lists of every run, and native share "
                         "is the mean of the runs' shares." if n_runs > 1 else "")
            blocks.append(Paragraph("short = trajectories whose list has fewer than K codes (failed ones not "
                                    "included, as in dxr forecast's summary), scored with the hits they have; a list "
                                    "recorded short at the forecast's K may be complete at a smaller K. failed = "
                                    "trajectories whose forecast failed (no list). "
                                    "native share = the share of the top-K codes that the system ranked itself; the "
                                    "rest pad its list from the train-split frequency list." + over_runs))
        blocks.append(system_table(metrics, coverage, kk))
    blocks += [Heading("System comparison"),
               Figure("comparison", f"micro-F1 and R@K at K={k_label(k)}"
                      + (" with 95% intervals." if has_interval else " (no bootstrap intervals)."),
                      comparison_figure(metrics, k, has_interval))]
    # A mean over repeated runs has no rankings of its own: its sweep is the mean of the sweeps of the runs its
    # evaluation names.
    swept = averaged or ([run_id] if n_runs == 1 else [])
    max_sweep = min(SWEEP_MAX_K, k) if fixed and swept else 0
    if max_sweep:
        over = f"; means over the {len(averaged)} runs" if averaged else ""
        blocks.append(Figure("k_sweep", f"K-sweep 1..{max_sweep} (point values{over}).",
                             sweep_figure(mean_k_sweep(wh, swept, systems, max_sweep))))
    buckets = [b[0] for b in FREQUENCY_BUCKETS]
    blocks += [Heading("Recall by code frequency in the train split"),
               Paragraph(f"R@K at K = {k_label(k)}. A target code's bucket is the number of train-split encounters "
                         "coding it; each subset keeps the trajectories with at least one target code in it."),
               subset_table(metrics, k, "recall_at_k", buckets),
               Figure("frequency", f"R@K at K={k_label(k)} by code-frequency bucket.",
                      grouped_figure(metrics, k, buckets)),
               Heading("New-onset vs repeated target codes, and ICD version"),
               Paragraph(f"R@K at K = {k_label(k)}. A target code is repeated when it is among the trajectory's "
                         "pre-target diagnoses, else new-onset; icd9 and icd10 keep the target codes of one ICD "
                         "version."),
               subset_table(metrics, k, "recall_at_k", ["new_onset", "repeated", "icd9", "icd10"]),
               Figure("onset", f"R@K at K={k_label(k)}: new-onset vs repeated codes.",
                      grouped_figure(metrics, k, ["new_onset", "repeated"]))]
    if not paired.is_empty():
        explained = ("Difference a − b with a paired bootstrap interval; the sign test counts patients whose F1 "
                     "summand improved or worsened (ties excluded).")
        if n_runs > 1:
            explained = (f"Difference of the means over the {n_runs} runs, a − b, with a paired bootstrap interval "
                         "(one patient resample for every run and both systems); the sign test counts patients whose "
                         "F1 summand, summed over their trajectories and the runs, improved or worsened (ties "
                         "excluded).")
        blocks += [Heading(f"Paired comparisons (micro-F1 at K = {k_label(k)}, same patients)"),
                   Paragraph(explained), paired_table(paired, k)]
    if not headroom.is_empty():
        blocks += [Heading(f"Headroom: target-conditioned pool oracle at K = {k_label(k)}"),
                   Paragraph("Best achievable top-K within each pool (union of full lists): min(K, |pool ∩ Y|) "
                             "hits per trajectory."),
                   headroom_table(headroom, metrics, k)]
    blocks += efficiency_blocks(wh, run_id, systems=systems)
    return blocks


def to_markdown(blocks: list) -> str:
    out = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Table):
            lines = ["| " + " | ".join(block.columns) + " |", "|" + "---|" * len(block.columns)]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in block.rows]
            out.append("\n".join(lines))
        elif isinstance(block, Figure):
            out.append(f"![{block.caption}]({block.name}.png)\n\n*{block.caption}*")
    return "\n\n".join(out) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}figure{margin:1em 0}img{max-width:100%}
figcaption{color:#555;font-size:0.9em}"""


def to_html(blocks: list) -> str:
    title = next((b.text for b in blocks if isinstance(b, Heading)), "Evaluation report")
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
           f"<style>{_CSS}</style></head><body>"]
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            out.append(f"<p>{html.escape(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{html.escape(c)}</th>" for c in block.columns)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in block.rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif isinstance(block, Figure):
            data = base64.b64encode(block.png).decode("ascii")
            out.append(f"<figure><img alt='{html.escape(block.caption)}' src='data:image/png;base64,{data}'>"
                       f"<figcaption>{html.escape(block.caption)}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def report_path(wh: Warehouse, run_id: str) -> Path:
    """Where `render_report` writes a run's HTML report by default: `<warehouse root>/reports/<run_id>/`."""
    return wh.root / "reports" / run_id / "report.html"


def render_report(wh: Warehouse, run_id: str, out_dir: str | Path | None = None) -> Path:
    """Write report.md (+ PNGs) and report.html for a run as one set; returns the HTML path (`report_path` by default).

    The files are written into a staging directory beside the output directory and swapped in whole: a
    reader sees the previous complete report or the new one, never files of two evaluations (a figure of one
    beside the page of another), and a render killed or out of disk space midway leaves the previous set in
    place for the next render to replace (its staging is removed then). So the output directory holds a
    report and nothing else: one holding other files is refused rather than replaced.
    """
    out = Path(out_dir) if out_dir is not None else report_path(wh, run_id).parent
    # The report is staged beside its directory, made with its parents where missing. Refused before the run is read,
    # in one line: an account that may only read the warehouse (an analyst's) was shown a hidden scratch file.
    beside = out.absolute().parent
    while not beside.exists() and beside.parent != beside:
        beside = beside.parent
    if beside.is_dir() and not os.access(beside, os.W_OK | os.X_OK):
        raise InputError(f"{beside} is not writable by this user (uid {os.getuid()}), and the report of run {run_id} "
                         "is written there: give --out a directory of your own (a report only reads the warehouse)")
    with holding_run(wh, run_id, exclusive=False):  # no evaluation rewrites the metrics meanwhile
        blocks = build_report(wh, run_id)
    files = {f"{block.name}.png": block.png for block in blocks if isinstance(block, Figure)}
    files["report.md"] = to_markdown(blocks).encode("utf-8")
    files["report.html"] = to_html(blocks).encode("utf-8")
    assert set(files) <= set(REPORT_FILES), f"{sorted(set(files) - set(REPORT_FILES))} are not in REPORT_FILES"
    target = out.absolute()  # a name to put the staging beside (`.` has none)
    if not target.exists():  # a path through a file fails here, naming `out` (Not a directory)
        target.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target)
    with scratch(target, "staging") as staging:
        staging.mkdir()
        for name, data in files.items():
            with naming(out / name):  # Python's file write names no file (a full disk, a quota)
                (staging / name).write_bytes(data)
        # Two renders into one directory would each move the other's report aside. The lock is beside it, where the
        # renderer writes, not in the data dir's `.locks`, which a reader may not write.
        with beside_held(target, wait=SWAP_WAIT_SECONDS, busy=f"another dxr process is swapping a report into {out}"):
            check_report_dir(out)
            replace_dir(staging, target)
    return out / "report.html"


def check_report_dir(out: Path) -> None:
    """Refuse an output directory that holds anything but a report's files (or their scratch from a killed write), or
    that the process runs in."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file: give --out a directory for the report")
    # Swapped away, it would leave the caller (a shell in it, `--out .`) in a removed directory, where the
    # report's printed relative path names nothing.
    if out.is_dir() and out.resolve() == Path.cwd():
        raise InputError(f"{out} is the directory dxr runs in: a report replaces its directory whole; give --out "
                         "another directory, or run dxr from outside this one")
    for entry in sorted(out.iterdir()) if out.is_dir() else []:
        if entry.name not in REPORT_FILES and not any(entry.name.startswith(f".{f}.") for f in REPORT_FILES):
            raise InputError(f"{out} holds {entry.name!r}, which is not a file of a report: a report replaces its "
                             "directory whole, so give --out a new or empty directory of its own")


@task(name="render-report")
def render_report_task(data_dir: str, run_id: str, out_dir: str | None = None) -> str:
    """Prefect wrapper: render one run's report; returns the HTML path."""
    return str(render_report(Warehouse(data_dir), run_id, out_dir))


# ---- what the Prefect UI shows of a patient rerun or a backfill (flows/patient.py, flows/backfill.py) ---

LOGGED_CODES = 10
ARTIFACT_K = 20


def labelled_rankings(wh: Warehouse, run_id: str) -> pl.DataFrame:
    """A run's rankings, each code shown as its dotted code and title (the MEDS code when it has none)."""
    titles = wh.read("icd_codes").select("code", "dotted", "title")
    return (wh.read("rankings", run_id=run_id).join(titles, on="code", how="left")
            .with_columns(pl.when(pl.col("dotted").is_null()).then(pl.col("code"))
                          .otherwise(pl.format("{} {}", "dotted", "title")).alias("shown"))
            .sort("trajectory_id", "rank"))


def ranking_lines(rankings: pl.DataFrame, statuses: pl.DataFrame, systems: tuple[str, ...],
                  codes: int = LOGGED_CODES) -> list[str]:
    """One line per (trajectory, system), systems in the order given: the top codes with their titles.

    A list that is not `ok` says its status and why after the system: a `failed` one has no codes, and
    its line would otherwise read as if the system had answered nothing for no reason.
    """
    lines = []
    # From the statuses: a trajectory whose every system failed has no rankings row.
    for trajectory_id in sorted(set(statuses["trajectory_id"].to_list())):
        for system in systems:
            top = rankings.filter((pl.col("trajectory_id") == trajectory_id) & (pl.col("system") == system))
            outcome = statuses.filter((pl.col("trajectory_id") == trajectory_id) & (pl.col("system") == system))
            label = system
            if outcome.height and outcome["status"][0] != "ok":
                status, detail = outcome.row(0, named=True)["status"], outcome.row(0, named=True)["detail"]
                label = f"{system} ({status}: {detail})" if detail else f"{system} ({status})"
            lines.append(f"{trajectory_id} {label}: {'; '.join(top['shown'].head(codes).to_list())}")
    return lines


def incomplete_lists(statuses: pl.DataFrame, systems: tuple[str, ...]) -> str:
    """The lists that are not `ok`, per system in the order given, e.g. `direct 1 failed`; empty when all are.

    The patient artifact's table has no column for a system without codes, so its description says so.
    """
    counts = {(system, status): n for system, status, n in statuses.group_by("system", "status").len().iter_rows()}
    parts = []
    for system in systems:
        found = [f"{counts[system, status]} {status}" for status in ("short", "failed") if (system, status) in counts]
        if found:
            parts.append(f"{system} {', '.join(found)}")
    return "; ".join(parts)


def ranking_table(rankings: pl.DataFrame, systems: tuple[str, ...]) -> list[dict]:
    """One row per (trajectory, rank) with a column per system, in the order given: the Prefect artifact."""
    wide = rankings.pivot(on="system", index=["trajectory_id", "rank"], values="shown").sort("trajectory_id", "rank")
    return wide.select("trajectory_id", "rank", *[s for s in systems if s in wide.columns]).to_dicts()


def headline_markdown(wh: Warehouse, run_id: str, report: str, k: int = ARTIFACT_K) -> str:
    """The report's system table at K = k (all codes), under the run id and the report's path."""
    table = system_table(wh.read("metrics", run_id=run_id), wh.read("evaluation_coverage", run_id=run_id), k)
    return to_markdown([Paragraph(f"Run `{run_id}`, K = {k}, all codes; report: `{report}`"), table])


def artifact_key(prefix: str, name: str) -> str:
    """A Prefect artifact key (lower-case letters, digits and dashes) for a cohort or patient name."""
    return f"{prefix}-{re.sub(r'[^a-z0-9-]+', '-', name.lower()).strip('-')}"
