"""Retrieval benchmark: BM25 vs dense vs hybrid fusion on PubMedQA and MedQuAD, dev/test protocol.

PubMedQA (`ori_pqal.json`): the 1,000 abstracts are indexed without their titles (a PubMedQA title is its
question); each question must retrieve its own abstract. MedQuAD: only the answers are indexed (never the
question strings or the focus titles); each question must retrieve its own document. Metrics: R@1, R@5,
R@10, MRR (over the top 100 documents).

Protocol: every question goes to the dev or the test half by a stable hash of its gold document id
(all questions about one document land in the same half). The fusion (family and dense share) is
chosen on the dev halves of BOTH benchmarks jointly from the fixed grid `GRID`, by the target itself:
the largest mean (over the two benchmarks) of hybrid R@10 minus the better single retriever's R@10,
ties to the larger mean MRR. The product default (`tools.index.DEFAULT_FUSION`, `DEFAULT_DENSE_SHARE`)
is reported on the test halves and on the full sets, and the script says whether the dev choice
equals it. Retrieval runs once per question; every fusion ranks those same two lists with the
product's `rank_documents` (the first questions are cross-checked against `CorpusIndex.search`).

Latency (the target): p50/p95 of `CorpusIndex.search` end to end (query embedding, both retrievers,
fusion, focused passages for the top 10) on one index over MedQuAD + PubMedQA chunks, plus a BM25
lookup in the lexical ICD index per query. Embeddings are computed once and cached with the indexes.

A run holds the build locks of all its indexes from its start, so a second run on the same `--index-dir` is
refused at once.

    python benchmarks/retrieval.py [--max-queries N] [--out benchmarks/results/retrieval.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import write_result  # noqa: E402
from dxr.errors import InputError  # noqa: E402
from tools.corpus.documents import dedupe  # noqa: E402
from tools.corpus.json_sources import read_medquad, read_pubmedqa  # noqa: E402
from tools.dictionary import icd_documents, load_vocabulary  # noqa: E402
from tools.embeddings import make_embedder  # noqa: E402
from tools.index import (DEFAULT_DENSE_SHARE, DEFAULT_FUSION, CorpusIndex, building_index, chunk_frame,  # noqa: E402
                         rank_documents)

DATA = ROOT.parent / "shared" / "data" / "corpora"
PUBMEDQA = DATA / "pubmedqa" / "ori_pqal.json"
MEDQUAD = DATA / "medquad" / "medquad_docs_with_answers.json.gz"
DEPTH = 100
# Dense share of the fusion weight; 0.5 weighs both retrievers alike (plain RRF for `rrf`).
SHARES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
GRID = [(fusion, share) for fusion in ("zscore", "minmax", "rrf") for share in SHARES]
CROSS_CHECKED = 50
INDEXES = ("pubmedqa", "medquad", "combined", "icd")  # the indexes it builds under --index-dir


def say(line: str) -> None:
    """A progress line on stderr, at once, as `dxr corpus build` prints its own: stdout holds the tables alone."""
    print(line, file=sys.stderr, flush=True)


def split_of(gold_doc_id: str) -> str:
    """dev or test by the first byte of sha256(gold document id): stable across runs and machines."""
    return "dev" if hashlib.sha256(gold_doc_id.encode()).digest()[0] % 2 == 0 else "test"


def pubmedqa_task():
    documents = list(read_pubmedqa(PUBMEDQA, "pubmedqa"))
    raw = json.loads(PUBMEDQA.read_text())
    queries = [(record["QUESTION"], f"pmid:{pmid}") for pmid, record in raw.items()]
    return documents, queries


def medquad_task():
    import gzip

    documents = list(read_medquad(MEDQUAD, "medquad"))
    kept, dropped = dedupe(documents)
    alias = dict(dropped)
    raw = json.load(gzip.open(MEDQUAD, "rt", encoding="utf-8"))
    queries = []
    for record, doc in zip(raw, documents):  # the adapter yields documents in file order
        for item in record["qa"]:
            if item.get("question") and item.get("answer"):
                queries.append((item["question"], alias.get(doc.doc_id, doc.doc_id)))
    return kept, queries


def retrieve_all(index: CorpusIndex, queries, name: str) -> list[tuple[str, dict, dict]]:
    """(gold, lexical, dense) per question: both retrievers' document lists, retrieved once."""
    retrieved = []
    for i, (question, gold) in enumerate(queries, 1):
        lexical, dense = index.retrieve(question, "hybrid", DEPTH)
        retrieved.append((gold, lexical, dense))
        if i <= CROSS_CHECKED:
            searched = [h.doc_id for h in index.search(question, k=DEPTH, depth=DEPTH, with_passages=False)]
            offline = [doc for doc, _ in rank_documents(lexical, dense)][:DEPTH]
            assert searched == offline, f"{name} question {i}: search() and rank_documents() disagree"
        if i % 2000 == 0:
            say(f"[{name}] retrieved {i}/{len(queries)}")
    return retrieved


def quality(retrieved, mode: str, fusion: str = DEFAULT_FUSION, dense_share: float = DEFAULT_DENSE_SHARE,
            split: str | None = None) -> dict:
    ranks = []
    for gold, lexical, dense in retrieved:
        if split and split_of(gold) != split:
            continue
        ranked = [doc for doc, _ in rank_documents(lexical, dense, mode, fusion, dense_share)][:DEPTH]
        ranks.append(ranked.index(gold) + 1 if gold in ranked else None)
    n = len(ranks)
    return {
        "n_queries": n,
        **{f"R@{k}": round(sum(1 for r in ranks if r and r <= k) / n, 4) for k in (1, 5, 10)},
        "MRR": round(sum(1 / r for r in ranks if r) / n, 4),
    }


def top10(retrieved, mode: str, split: str | None) -> list[bool]:
    """Per question (in order, of `split` or all): is the gold document among the product's top 10?"""
    return [gold in [doc for doc, _ in rank_documents(lexical, dense, mode)][:10]
            for gold, lexical, dense in retrieved if not split or split_of(gold) == split]


def paired_r10(retrieved, split: str | None) -> dict:
    """Discordant questions at R@10, hybrid (product default) against each single retriever: the
    exact evidence behind a difference of a few questions."""
    hybrid = top10(retrieved, "hybrid", split)
    pairs = {}
    for mode in ("bm25", "dense"):
        single = top10(retrieved, mode, split)
        pairs[f"vs {mode}"] = {"hybrid_only": sum(h and not s for h, s in zip(hybrid, single)),
                               "single_only": sum(s and not h for h, s in zip(hybrid, single))}
    return pairs


def select_on_dev(retrieved_by_benchmark: dict) -> tuple[list[dict], dict]:
    """Every grid setting on the dev halves; the chosen one by the target (see the module doc)."""
    best_single = {name: max(quality(r, mode, split="dev")["R@10"] for mode in ("bm25", "dense"))
                   for name, r in retrieved_by_benchmark.items()}
    rows = []
    for fusion, share in GRID:
        dev = {name: quality(r, "hybrid", fusion, share, split="dev") for name, r in retrieved_by_benchmark.items()}
        margins = {name: round(dev[name]["R@10"] - best_single[name], 4) for name in dev}
        rows.append({"fusion": fusion, "dense_share": share, "dev": dev, "dev_R@10_margin": margins,
                     "mean_margin": sum(margins.values()) / len(margins),
                     "mean_MRR": sum(d["MRR"] for d in dev.values()) / len(dev)})
        say(f"[dev] {fusion:<6} share {share:.1f}: " + ", ".join(
            f"{name} R@10 {dev[name]['R@10']:.4f} (margin {margins[name]:+.4f}) MRR {dev[name]['MRR']:.4f}"
            for name in dev))
    chosen = max(rows, key=lambda row: (round(row["mean_margin"], 6), round(row["mean_MRR"], 6)))
    return rows, {"fusion": chosen["fusion"], "dense_share": chosen["dense_share"]}


def latency(index: CorpusIndex, queries, mode: str, extra) -> dict:
    ranks, latencies = [], []
    for question, gold in queries:
        started = time.perf_counter()
        hits = index.search(question, k=DEPTH, mode=mode, depth=DEPTH, with_passages=False)
        # Agents get passages for the top 10 only; count that work in the latency.
        for hit in hits[:10]:
            index.passage(question, hit)
        extra(question)
        latencies.append((time.perf_counter() - started) * 1000)
        ranks.append(next((h.rank for h in hits if h.doc_id == gold), None))
    n = len(ranks)
    return {
        "n_queries": n,
        **{f"R@{k}": round(sum(1 for r in ranks if r and r <= k) / n, 4) for k in (1, 5, 10)},
        "MRR": round(sum(1 / r for r in ranks if r) / n, 4),
        "p50_ms": round(statistics.median(latencies), 2),
        "p95_ms": round(statistics.quantiles(latencies, n=20)[18], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "retrieval.json")
    parser.add_argument("--index-dir", type=Path, default=ROOT / "benchmarks" / "results" / "indexes")
    parser.add_argument("--max-queries", type=int, default=None, help="evaluate the first N questions per benchmark")
    args = parser.parse_args()
    if not PUBMEDQA.exists() or not MEDQUAD.exists():
        sys.exit(f"benchmark data not found under {DATA}")
    # Every index's build lock first, as `building_index` asks: a second run on the same --index-dir is refused at
    # once, before it reads the benchmarks or loads the embedding model, not minutes later at one of its builds.
    with ExitStack() as locks:
        try:
            builds = {name: locks.enter_context(building_index(args.index_dir / name)) for name in INDEXES}
        except InputError as exc:
            sys.exit(str(exc))
        measure(args, builds)


def measure(args: argparse.Namespace, builds: dict) -> None:
    """The benchmark proper, its indexes' build locks held (`builds`: index name -> its build)."""
    embedder = make_embedder()
    default = {"fusion": DEFAULT_FUSION, "dense_share": DEFAULT_DENSE_SHARE}
    results = {"embedder": embedder.name, "product_default": default, "benchmarks": {}, "indexes": {},
               "load_average": {"start": os.getloadavg()}}
    tasks = {"pubmedqa": pubmedqa_task(), "medquad": medquad_task()}
    retrieved = {}
    for name, (documents, queries) in tasks.items():
        directory = args.index_dir / name
        say(f"[{name}] {len(documents)} documents, {len(queries)} questions; building index ...")
        results["indexes"][name] = builds[name](chunk_frame(documents), embedder, index_titles=False, name=name)
        chosen = queries[: args.max_queries] if args.max_queries else queries
        retrieved[name] = retrieve_all(CorpusIndex(directory, embedder), chosen, name)
        if {split_of(gold) for _, gold in chosen} != {"dev", "test"}:
            sys.exit(f"the first {len(chosen)} {name} questions leave its dev or test half empty: "
                     "raise --max-queries")

    grid, selected = select_on_dev(retrieved)
    results["selection"] = {"grid": grid, "chosen_on_dev": selected, "equals_product_default": selected == default}
    say(f"[dev] chosen: {selected}; product default: {default}")
    reported = {"bm25": ("bm25", DEFAULT_FUSION, DEFAULT_DENSE_SHARE),
                "dense": ("dense", DEFAULT_FUSION, DEFAULT_DENSE_SHARE),
                f"hybrid {DEFAULT_FUSION} {DEFAULT_DENSE_SHARE}": ("hybrid", DEFAULT_FUSION, DEFAULT_DENSE_SHARE),
                "hybrid rrf 0.5 (previous default)": ("hybrid", "rrf", 0.5)}
    if selected != default:
        reported[f"hybrid {selected['fusion']} {selected['dense_share']} (dev choice)"] = (
            "hybrid", selected["fusion"], selected["dense_share"])
    for name, r in retrieved.items():
        results["benchmarks"][name] = {
            split: {label: quality(r, mode, fusion, share, split=None if split == "full" else split)
                    for label, (mode, fusion, share) in reported.items()}
            for split in ("dev", "test", "full")}
        results.setdefault("paired_R@10", {})[name] = {
            split: paired_r10(r, None if split == "full" else split) for split in ("dev", "test", "full")}

    say("[combined] building MedQuAD + PubMedQA index (embeddings reused) and the lexical ICD index ...")
    combined_docs = tasks["medquad"][0] + tasks["pubmedqa"][0]
    combined_dir = args.index_dir / "combined"
    results["indexes"]["combined"] = builds["combined"](
        chunk_frame(combined_docs), embedder, index_titles=False, name="combined",
        share_embeddings_with=[args.index_dir / "medquad", args.index_dir / "pubmedqa"])
    icd_dir = args.index_dir / "icd"
    results["indexes"]["icd"] = builds["icd"](chunk_frame(icd_documents(*load_vocabulary())), None, name="icd")
    combined, icd = CorpusIndex(combined_dir, embedder), CorpusIndex(icd_dir)
    sample = [q for name in tasks for q in tasks[name][1][:500]]
    results["load_average"]["before_latency"] = os.getloadavg()
    results["combined_latency"] = {
        mode: latency(combined, sample, mode, extra=lambda q: icd.search(q, k=5, mode="bm25"))
        for mode in ("bm25", "dense", "hybrid")}
    results["load_average"]["end"] = os.getloadavg()
    print_tables(results)
    print()
    write_result(args.out, results)


def print_tables(results: dict) -> None:
    chosen = results["selection"]["chosen_on_dev"]
    print(f"\nchosen on dev: {chosen['fusion']} dense share {chosen['dense_share']} "
          f"(product default {results['product_default']}, equal: {results['selection']['equals_product_default']})")
    print(f"\n{'benchmark':<9} {'split':<5} {'method':<34} {'n':>6} {'R@1':>6} {'R@5':>6} {'R@10':>6} {'MRR':>6}")
    for bench, by_split in results["benchmarks"].items():
        for split, by_method in by_split.items():
            for method, r in by_method.items():
                print(f"{bench:<9} {split:<5} {method:<34} {r['n_queries']:>6} {r['R@1']:>6.3f} {r['R@5']:>6.3f} "
                      f"{r['R@10']:>6.3f} {r['MRR']:>6.3f}")
    print("\nR@10 discordant questions, hybrid default vs each single retriever (hybrid only / single only)")
    for bench, by_split in results["paired_R@10"].items():
        for split, pairs in by_split.items():
            print(f"{bench:<9} {split:<5} " + "  ".join(
                f"{versus}: {c['hybrid_only']} / {c['single_only']}" for versus, c in pairs.items()))
    print(f"\ncombined + ICD lookup (load average before/after {results['load_average']['before_latency'][0]:.1f}"
          f"/{results['load_average']['end'][0]:.1f})")
    print(f"{'mode':<7} {'n':>6} {'R@1':>6} {'R@10':>6} {'MRR':>6} {'p50 ms':>7} {'p95 ms':>7}")
    for mode, r in results["combined_latency"].items():
        print(f"{mode:<7} {r['n_queries']:>6} {r['R@1']:>6.3f} {r['R@10']:>6.3f} {r['MRR']:>6.3f} "
              f"{r['p50_ms']:>7.1f} {r['p95_ms']:>7.1f}")
    print(f"\n{'index':<10} {'docs':>7} {'chunks':>7} {'embedded':>8} {'build s':>8} {'MB':>7}")
    for name, m in results["indexes"].items():
        print(f"{name:<10} {m['n_documents']:>7} {m['n_chunks']:>7} {m['embedded']:>8} {m['build_seconds']:>8.1f} "
              f"{m['bytes'] / 1e6:>7.1f}")


if __name__ == "__main__":
    main()
