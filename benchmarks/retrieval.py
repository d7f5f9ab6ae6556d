"""Retrieval benchmark: BM25 vs dense vs hybrid (RRF) on PubMedQA and MedQuAD.

PubMedQA (`ori_pqal.json`): the 1,000 abstracts are indexed (questions are not); each question must
retrieve its own abstract. MedQuAD: only the answers are indexed (never the question strings or the
focus titles); each question must retrieve its own document. Metrics: R@1, R@5, R@10, MRR (over the
top 100 documents), p50/p95 query latency (query embedding and passage extraction included).
The latency target is measured on the combined MedQuAD + PubMedQA index plus a lexical ICD lookup
per query. Embeddings are computed once and cached with the indexes (a rerun re-embeds nothing).

    python benchmarks/retrieval.py [--max-queries N] [--out benchmarks/results/retrieval.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.corpus.documents import dedupe  # noqa: E402
from tools.corpus.json_sources import read_medquad, read_pubmedqa  # noqa: E402
from tools.dictionary import icd_documents, load_vocabulary  # noqa: E402
from tools.embeddings import make_embedder  # noqa: E402
from tools.index import MODES, CorpusIndex, build_index, chunk_frame  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "corpora"
PUBMEDQA = DATA / "pubmedqa" / "ori_pqal.json"
MEDQUAD = DATA / "medquad" / "medquad_docs_with_answers.json.gz"
DEPTH = 100


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


def evaluate(index: CorpusIndex, queries, mode: str, extra=None, dense_weight: float = 1.0) -> dict:
    ranks, latencies = [], []
    for question, gold in queries:
        started = time.perf_counter()
        hits = index.search(question, k=DEPTH, mode=mode, depth=DEPTH, with_passages=False,
                            dense_weight=dense_weight)
        # Agents get passages for the top 10 only; count that work in the latency.
        for hit in hits[:10]:
            index.passage(question, hit)
        if extra is not None:
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
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of bm25,dense,hybrid")
    parser.add_argument("--dense-weight", type=float, default=1.0, help="weight of the dense ranking in RRF")
    args = parser.parse_args()
    if not PUBMEDQA.exists() or not MEDQUAD.exists():
        sys.exit(f"benchmark data not found under {DATA}")
    embedder = make_embedder()
    modes = [m for m in args.modes.split(",") if m]
    results = {"embedder": embedder.name, "dense_weight": args.dense_weight, "benchmarks": {}, "indexes": {}}
    tasks = {"pubmedqa": pubmedqa_task(), "medquad": medquad_task()}
    for name, (documents, queries) in tasks.items():
        directory = args.index_dir / name
        print(f"[{name}] {len(documents)} documents, {len(queries)} questions; building index ...", flush=True)
        manifest = build_index(chunk_frame(documents), directory, embedder, index_titles=False, name=name)
        results["indexes"][name] = manifest
        index = CorpusIndex(directory, embedder)
        chosen = queries[: args.max_queries] if args.max_queries else queries
        results["benchmarks"][name] = {}
        for mode in modes:
            results["benchmarks"][name][mode] = evaluate(index, chosen, mode, dense_weight=args.dense_weight)
            print(f"[{name}] {mode}: {results['benchmarks'][name][mode]}", flush=True)

    print("[combined] building MedQuAD + PubMedQA index (embeddings reused) and the lexical ICD index ...", flush=True)
    combined_docs = tasks["medquad"][0] + tasks["pubmedqa"][0]
    combined_dir = args.index_dir / "combined"
    results["indexes"]["combined"] = build_index(
        chunk_frame(combined_docs), combined_dir, embedder, index_titles=False, name="combined",
        share_embeddings_with=[args.index_dir / "medquad", args.index_dir / "pubmedqa"])
    icd_dir = args.index_dir / "icd"
    results["indexes"]["icd"] = build_index(chunk_frame(icd_documents(*load_vocabulary())), icd_dir, None, name="icd")
    combined, icd = CorpusIndex(combined_dir, embedder), CorpusIndex(icd_dir)
    sample = [q for name in tasks for q in tasks[name][1][:500]]
    results["combined_latency"] = {
        mode: evaluate(combined, sample, mode, extra=lambda q: icd.search(q, k=5, mode="bm25"),
                       dense_weight=args.dense_weight) for mode in modes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print_table(results)
    print(f"\nwrote {args.out}")


def print_table(results: dict) -> None:
    print(f"\n{'benchmark':<10} {'mode':<7} {'n':>6} {'R@1':>6} {'R@5':>6} {'R@10':>6} {'MRR':>6} {'p50 ms':>7} {'p95 ms':>7}")
    rows = [(b, m, r) for b, by_mode in results["benchmarks"].items() for m, r in by_mode.items()]
    rows += [("combined", m, r) for m, r in results["combined_latency"].items()]
    for bench, mode, r in rows:
        print(f"{bench:<10} {mode:<7} {r['n_queries']:>6} {r['R@1']:>6.3f} {r['R@5']:>6.3f} {r['R@10']:>6.3f} "
              f"{r['MRR']:>6.3f} {r['p50_ms']:>7.1f} {r['p95_ms']:>7.1f}")
    print(f"\n{'index':<10} {'docs':>7} {'chunks':>7} {'embedded':>8} {'build s':>8} {'MB':>7}")
    for name, m in results["indexes"].items():
        print(f"{name:<10} {m['n_documents']:>7} {m['n_chunks']:>7} {m['embedded']:>8} {m['build_seconds']:>8.1f} "
              f"{m['bytes'] / 1e6:>7.1f}")


if __name__ == "__main__":
    main()
