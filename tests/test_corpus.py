"""Corpus ingestion, chunking, dedupe, the BM25 + dense index, RRF, passages, the dictionary, the CLI."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from conftest import build_index, parquet_writes_failing_from, shared_data
from dxr.errors import InputError
from tools.corpus import ingest, load_documents, read_documents, source_key
from tools.corpus.documents import Document, chunk_document, dedupe, normalize_url, stable_doc_id
from tools.corpus.json_sources import read_jsonl, read_medquad, read_pubmedqa
from tools.corpus.xml_sources import read_jats, read_medline
from tools.dictionary import Dictionary, icd_documents
from tools.index import (DEFAULT_DENSE_SHARE, DEFAULT_FUSION, CorpusIndex, chunk_frame, fuse_documents,
                         minmax_normalize, rank_documents, reciprocal_rank_fusion, score_fusion, zscore_normalize)
from tools.ledger import support_cue
from tools.passages import focused_passage
from tools.text import words


@pytest.fixture(scope="module")
def embedder():
    from tools.embeddings import make_embedder

    return make_embedder()


def doc(native: str, title: str, text: str, **ids) -> Document:
    return Document(stable_doc_id("tiny", native, **ids), "tiny", "jsonl", title, [("Text", text)], **ids)


TINY = [
    doc("ckd", "Chronic kidney disease", "Chronic kidney disease progresses to end-stage renal failure; many patients "
        "start dialysis within five years. Anemia of chronic kidney disease is common."),
    doc("af", "Atrial fibrillation", "Atrial fibrillation recurs after catheter ablation in a third of patients. "
        "Anticoagulation lowers stroke risk."),
    doc("hf", "Heart failure", "Heart failure readmission within thirty days is frequent. Loop diuretics relieve "
        "congestion."),
    doc("copd", "COPD", "Chronic obstructive pulmonary disease exacerbations follow viral infections; inhaled "
        "corticosteroids reduce exacerbations."),
]


# ---- real files ---------------------------------------------------------------------------------

def test_real_jats_samples():
    files = sorted(shared_data("corpora", "samples").glob("*.nxml"))
    documents = [d for f in files for d in read_jats(f, "pmc")]
    assert len(documents) == 8
    first = next(d for d in documents if d.pmcid == "1790863")
    assert first.doc_id == "pmc:PMC1790863"
    assert first.title == "Quantifying Organismal Complexity using a Population Genetic Approach"
    assert (first.doi, first.pmid) == ("10.1371/journal.pone.0000217", "17299597")
    assert first.sections[0][0] == "Abstract" and len(first.sections) > 3
    assert all(len(d.text) > 5000 for d in documents)


def test_real_medline_sample():
    path = shared_data("corpora", "samples", "medline16n0902.xml.gz")
    records = list(read_medline(path, "medline"))
    assert [(d.doc_id, d.meta) for d in records if "withdrawn" in d.meta] == [
        ("pmid:26432306", {"withdrawn": "deleted"})]
    documents = [d for d in records if "withdrawn" not in d.meta]
    # Counted in the XML itself: one <MedlineCitation> per document, one <Abstract> per citation that has one.
    xml = gzip.open(path, "rt").read()
    assert len(documents) == xml.count("<MedlineCitation ") == 604
    assert documents[0].doc_id == "pmid:17942999"
    assert documents[0].sections[0][1].startswith("PURPOSE: An auditory electrophysiological study")
    assert sum(1 for d in documents if d.sections) == xml.count("<Abstract>") == 526  # citations with an abstract


def test_ingest_counts_documents_without_text(wh):
    summary = ingest(wh, "medline", shared_data("corpora", "samples", "medline16n0902.xml.gz"))
    assert (summary.documents, summary.without_text) == (604, 604 - 526)  # titles only: kept, not searchable
    # The update file's <DeleteCitation> names PMID 26432306, a citation of its baseline that the file does not
    # hold: nothing of the 604 was left out, and the summary says so instead of counting it as withdrawn.
    assert (summary.withdrawn, summary.unmatched_deletions) == (0, 1)


def citation(pmid: str, title: str, abstract: str = "", extra: str = "") -> str:
    text = f"<Abstract><AbstractText>{abstract}</AbstractText></Abstract>" if abstract else ""
    return (f"<MedlineCitation><PMID Version=\"1\">{pmid}</PMID><Article><ArticleTitle>{title}</ArticleTitle>"
            f"{text}{extra}</Article></MedlineCitation>")


def test_medline_update_files_revise_delete_and_retract_citations(tmp_path, wh):
    # MEDLINE is a baseline plus update files (read in name order): an update carries the new version of a
    # citation, <DeleteCitation> removes one, and a retraction comes as a revision typed 'Retracted Publication'.
    (tmp_path / "medline16n0001.xml").write_text(
        "<MedlineCitationSet>" + citation("1", "Aspirin and stroke.", "Old abstract.")
        + citation("2", "Statins.", "Lipids fell.") + citation("3", "Vitamin D.", "Falls fell.")
        + citation("4", "", "Le texte.", "<VernacularTitle>Le titre.</VernacularTitle>") + "</MedlineCitationSet>")
    (tmp_path / "medline16n0902.xml").write_text(
        "<MedlineCitationSet>" + citation("1", "Aspirin and stroke.", "Revised abstract.")
        + citation("3", "Vitamin D.", "Falls fell.", "<PublicationTypeList><PublicationType>Retracted Publication"
                   "</PublicationType></PublicationTypeList>")
        + "<DeleteCitation><PMID Version=\"1\">2</PMID><PMID Version=\"1\">9</PMID></DeleteCitation>"
        + "</MedlineCitationSet>")
    summary = ingest(wh, "medline", tmp_path)
    # PMID 9 is in neither file: its deletion removed nothing and is counted apart.
    assert (summary.documents, summary.withdrawn, summary.unmatched_deletions, summary.duplicates) == (2, 2, 1, 0)
    stored = wh.read("documents").sort("doc_id")
    assert stored.select("doc_id", "title", "sections_json").rows() == [
        ("pmid:1", "Aspirin and stroke.", '[["Abstract", "Revised abstract."]]'),
        ("pmid:4", "Le titre.", '[["Abstract", "Le texte."]]')]
    assert wh.read("chunks")["text"].sort().to_list() == ["Le texte.", "Revised abstract."]
    from dxr.cli import main

    data = ["--data-dir", str(tmp_path / "wh")]
    result = CliRunner().invoke(main, [*data, "corpus", "ingest", "medline", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(": 2 documents (0 duplicates dropped, 2 deleted or retracted: left out, 1 deleted "
                                  "PMID(s) not in these files: nothing removed (ingest an update in one directory "
                                  "with its baseline)), 2 chunks\n")


def jsonl_corpus(path, documents: list[Document]) -> None:
    path.write_text("".join(json.dumps({"id": d.doc_id.split(":")[1], "title": d.title, "text": d.text}) + "\n"
                            for d in documents))


def corpus_rows(warehouse) -> tuple[list, list]:
    """Every documents row (but its ingestion time) and every chunks row, sorted."""
    return (sorted(warehouse.read("documents").drop("ingested_at").rows()), sorted(warehouse.read("chunks").rows()))


def test_an_ingest_killed_between_the_documents_and_chunks_writes_leaves_them_in_step(tmp_path, wh, monkeypatch):
    import os

    import warehouse.store as store
    from warehouse.store import Warehouse

    source, other = tmp_path / "tiny.jsonl", tmp_path / "other.jsonl"
    jsonl_corpus(source, TINY[:2])
    ingest(wh, "jsonl", source)
    before = corpus_rows(wh)
    jsonl_corpus(source, TINY[1:])  # the file is updated and ingested again
    jsonl_corpus(other, TINY[:1])
    clean = Warehouse(tmp_path / "clean")
    for path in (other, source):
        ingest(clean, "jsonl", path)
    parquet_writes_failing_from(monkeypatch, 2, KeyboardInterrupt("killed after the documents file was written"))
    with pytest.raises(KeyboardInterrupt):
        ingest(wh, "jsonl", source)
    monkeypatch.undo()
    assert corpus_rows(wh) == before  # not the new documents beside the old chunks
    assert list((wh.forecast_dir / store.COMMIT_DIR).iterdir()) == []

    def killed_between_the_renames(src, dst):
        if "chunks" in Path(dst).parts:
            raise KeyboardInterrupt("killed after the documents file was renamed into place")
        return real_replace(src, dst)

    real_replace = os.replace
    monkeypatch.setattr(store.os, "replace", killed_between_the_renames)
    with pytest.raises(KeyboardInterrupt):
        ingest(wh, "jsonl", source)
    monkeypatch.undo()
    # The commit was made: the next ingest of any path finishes it before its own.
    ingest(wh, "jsonl", other)
    assert corpus_rows(wh) == corpus_rows(clean)
    assert list((wh.forecast_dir / store.COMMIT_DIR).iterdir()) == []
    ingest(wh, "jsonl", source)
    assert corpus_rows(wh) == corpus_rows(clean)


@contextmanager
def process_holding(program: str):
    """A child Python process running `program`, which prints 'reading' once it holds its lock; killed at the end
    (the kernel drops the lock with it)."""
    child = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "reading"
        yield
    finally:
        child.kill()
        child.wait(timeout=30)


def paused_ingest(wh, source: Path, corpus: str) -> str:
    """A program ingesting `source` into `corpus` that stops for a minute once it holds the corpus's lock."""
    return ("import time; from pathlib import Path\n"
            "from tools.corpus import ingest; from warehouse.store import Warehouse\n"
            "def hold(file):\n"
            "    print('reading', flush=True); time.sleep(60)\n"
            f"ingest(Warehouse({str(wh.root)!r}), 'jsonl', Path({str(source)!r}), {corpus!r}, progress=hold)")


def test_an_ingest_of_a_corpus_another_process_is_ingesting_is_refused_with_one_line(tmp_path, wh):
    """Two ingests of one path would make concurrent commits of its partitions, whose renames can interleave."""
    from dxr.cli import main

    source = tmp_path / "tiny.jsonl"
    jsonl_corpus(source, TINY)
    with process_holding(paused_ingest(wh, source, "tiny")):
        busy = ("corpus 'tiny' is being ingested or read for an index by another dxr process (dxr corpus ingest or "
                "build): retry when it has finished")
        result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "corpus", "ingest", "jsonl", str(source),
                                           "--corpus", "tiny"])
        assert (result.exit_code, result.output) == (1, f"Error: {busy}\n")
        with pytest.raises(InputError) as refused:
            ingest(wh, "jsonl", source, "tiny")
        assert str(refused.value) == busy
        assert not wh.has_rows("documents", corpus="tiny")
        assert ingest(wh, "jsonl", source, "other").documents == 4  # another corpus meanwhile
    assert ingest(wh, "jsonl", source, "tiny").documents == 4  # the kernel dropped the lock with its holder


def test_documents_of_named_corpora_are_read_without_the_other_corpora(tmp_path, wh, monkeypatch):
    # Listing the stored corpora and loading one read the whole `documents` table, every corpus's text included.
    from warehouse.corpora import stored_corpora
    from warehouse.store import Warehouse

    jsonl_corpus(tmp_path / "tiny.jsonl", TINY)
    ingest(wh, "jsonl", tmp_path / "tiny.jsonl", corpus="small")
    ingest(wh, "jsonl", tmp_path / "tiny.jsonl", corpus="other")
    read, reads = Warehouse.read, []

    def recorded(self, table, **keys):
        reads.append((table, keys))
        return read(self, table, **keys)

    monkeypatch.setattr(Warehouse, "read", recorded)
    assert stored_corpora(wh) == ["other", "small"]
    documents = load_documents(wh, ["small"])
    assert {d.corpus for d in documents} == {"small"} and len(documents) == len(TINY)
    assert reads == [("documents", {"corpus": "small"})]
    with pytest.raises(InputError, match="^corpus gone not ingested; ingested corpora: other, small$"):
        load_documents(wh, ["gone", "small"])


def test_corpus_documents_are_sorted_and_read_by_corpus(tmp_path, wh):
    from warehouse.corpora import corpus_documents

    jsonl_corpus(tmp_path / "b.jsonl", TINY[:2])
    jsonl_corpus(tmp_path / "a.jsonl", TINY[2:])
    for path, corpus in ((tmp_path / "b.jsonl", "small"), (tmp_path / "a.jsonl", "small"),
                         (tmp_path / "a.jsonl", "other")):
        ingest(wh, "jsonl", path, corpus=corpus)
    a, b = source_key(tmp_path / "a.jsonl"), source_key(tmp_path / "b.jsonl")
    everything = corpus_documents(wh).select("corpus", "source", "doc_id").rows()
    assert everything == sorted(everything) and len(everything) == len(TINY) + 2  # a.jsonl's two in both corpora
    assert sorted({row[:2] for row in everything}) == [("other", a), ("small", a), ("small", b)]
    assert corpus_documents(wh, ["small"]).select("corpus", "source", "doc_id").rows() == everything[2:]


def test_a_corpus_source_is_replaced_whole_and_alone(tmp_path, wh):
    from tools.corpus import chunks_frame, documents_frame
    from warehouse.corpora import replace_corpus_source

    def replace(source: str, documents: list[Document]) -> None:
        replace_corpus_source(wh, "tiny", source, documents_frame(documents, "tiny", source),
                              chunks_frame(documents, "tiny", source, 1000))

    replace("one", TINY[:3])
    replace("two", TINY[3:])
    replace("one", TINY[:1])  # a smaller second version of source one
    assert sorted(wh.read("documents").select("source", "doc_id").rows()) == sorted(
        [("one", TINY[0].doc_id), ("two", TINY[3].doc_id)])
    assert sorted(wh.read("chunks").select("source", "doc_id").rows()) == sorted(
        [("one", TINY[0].doc_id), ("two", TINY[3].doc_id)])


def test_chunks_unlike_the_stored_ones_are_counted_by_corpus(tmp_path, wh):
    from tools.corpus import chunks_frame, documents_frame, store_documents
    from warehouse.corpora import chunks_unlike_stored

    store_documents(wh, TINY, "tiny", "tiny.jsonl")
    stored = chunks_frame(TINY, "tiny", "tiny.jsonl", 1000)
    page = Document("web:0123", "web", "web", "A page", [("Page", TINY[2].text)], url="https://example.org/hf")
    wh.write("documents", documents_frame([page], "web", "run1-0"), corpus="web", source="run1-0")
    built = pl.concat([
        stored.with_columns(pl.when(pl.col("ordinal") == 0).then(pl.col("text") + " (rechunked)")
                            .otherwise(pl.col("text")).alias("text")),
        stored.head(1).with_columns(pl.lit("tiny:made-up#0").alias("chunk_id")),
        chunks_frame([page], "web", "run1-0", 1000)])  # the web's pages have no chunks rows to differ from
    assert chunks_unlike_stored(wh, stored) == []
    assert chunks_unlike_stored(wh, built) == [("tiny", len(TINY) + 1)]


def test_a_build_reads_no_corpus_an_ingest_is_writing_and_shares_its_corpora_with_other_builds(tmp_path, wh):
    """A build reading `documents` before an ingest's commit and `chunks` after it would index neither state."""
    from dxr.cli import main

    source = tmp_path / "tiny.jsonl"
    jsonl_corpus(source, TINY)
    ingest(wh, "jsonl", source, "tiny")
    data = ["--data-dir", str(wh.root)]
    build = [*data, "corpus", "build", "--lexical-only", "--corpus", "tiny"]
    with process_holding(paused_ingest(wh, source, "tiny")):
        result = CliRunner().invoke(main, [*build, "--run-id", "build-1"])
        assert (result.exit_code, result.output) == (
            1, "Error: corpus 'tiny' is being ingested by another dxr process (dxr corpus ingest): retry when it has "
               "finished\n")
        # Refused before the run was registered: nothing was attempted, so no `failed` build is on record.
        assert not wh.has_rows("runs", run_id="build-1")
    with process_holding(
            "import time; from tools.corpus import reading_corpora; from warehouse.store import Warehouse\n"
            f"with reading_corpora(Warehouse({str(wh.root)!r}), ['tiny']):\n"
            "    print('reading', flush=True); time.sleep(60)\n"):
        result = CliRunner().invoke(main, [*build, "--run-id", "build-1"])
        assert result.exit_code == 0 and "literature: 4 documents, 4 chunks, 0 embedded" in result.stdout, result.output
        assert wh.read("runs", run_id="build-1").select("kind", "status").rows() == [("corpus:build", "finished")]
        result = CliRunner().invoke(main, [*data, "corpus", "ingest", "jsonl", str(source), "--corpus", "tiny"])
        assert (result.exit_code, result.output) == (
            1, "Error: corpus 'tiny' is being ingested or read for an index by another dxr process (dxr corpus ingest "
               "or build): retry when it has finished\n")


def test_real_medquad_and_pubmedqa():
    medquad_path = shared_data("corpora", "medquad", "medquad_docs_with_answers.json.gz")
    medquad = list(read_medquad(medquad_path, "medquad"))
    raw = json.load(gzip.open(medquad_path, "rt"))
    assert len(medquad) == len({d.doc_id for d in medquad}) == len(raw) == 5486  # one document per raw entry
    assert medquad[0].doc_id == "medquad:CancerGov/0000001_1"
    assert medquad[0].title == "Adult Acute Lymphoblastic Leukemia"
    # Question strings never enter a document: only answers, headed by the question type.
    assert raw[0]["qa"][0]["question"] not in medquad[0].text
    assert medquad[0].sections[0][0] == "information"
    pubmedqa_path = shared_data("corpora", "pubmedqa", "ori_pqal.json")
    pubmedqa = list(read_pubmedqa(pubmedqa_path, "pubmedqa"))
    assert len(pubmedqa) == len(json.loads(pubmedqa_path.read_text())) == 1000
    assert pubmedqa[0].doc_id == "pmid:21645374"
    assert [h for h, _ in pubmedqa[0].sections] == ["Background", "Results", "Conclusions"]
    # The question is the article's title (PQA-L takes articles titled by a question): the title, not the text.
    assert pubmedqa[0].title == ("Do mitochondria play a role in remodelling lace plant leaves during programmed "
                                 "cell death?")
    assert "Do mitochondria play a role" not in pubmedqa[0].text
    assert all(d.title.endswith("?") for d in pubmedqa)


def test_real_ingest_into_the_warehouse_embeds_a_handful(wh, tmp_path, embedder):
    summary = ingest(wh, "jats", shared_data("corpora", "samples"))
    assert (summary.corpus, summary.documents, summary.duplicates, summary.without_text) == ("pmc", 8, 0, 0)
    chunks = wh.read("chunks", corpus="pmc")
    assert chunks.height == summary.chunks and chunks["chunk_id"].n_unique() == chunks.height
    again = ingest(wh, "jats", shared_data("corpora", "samples"))  # a rerun replaces its own rows
    assert wh.read("documents").height == 8 and again.chunks == summary.chunks
    documents = load_documents(wh, ["pmc"])
    few = chunk_frame(documents).head(6)
    manifest = build_index(few, tmp_path / "idx", embedder)
    assert (manifest["n_chunks"], manifest["embedded"]) == (6, 6)


JATS_TEXT = """<article xmlns:mml="http://www.w3.org/1998/Math/MathML"><front><article-meta>
<article-id pub-id-type="pmc">42</article-id><title-group><article-title>Stage<break/>at diagnosis</article-title>
</title-group><abstract><sec><title>Background:</title><p>Stage varies.</p></sec></abstract></article-meta></front>
<body><sec><title>Results</title><p>Stage varied (Table 1).<table-wrap><label>Table 1.</label><caption><p>Stage by
cancer</p></caption><table><tr><td>Stage I</td><td>2219</td></tr></table></table-wrap> Age mattered.<fig><caption>
<p>Figure caption</p></caption></fig></p><p>Fitness could be written<disp-formula><alternatives><tex-math>
\\documentclass{minimal}\\begin{document}$f=e^x$\\end{document}</tex-math><mml:math><mml:mi>f</mml:mi></mml:math>
</alternatives></disp-formula>in which<!-- an editor's note -->n is the size.</p>
<list><list-item><p>Adults only.</p></list-item><list-item><p>No prior stroke.</p></list-item></list>
<table-wrap><caption><p>Table at section level</p></caption></table-wrap></sec></body></article>"""


def test_jats_running_text_leaves_out_floats_and_tex_and_keeps_word_boundaries(tmp_path):
    path = tmp_path / "a.nxml"
    path.write_text(JATS_TEXT)
    article = next(read_jats(path, "pmc"))
    assert article.title == "Stage at diagnosis"
    assert article.sections == [
        ("Abstract", "Background: Stage varies."),
        ("Results", "Stage varied (Table 1). Age mattered. Fitness could be written f in which n is the size. "
                    "Adults only. No prior stroke.")]


def test_real_jats_tables_inside_paragraphs_stay_out_of_the_text():
    samples = shared_data("corpora", "samples")
    results = dict(next(read_jats(samples / "mds526.nxml", "pmc")).sections)["results"]
    assert results.startswith("In total, there were 98 942 patients diagnosed with a relevant cancer during the "
                              "study period.")
    assert "Table 1.Distribution" not in results and "2219 45%8595 38%" not in results
    pone = next(read_jats(samples / "pone.0000217.nxml", "pmc")).text
    assert "could be written in which" in pone and "writtenin" not in pone
    bjc = next(read_jats(samples / "6605965a.nxml", "pmc"))
    assert bjc.sections[0][1].startswith("Background: Oral contraceptive use")


# ---- bad input ----------------------------------------------------------------------------------

def test_bad_files_give_one_line_errors(tmp_path):
    broken = tmp_path / "broken.nxml"
    broken.write_text("<article><front>")
    with pytest.raises(InputError, match=r"broken\.nxml: not well-formed XML"):
        list(read_jats(broken, "pmc"))
    no_pmc = tmp_path / "nopmc.nxml"
    no_pmc.write_text('<article><front><article-meta><article-id pub-id-type="doi">10.1/x</article-id>'
                      "</article-meta></front></article>")
    with pytest.raises(InputError, match=r'nopmc\.nxml: <article-meta> has no <article-id pub-id-type="pmc">'):
        list(read_jats(no_pmc, "pmc"))
    medline = tmp_path / "m.xml"
    medline.write_text("<MedlineCitationSet><MedlineCitation><PMID>1</PMID><Article/></MedlineCitation>"
                       "</MedlineCitationSet>")
    with pytest.raises(InputError, match=r"m\.xml: <MedlineCitation> PMID 1 has no <Article>/<ArticleTitle>"):
        list(read_medline(medline, "medline"))
    lines = tmp_path / "x.jsonl"
    lines.write_text('{"id": "a", "text": "fine"}\n{"id": "b"}\n')
    with pytest.raises(InputError, match=r"x\.jsonl:2: missing field 'text'"):
        list(read_jsonl(lines, "x"))
    with pytest.raises(InputError, match=r"medline16n0902\.xml\.gz: no <article> element .* use FORMAT medline"):
        list(read_jats(shared_data("corpora", "samples", "medline16n0902.xml.gz"), "pmc"))


# ---- documents, chunks, dedupe ------------------------------------------------------------------

def test_chunks_respect_size_sections_and_parent_links():
    long = Document("t:1", "t", "jsonl", "T", [("A", "One two three. " * 30), ("B", "Short section.")])
    chunks = chunk_document(long, max_chars=100)
    assert all(len(c.text) <= 100 for c in chunks)
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    assert {c.doc_id for c in chunks} == {"t:1"} and chunks[-1].section == "B" and chunks[-1].text == "Short section."
    assert " ".join(c.text for c in chunks if c.section == "A") == ("One two three. " * 30).strip()


def test_a_word_longer_than_a_chunk_is_split_not_truncated():
    sequence = "ACGT" * 700  # 2,800 characters without a space
    chunks = chunk_document(Document("t:1", "t", "jsonl", "T", [("A", f"Intro. {sequence} tail.")]), max_chars=1000)
    assert [len(c.text) for c in chunks] == [6, 1000, 1000, 800 + len(" tail.")]
    assert "".join(c.text for c in chunks[1:]).removesuffix(" tail.") == sequence


def test_dedupe_by_identifier_then_url_and_title():
    a = Document("pmc:PMC1", "pmc", "jats", "Paper", [], pmcid="1", doi="10.1/A")
    b = Document("doi:10.1/a", "web", "jsonl", "Paper (copy)", [], doi="10.1/a")
    c = Document("x:1", "x", "jsonl", "Same Title!", [], url="https://www.site.org/p/")
    d = Document("x:2", "x", "jsonl", "same title", [], url="http://site.org/p")
    e = Document("x:3", "x", "jsonl", "Other", [], url="http://site.org/p")
    kept, dropped = dedupe([a, b, c, d, e])
    assert [k.doc_id for k in kept] == ["pmc:PMC1", "x:1", "x:3"]
    assert dropped == [("doi:10.1/a", "pmc:PMC1"), ("x:2", "x:1")]
    assert normalize_url("https://www.site.org/p/") == normalize_url("http://site.org/p")



def test_dedupe_keeps_the_document_with_the_most_text(tmp_path, wh):
    # The MEDLINE citation of a PMC article: 'medline' sorts before 'pmc', yet the full text is what to search.
    ingest(wh, "jats", shared_data("corpora", "samples", "pone.0000217.nxml"))
    citation = tmp_path / "m.xml"
    citation.write_text("<MedlineCitationSet><MedlineCitation><PMID>17299597</PMID><Article><ArticleTitle>"
                        "Quantifying organismal complexity.</ArticleTitle></Article></MedlineCitation>"
                        "</MedlineCitationSet>")
    ingest(wh, "medline", citation)
    kept, dropped = dedupe(load_documents(wh, ["medline", "pmc"]))
    assert [d.doc_id for d in kept] == ["pmc:PMC1790863"]
    assert dropped == [("pmid:17299597", "pmc:PMC1790863")]
    short = Document("x:1", "x", "jsonl", "A", [("Text", "Short.")], doi="10.1/a")
    long = Document("x:2", "x", "jsonl", "A", [("Text", "A longer text.")], doi="10.1/A")
    other = Document("x:3", "x", "jsonl", "B", [("Text", "Other.")])
    kept, dropped = dedupe([short, other, long])
    assert ([d.doc_id for d in kept], dropped) == (["x:3", "x:2"], [("x:1", "x:2")])


@pytest.mark.parametrize(("reader", "content", "message"), [
    (read_jsonl, '{"id": {"x": 1}, "text": "t"}\n', r"x:1: field 'id' must be a string or a number, got an object"),
    (read_jsonl, '{"id": "a", "text": ["t"]}\n', r"x:1: field 'text' must be a string, got a list"),
    (read_jsonl, '{"id": "a", "text": "t", "title": 5}\n', r"x:1: field 'title' must be a string, got a number"),
    (read_pubmedqa, '{"7": "text"}', r"x: PMID 7: expected a JSON object with CONTEXTS, got a string"),
    (read_pubmedqa, '{"7": {"CONTEXTS": "one string"}}',
     r"x: PMID 7: field 'CONTEXTS' must be a non-empty list of strings, got a string"),
    (read_pubmedqa, '{"7": {"CONTEXTS": ["a"], "LONG_ANSWER": 1}}', r"field 'LONG_ANSWER' must be a string"),
    (read_pubmedqa, '{"7": {"CONTEXTS": ["a"], "QUESTION": ["q"]}}',
     r"x: PMID 7: field 'QUESTION' must be a string, got a list"),
    (read_medquad, '[{"doc_id": "1", "qa": [1]}]', r"x: document #0 \(unknown/1\): field 'qa' must be a list of"),
    (read_medquad, '[{"doc_id": "1", "qa": [{"answer": 5}]}]',
     r"x: document #0 qa #0: field 'answer' must be a string, got a number"),
])
def test_wrong_json_types_are_one_line_errors(tmp_path, reader, content, message):
    path = tmp_path / "x"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        list(reader(path, "c"))


def test_encodings_and_compression_are_read_by_content(tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"id": "a", "text": "Heart failure."}\n')  # a Windows editor's BOM
    assert [d.doc_id for d in read_jsonl(bom, "c")] == ["c:a"]
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"id": "a", "text": "fine"}\n{"id": "b", "text": "Caf\xe9"}\n')
    with pytest.raises(InputError, match=r"latin1\.jsonl: not UTF-8 at or after line 1 \(invalid continuation "
                                         r"byte, byte 0xe9\); re-encode it as UTF-8"):
        list(read_jsonl(latin1, "c"))
    hidden_gzip = tmp_path / "citations.xml"  # gzip content under a plain name
    hidden_gzip.write_bytes(shared_data("corpora", "samples", "medline16n0902.xml.gz").read_bytes())
    assert len(list(read_medline(hidden_gzip, "medline"))) == 604 + 1  # and its one <DeleteCitation>


def test_empty_files_are_named(tmp_path, wh):
    (tmp_path / "fine.jsonl").write_text('{"id": "a", "text": "Heart failure."}\n')
    (tmp_path / "cut.jsonl").touch()
    with pytest.raises(InputError, match=r"cut\.jsonl: empty file \(0 bytes\); complete the download or remove it"):
        ingest(wh, "jsonl", tmp_path)
    assert not wh.has_rows("documents")

# ---- index, fusion, passages ----------------------------------------------------------------------

def test_rrf_is_exact():
    fused = reciprocal_rank_fusion([["a", "b", "c"], ["c", "a"]], k0=60)
    assert fused == [("a", 1 / 61 + 1 / 62), ("c", 1 / 63 + 1 / 61), ("b", 1 / 62)]


def test_normalizers_by_hand_and_degenerate_lists():
    assert zscore_normalize({"a": 3.0, "b": 1.0}) == {"a": 1.0, "b": -1.0}
    z = zscore_normalize({"c": 0.8, "a": 0.6, "d": 0.4})  # mean 0.6, population std 0.2 * sqrt(2/3)
    assert z == {"c": pytest.approx(1.5 ** 0.5), "a": pytest.approx(0.0), "d": pytest.approx(-(1.5 ** 0.5))}
    assert minmax_normalize({"a": 3.0, "b": 2.0, "c": 1.0}) == {"a": 1.0, "b": 0.5, "c": 0.0}
    for normalize in (zscore_normalize, minmax_normalize):
        assert normalize({}) == {}
        assert normalize({"only": 7.5}) == {"only": 0.0}
        assert normalize({"x": 2.0, "y": 2.0, "z": 2.0}) == {"x": 0.0, "y": 0.0, "z": 0.0}  # no order to keep


def test_score_fusion_by_hand():
    # z: lexical a=+1, b=-1; dense c=+sqrt(1.5), a=0, d=-sqrt(1.5); a missing list scores at its floor.
    fused = score_fusion({"a": 3.0, "b": 1.0}, {"c": 0.8, "a": 0.6, "d": 0.4}, dense_share=0.5)
    root = 1.5 ** 0.5
    assert [doc for doc, _ in fused] == ["a", "c", "b", "d"]  # b and d tie: lexical list first
    assert [score for _, score in fused] == pytest.approx([0.5, -0.5 + 0.5 * root, -0.5 - 0.5 * root,
                                                           -0.5 - 0.5 * root])
    # min-max: lexical a=1, b=0; dense b=1, c=0; a quarter of the weight on dense.
    assert score_fusion({"a": 10.0, "b": 0.0}, {"b": 0.9, "c": 0.5}, 0.25, minmax_normalize) == [
        ("a", 0.75), ("b", 0.25), ("c", 0.0)]
    assert score_fusion({}, {}, 0.7) == []
    only_dense = score_fusion({}, {"x": 0.9, "y": 0.1}, 0.7)
    assert [doc for doc, _ in only_dense] == ["x", "y"] and only_dense[0][1] == pytest.approx(0.7)
    # One document per list: each returned document beats the one its retriever did not return by a unit.
    assert score_fusion({"a": 1.0}, {"b": 0.5}, 0.7) == [("b", pytest.approx(-0.3)), ("a", pytest.approx(-0.7))]
    assert [doc for doc, _ in score_fusion({"a": 1.0}, {"b": 0.5}, 0.5)] == ["a", "b"]  # tie: first seen


@pytest.mark.parametrize("normalize", [zscore_normalize, minmax_normalize])
def test_the_only_document_a_retriever_returned_ranks_above_those_it_did_not(normalize):
    """BM25 matched one document only (a rare term); the dense side ranks it last of three. With most
    of the weight on BM25, it must come first, as it does when BM25 returns a second, weaker match."""
    dense = {"b": 0.9, "c": 0.8, "a": 0.7}
    for lexical in ({"a": 5.0}, {"a": 5.0, "z": 1.0}, {"a": 5.0, "y": 5.0}):
        assert score_fusion(lexical, dense, 0.1, normalize)[0][0] == "a", lexical


def test_fuse_documents_rrf_share_and_bad_settings():
    lexical, dense = {"a": 9.0, "b": 5.0}, {"b": 0.7, "c": 0.6}
    assert fuse_documents(lexical, dense, "rrf", 0.5) == [("b", 0.5 / 62 + 0.5 / 61), ("a", 0.5 / 61),
                                                         ("c", 0.5 / 62)]
    assert [doc for doc, _ in fuse_documents(lexical, dense, "rrf", 0.0)] == ["a", "b", "c"]  # lexical order
    with pytest.raises(InputError, match="unknown fusion 'mean'; choose one of zscore, minmax, rrf"):
        fuse_documents(lexical, dense, "mean")
    with pytest.raises(InputError, match=r"dense_share 2.0 is outside \[0, 1\]"):
        fuse_documents(lexical, dense, "zscore", 2.0)


def test_rank_documents_single_modes_keep_native_scores():
    lexical, dense = {"a": (0, 12.5), "b": (3, 4.0)}, {"b": (2, 0.61), "c": (5, 0.40)}
    assert rank_documents(lexical, dense, "bm25") == [("a", 12.5), ("b", 4.0)]
    assert rank_documents(lexical, dense, "dense") == [("b", 0.61), ("c", 0.40)]
    assert rank_documents(lexical, dense) == fuse_documents({"a": 12.5, "b": 4.0}, {"b": 0.61, "c": 0.40},
                                                            DEFAULT_FUSION, DEFAULT_DENSE_SHARE)


def test_bm25_dense_hybrid_and_embedding_cache(tmp_path, embedder):
    frame = chunk_frame(TINY)
    first = build_index(frame, tmp_path / "idx", embedder)
    assert (first["n_documents"], first["n_chunks"], first["embedded"], first["embeddings_reused"]) == (4, 4, 4, 0)
    second = build_index(frame, tmp_path / "idx", embedder)
    assert (second["embedded"], second["embeddings_reused"]) == (0, 4)  # computed once, cached with the index
    index = CorpusIndex(tmp_path / "idx", embedder)
    for mode in ("bm25", "dense", "hybrid"):
        hits = index.search("dialysis in kidney failure", k=2, mode=mode)
        assert hits[0].doc_id == "tiny:ckd", mode
    hybrid = index.search("recurrence after ablation", k=4)
    assert hybrid[0].doc_id == "tiny:af" and hybrid[0].bm25_rank == 1 and hybrid[0].dense_rank == 1
    lexical, dense = index.retrieve("recurrence after ablation")
    assert [(h.doc_id, h.score) for h in hybrid] == rank_documents(lexical, dense)[:4]
    assert [h.score for h in index.search("recurrence after ablation", k=4, mode="bm25")] == [
        score for _, score in lexical.values()][:4]
    rrf = index.search("recurrence after ablation", k=4, fusion="rrf", dense_share=0.5)
    assert rrf[0].score == pytest.approx(0.5 / 61 + 0.5 / 61)
    assert hybrid[0].passage == "Atrial fibrillation recurs after catheter ablation in a third of patients."
    assert index.search("zzzz qqqq", k=3, mode="bm25") == []
    assert index.resolve(pmcid="PMC999") is None


def test_web_hits_resolve_to_documents_whatever_spelling_the_source_gave_their_ids(tmp_path):
    """A JSONL record may carry a prefixed, versioned arXiv id or a DOI URL; its doc_id is normalized,
    and a web hit naming the plain id must find it (else the page is read instead of the local text)."""
    source = tmp_path / "mixed.jsonl"
    source.write_text("\n".join(json.dumps(record) for record in [
        {"id": "a", "text": "Heart failure readmission.", "arxiv_id": "arXiv:2101.00001v2"},
        {"id": "b", "text": "Kidney disease progression.", "doi": "https://doi.org/10.1000/ABC"},
        {"id": "c", "text": "Sepsis outcomes.", "pmcid": "pmc42", "pmid": " 777 "}]) + "\n")
    build_index(chunk_frame(list(read_jsonl(source, "guidelines"))), tmp_path / "idx")
    index = CorpusIndex(tmp_path / "idx")
    assert index.resolve(arxiv_id="2101.00001") == "arxiv:2101.00001"
    assert index.resolve(doi="10.1000/abc") == index.resolve(doi="doi:10.1000/ABC") == "doi:10.1000/abc"
    assert index.resolve(pmcid="PMC42") == index.resolve(pmcid="42") == "pmc:PMC42"
    assert index.resolve(pmid="777") == "pmc:PMC42"


def tiny_sentence_model(directory, seed: int):
    """A sentence-transformers model small enough to build in a test: same shape for every seed, other
    weights (like a fine-tuned copy of a model: same configuration, same file sizes)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    directory.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted({w for d in TINY for w in words(d.text)})]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=256)
    BertModel(config).save_pretrained(directory)
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    SentenceTransformer(modules=[Transformer(str(directory)), Pooling(8)], device="cpu").save(str(directory))
    return directory


def test_models_in_directories_of_the_same_name_never_share_cached_vectors(tmp_path):
    import shutil

    import numpy as np

    from tools.embeddings import SentenceTransformerEmbedder

    first = SentenceTransformerEmbedder(str(tiny_sentence_model(tmp_path / "a" / "model", seed=1)))
    other = SentenceTransformerEmbedder(str(tiny_sentence_model(tmp_path / "b" / "model", seed=2)))
    shutil.copytree(tmp_path / "a" / "model", tmp_path / "c" / "model")
    copy = SentenceTransformerEmbedder(str(tmp_path / "c" / "model"))
    # The name is the model's contents, not its directory: a copy elsewhere shares it, another model does not.
    assert first.name.startswith("model-") and first.name.endswith("@128")
    assert copy.name == first.name and other.name != first.name
    frame = chunk_frame(TINY)
    inputs = [f"{t}. {x}" for t, x in zip(frame["title"], frame["text"])]
    assert not np.allclose(first.encode(inputs), other.encode(inputs), atol=1e-3)
    build_index(frame, tmp_path / "idx", first)
    reused = build_index(frame, tmp_path / "idx", copy)
    assert (reused["embedded"], reused["embeddings_reused"]) == (0, 4)
    rebuilt = build_index(frame, tmp_path / "idx", other)
    assert (rebuilt["embedded"], rebuilt["embeddings_reused"], rebuilt["embedder"]) == (4, 0, other.name)
    np.testing.assert_allclose(np.load(tmp_path / "idx" / "embeddings.npy"), other.encode(inputs), atol=1e-6)


def test_remote_embedding_models_of_the_same_name_on_two_servers_have_different_keys():
    from tools.embeddings import EmbeddingConfig, make_embedder

    def name(endpoint: str) -> str:
        return make_embedder(EmbeddingConfig(kind="openai", endpoint=endpoint, model="embed")).name

    assert name("http://gpu-a:8000/v1/") == name("http://gpu-a:8000/v1") == "embed@http://gpu-a:8000/v1/embeddings"
    assert name("http://gpu-b:8000/v1") == "embed@http://gpu-b:8000/v1/embeddings"


def test_an_embedding_endpoint_answer_without_one_vector_per_input_is_a_config_error(tmp_path):
    import http.server
    import threading

    from dxr.errors import ConfigError
    from tools.embeddings import EmbeddingConfig, make_embedder

    answers = iter([{"error": {"message": "model 'embed' not found"}},
                    {"data": [{"index": 0, "embedding": [1.0, 0.0]}]}])  # a partial batch

    class Endpoint(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps(next(answers)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        embedder = make_embedder(EmbeddingConfig(kind="openai", endpoint=f"http://127.0.0.1:{server.server_port}/v1",
                                                 model="embed"))
        with pytest.raises(ConfigError, match=r"answered error \{'message': \"model 'embed' not found\"\} for 2 "
                                              r"inputs: check tools.embedding.endpoint"):
            embedder.encode(["heart failure", "dialysis"])
        with pytest.raises(ConfigError, match=r"/v1/embeddings answered 1 embeddings for 4 inputs"):
            build_index(chunk_frame(TINY), tmp_path / "idx", embedder)
    finally:
        server.shutdown()
        server.server_close()
    assert not (tmp_path / "idx").exists()


def test_lexical_only_index_falls_back_to_bm25(tmp_path):
    build_index(chunk_frame(TINY), tmp_path / "lex", None)
    index = CorpusIndex(tmp_path / "lex")
    assert not index.has_dense
    assert [h.doc_id for h in index.search("inhaled corticosteroids", k=1)] == ["tiny:copd"]
    with pytest.raises(InputError, match="has no dense vectors"):
        index.search("x", mode="dense")


def test_parent_expansion_and_focused_passage(tmp_path):
    text = " ".join(f"Sentence {i} is filler about nothing." for i in range(40)) + \
        " Warfarin raises bleeding risk. " + " ".join(f"Tail {i} filler." for i in range(40))
    document = Document("t:long", "t", "jsonl", "Long", [("Body", text)])
    build_index(chunk_frame([document], max_chars=300), tmp_path / "p", None)
    index = CorpusIndex(tmp_path / "p")
    hit = index.search("warfarin bleeding", k=1, mode="bm25", passage_chars=120)[0]
    assert "Warfarin raises bleeding risk." in hit.passage and len(hit.passage) <= 120
    row = index.chunks["chunk_id"].to_list().index(hit.chunk_id)
    expanded = index.expanded_text(row)
    assert len(expanded) > len(index.chunks["text"][row])  # neighbours of the same section joined
    assert focused_passage("dialysis", "No match here. Nor here.", 10) == "No match here."[:10]



def test_the_focused_passage_reads_hyphenated_and_spaced_terms_alike():
    # The support cue is decided on this excerpt and reads 'heart-failure' as 'heart failure': the passage
    # must pick the sentence stating the query's terms in either spelling, not one sharing only its spaced words.
    text = "Heart failure is common in older adults. Readmission within 30-day windows follows heart-failure stays."
    passage = focused_passage("heart failure 30 day readmission", text, 70)
    assert passage == "Readmission within 30-day windows follows heart-failure stays."
    assert support_cue(passage, ["heart failure"], ["30 day readmission"]) == (True, 1.0)


class CountingEmbedder:
    """Deterministic vectors from text; `stop_after` calls, it dies like a killed process would."""

    name = "counting"

    def __init__(self, stop_after: int | None = None):
        self.stop_after, self.calls, self.texts = stop_after, 0, 0

    def encode(self, texts):
        import numpy as np

        if self.stop_after is not None and self.calls >= self.stop_after:
            raise KeyboardInterrupt
        self.calls += 1
        self.texts += len(texts)
        vectors = np.array([[len(t) % 7 + 1.0, len(t) % 5 + 1.0, 1.0] for t in texts], dtype="float32")
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_killed_build_keeps_the_old_index_and_the_rerun_resumes(tmp_path, monkeypatch):
    import tools.index

    monkeypatch.setattr(tools.index, "CHECKPOINT_ROWS", 2)
    build_index(chunk_frame(TINY[:1]), tmp_path / "idx", CountingEmbedder())
    grown = chunk_frame(TINY + [doc(f"extra{i}", f"Extra {i}", f"Extra text number {i}.") for i in range(4)])
    with pytest.raises(KeyboardInterrupt):  # killed after one checkpoint of two embeddings
        build_index(grown, tmp_path / "idx", CountingEmbedder(stop_after=1))
    old = CorpusIndex(tmp_path / "idx")
    assert old.manifest["n_chunks"] == 1 and old.chunks.height == 1
    with pytest.raises(KeyboardInterrupt):  # killed again: the first checkpoint must survive this one
        build_index(grown, tmp_path / "idx", CountingEmbedder(stop_after=1))
    rerun = CountingEmbedder()
    manifest = build_index(grown, tmp_path / "idx", rerun)
    assert rerun.texts == 3 and (manifest["embedded"], manifest["embeddings_reused"]) == (3, 5)
    index = CorpusIndex(tmp_path / "idx", rerun)
    assert index.chunks.height == 8 and index.chunks["chunk_id"].n_unique() == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == [".idx.lock", "idx"]  # no staging left behind
    assert {h.doc_id for h in index.search("extra text number", k=8, mode="bm25")} == {
        f"tiny:extra{i}" for i in range(4)}


class OtherModel(CountingEmbedder):
    name = "other-model"  # same dimension, other vectors: like a model swapped in tools.embedding


def test_dense_search_with_another_embedder_than_the_index_was_built_with_is_refused(tmp_path):
    build_index(chunk_frame(TINY), tmp_path / "idx", CountingEmbedder())
    index = CorpusIndex(tmp_path / "idx", OtherModel())
    for mode in ("dense", "hybrid"):
        with pytest.raises(InputError, match=r"built with embedder counting, not other-model \(tools.embedding\): "
                                             r"rebuild it with `dxr corpus build --name idx --corpus tiny`, or set "
                                             r"tools.embedding back$"):
            index.search("dialysis in kidney failure", mode=mode)
    assert index.search("dialysis in kidney failure", k=1, mode="bm25")[0].doc_id == "tiny:ckd"
    assert CorpusIndex(tmp_path / "idx", CountingEmbedder()).search("dialysis", k=1, mode="dense")


def test_build_is_refused_while_another_build_holds_the_index(tmp_path):
    import fcntl

    (tmp_path / ".idx.lock").touch()
    with open(tmp_path / ".idx.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(InputError, match=r"idx is being built by another process: wait for it to finish"):
            build_index(chunk_frame(TINY), tmp_path / "idx", None)
    assert not (tmp_path / "idx").exists()


def test_a_dense_build_reports_its_progress_at_most_every_few_seconds(tmp_path, monkeypatch):
    """A dense build embeds for minutes: without progress lines a user cannot tell it from a hang; with one line per
    checkpoint (about a second each) it floods the terminal."""
    import tools.index

    monkeypatch.setattr(tools.index, "CHECKPOINT_ROWS", 2)
    grown = chunk_frame(TINY + [doc(f"extra{i}", f"Extra {i}", f"Extra text number {i}.") for i in range(4)])
    lines = []
    monkeypatch.setattr(tools.index, "PROGRESS_SECONDS", 0.0)  # a line after each checkpoint
    build_index(grown.head(6), tmp_path / "idx", CountingEmbedder(), progress=lines.append)
    lines = [line for line in lines if not line.startswith("idx: index")]  # BM25's own (its test is below)
    assert lines[0] == "idx: embedding 6 of 6 chunks"
    assert [line.split(" chunks (")[0] for line in lines[1:]] == [
        "idx: embedded 2/6", "idx: embedded 4/6", "idx: embedded 6/6"]
    assert re.fullmatch(r"idx: embedded 2/6 chunks \(33%\) in \d+ s, [\d,]+ chunks/s, about \d+ s left", lines[1])
    assert re.fullmatch(r"idx: embedded 6/6 chunks \(100%\) in \d+ s, [\d,]+ chunks/s", lines[-1])
    lines.clear()
    monkeypatch.setattr(tools.index, "PROGRESS_SECONDS", 3600.0)  # the four checkpoints of the rest take less
    grown = chunk_frame(TINY + [doc(f"extra{i}", f"Extra {i}", f"Extra text number {i}, again.") for i in range(4)])
    build_index(grown, tmp_path / "idx", CountingEmbedder(), progress=lines.append)
    assert lines[2] == "idx: embedding 4 of 8 chunks (4 reused)" and len(lines) == 4
    assert lines[3].startswith("idx: embedded 4/4 chunks (100%) in ")
    lines.clear()
    build_index(grown, tmp_path / "idx", CountingEmbedder(), progress=lines.append)  # every embedding cached
    assert [line.split(" chunks")[0] for line in lines] == ["idx: indexing 8", "idx: indexed 8/8"]


def test_a_bm25_build_reports_its_progress_at_most_every_few_seconds(tmp_path, monkeypatch):
    """The ICD dictionary's BM25 index takes about 20 s and said nothing meanwhile; it reports as embedding does."""
    import tools.index

    grown = chunk_frame(TINY + [doc(f"extra{i}", f"Extra {i}", f"Extra text number {i}.") for i in range(2)])
    lines = []
    monkeypatch.setattr(tools.index, "PROGRESS_SECONDS", 0.0)  # a line after each chunk
    build_index(grown, tmp_path / "lexical", None, progress=lines.append)
    assert lines[0] == "lexical: indexing 6 chunks for BM25"
    assert [line.split(" chunks (")[0] for line in lines[1:]] == [f"lexical: indexed {n}/6" for n in range(1, 7)]
    assert re.fullmatch(r"lexical: indexed 1/6 chunks \(17%\) in \d+ s, [\d,]+ chunks/s, about \d+ s left", lines[1])
    assert re.fullmatch(r"lexical: indexed 6/6 chunks \(100%\) in \d+ s, [\d,]+ chunks/s", lines[-1])
    lines.clear()
    monkeypatch.setattr(tools.index, "PROGRESS_SECONDS", 3600.0)  # the build takes less: its start and end only
    build_index(grown, tmp_path / "lexical", None, progress=lines.append)
    assert [line.split(" chunks")[0] for line in lines] == ["lexical: indexing 6", "lexical: indexed 6/6"]


def test_an_index_opened_while_a_build_swaps_it_is_read_from_one_build(tmp_path, monkeypatch):
    """A search process opens the index while `dxr corpus build` swaps in a rebuild with as many chunks:
    the parts read must come from one build, never chunks of the old one addressed by the new BM25 rows."""
    build_index(chunk_frame(TINY), tmp_path / "idx", None)
    rebuilt = [doc(f"new{i}", f"New {i}", f"Sarcoidosis granulomas in organ number {i} resolve slowly.")
               for i in range(len(TINY))]
    read_parquet, swaps = pl.read_parquet, []

    def read_then_swap(path, *args, **kwargs):
        frame = read_parquet(path, *args, **kwargs)
        if str(path).endswith("chunks.parquet") and not swaps:
            swaps.append(build_index(chunk_frame(rebuilt), tmp_path / "idx", None))  # lands mid-open
        return frame

    monkeypatch.setattr(pl, "read_parquet", read_then_swap)
    index = CorpusIndex(tmp_path / "idx")
    assert swaps and index.chunks.height == len(TINY)
    hit = index.search("sarcoidosis granulomas organ number 2", k=1)[0]
    assert (hit.doc_id, hit.title) == ("tiny:new2", "New 2") and "organ number 2" in hit.passage


def test_a_rebuild_trades_places_with_the_old_index_in_one_step_where_the_system_can(tmp_path, monkeypatch):
    import tools.index
    from conftest import skip_unless_directories_swap

    skip_unless_directories_swap(tmp_path)

    build_index(chunk_frame(TINY), tmp_path / "idx", None)
    # Not moved aside and then replaced: between those two renames a search found no index at all.
    monkeypatch.setattr(tools.index.os, "replace", lambda *paths: pytest.fail(f"renamed {paths} one after the other"))
    build_index(chunk_frame(TINY[:1]), tmp_path / "idx", None)
    assert CorpusIndex(tmp_path / "idx").chunks.height == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".idx.lock", "idx"]


def test_an_index_whose_parts_disagree_asks_for_a_rebuild(tmp_path):
    build_index(chunk_frame(TINY), tmp_path / "idx", None)
    chunks = pl.read_parquet(tmp_path / "idx" / "chunks.parquet")
    chunks.head(2).write_parquet(tmp_path / "idx" / "chunks.parquet")
    # The command that makes this index again: a plain `dxr corpus build` makes only the default indexes.
    rebuild = "rebuild it with `dxr corpus build --name idx --corpus tiny --lexical-only`$"
    with pytest.raises(InputError, match=r"inconsistent \(chunks\.parquet 2, tantivy 4 rows\): " + rebuild):
        CorpusIndex(tmp_path / "idx")
    (tmp_path / "idx" / "chunks.parquet").unlink()
    with pytest.raises(InputError, match=r"idx is unreadable \(.*\): " + rebuild):
        CorpusIndex(tmp_path / "idx")
    (tmp_path / "idx" / "manifest.json").write_text("{")
    with pytest.raises(InputError, match=r"idx is unreadable \(.*\): rebuild it with "
                                         r"`dxr corpus build --name idx --corpus CORPUS`$"):
        CorpusIndex(tmp_path / "idx")

# ---- ICD dictionary -------------------------------------------------------------------------------

def tiny_vocabulary():
    codes = pl.DataFrame({
        "code": ["DIAGNOSIS//ICD//10//E11", "DIAGNOSIS//ICD//10//E119", "DIAGNOSIS//ICD//9//25000"],
        "icd_version": pl.Series([10, 10, 9], dtype=pl.Int8), "raw_code": ["E11", "E119", "25000"],
        "dotted": ["E11", "E11.9", "250.00"],
        "title": ["Type 2 diabetes mellitus", "Type 2 diabetes mellitus without complications",
                  "Diabetes mellitus without mention of complication, type II"],
        "parent": [None, "DIAGNOSIS//ICD//10//E11", None], "chapter": [None, None, None],
        "billable": [False, True, True]})
    notes = pl.DataFrame({
        "code": ["DIAGNOSIS//ICD//10//E11", "DIAGNOSIS//ICD//10//E119", "DIAGNOSIS//ICD//10//E119"],
        "icd_version": pl.Series([10, 10, 10], dtype=pl.Int8), "kind": ["inclusion_term", "use_additional",
                                                                        "inclusion_term"],
        "text": ["diabetes NOS", "long term (current) use of insulin (Z79.4)", "Type 2 diabetes mellitus NOS"],
        "inherited_from": [None, "DIAGNOSIS//ICD//10//E11", None]})
    return codes, notes


def test_dictionary_definitions_and_lexical_icd_index(tmp_path):
    codes, notes = tiny_vocabulary()
    dictionary = Dictionary(codes, notes)
    definition = dictionary.define("DIAGNOSIS//ICD//10//E119")
    assert (definition.doc_id, definition.title) == ("icd10:E11.9",
                                                     "E11.9 Type 2 diabetes mellitus without complications")
    assert "Use additional code" not in definition.text  # headings are section names, text is the notes
    assert "long term (current) use of insulin (Z79.4) (from E11)" in definition.text
    assert dictionary.define("E11.9", icd_version=10) == definition
    assert dictionary.define("250.00", icd_version=9).doc_id == "icd9:250.00"
    assert dictionary.define("DIAGNOSIS//ICD//10//Z999") is None
    build_index(chunk_frame(icd_documents(codes, notes)), tmp_path / "icd", None, name="icd")
    hits = CorpusIndex(tmp_path / "icd").search("insulin use type 2 diabetes", k=3)
    assert hits[0].doc_id == "icd10:E11.9" and hits[0].engine == "icd"


def test_dictionary_reads_codes_as_written_and_refuses_a_code_without_its_version():
    dictionary = Dictionary(*tiny_vocabulary())
    for written in (" DIAGNOSIS//ICD//10//E11.9", "diagnosis//icd//10//e119\n"):
        assert dictionary.define(written).doc_id == "icd10:E11.9", written
    assert [dictionary.define(c, icd_version=v).doc_id for c, v in [("e11.9 ", 10), ("E11", 10), ("25000", 9)]] == [
        "icd10:E11.9", "icd10:E11", "icd9:250.00"]
    # 'E11.9' names a code only with its version ('E880.9' and 'E88.09' are one undotted string): no silent miss.
    with pytest.raises(InputError, match=r"ICD code 'E11\.9' without its version: pass icd_version=9 or 10, or "
                                         r"the MEDS code \(e\.g\. DIAGNOSIS//ICD//10//E119\)"):
        dictionary.define("E11.9")
    with pytest.raises(InputError, match=r"icd_version 11 of code 'E11\.9': ICD versions are 9 and 10"):
        dictionary.define("E11.9", icd_version=11)


def test_the_icd_index_finds_codes_written_without_their_dot(tmp_path):
    # MEDS codes, and the EHR exports they come from, write ICD codes without the dot (E119, 25000).
    codes, notes = tiny_vocabulary()
    assert [d.sections[0][1] for d in icd_documents(codes, notes)] == [
        "ICD-9-CM 250.00 (25000) Diabetes mellitus without mention of complication, type II",
        "ICD-10-CM E11 Type 2 diabetes mellitus",
        "ICD-10-CM E11.9 (E119) Type 2 diabetes mellitus without complications"]
    build_index(chunk_frame(icd_documents(codes, notes)), tmp_path / "icd", None, name="icd")
    index = CorpusIndex(tmp_path / "icd")
    assert [index.search(code, k=1)[0].doc_id for code in ("E119", "e11.9", "25000", "250.00", "E11")] == [
        "icd10:E11.9", "icd10:E11.9", "icd9:250.00", "icd9:250.00", "icd10:E11"]


@pytest.fixture(scope="module")
def real_icd() -> tuple[pl.DataFrame, pl.DataFrame]:
    """Codes and notes of a few families of the packaged ICD-10-CM and ICD-9-CM."""
    from warehouse import vocab

    families = ("E11", "I50", "E88", "250", "428", "E880")
    codes = pl.concat([vocab.icd10_codes(), vocab.icd9_codes()], how="vertical_relaxed").filter(
        pl.any_horizontal(pl.col("raw_code").str.starts_with(family) for family in families))
    return codes, vocab.icd10_notes().filter(pl.col("code").is_in(codes["code"].implode()))


def test_inherited_notes_name_their_ancestor_dotted(real_icd):
    text = Dictionary(*real_icd).define("DIAGNOSIS//ICD//10//E8801").text
    # Not 'from E880' (ICD-9's accidental fall on stairs): the ancestor is E88.0; a block stays a range.
    assert "disorder of lipoprotein metabolism (E78.-) (from E88.0)" in text and "(from E880)" not in text
    assert "Ehlers-Danlos syndromes (Q79.6-) (from E70-E88)" in text
    assert "(from I50.2)" in Dictionary(*real_icd).define("DIAGNOSIS//ICD//10//I5021").text


def test_a_code_query_answers_the_code_first_then_its_subcodes_in_code_order(tmp_path, real_icd):
    # Every subcode repeats its category's code (its title, the notes it inherits 'from E11'), so BM25 put I50.82
    # above I50, 428.0 below 428.9, and E11 (with more subcodes than the search depth) nowhere.
    build_index(chunk_frame(icd_documents(*real_icd)), tmp_path / "icd", None, name="icd")
    index = CorpusIndex(tmp_path / "icd")

    def top(query: str, k: int) -> list[str]:
        return [hit.doc_id for hit in index.search(query, k=k)]

    for query in ("E11", " e11"):
        assert top(query, 6) == ["icd10:E11", "icd10:E11.0", "icd10:E11.00", "icd10:E11.01", "icd10:E11.1",
                                 "icd10:E11.10"], query
    assert top("I50", 6) == ["icd10:I50", "icd10:I50.1", "icd10:I50.2", "icd10:I50.20", "icd10:I50.21",
                             "icd10:I50.22"]
    for query in ("I50.2", "i502"):
        assert top(query, 5) == ["icd10:I50.2", "icd10:I50.20", "icd10:I50.21", "icd10:I50.22", "icd10:I50.23"], query
    assert top("250", 4) == ["icd9:250", "icd9:250.0", "icd9:250.00", "icd9:250.01"]
    assert top("428", 4) == ["icd9:428", "icd9:428.0", "icd9:428.1", "icd9:428.2"]
    for query in ("428.2", "4282"):
        assert top(query, 5) == ["icd9:428.2", "icd9:428.20", "icd9:428.21", "icd9:428.22", "icd9:428.23"], query
    # Undotted, E880 is ICD-10 E88.0 and ICD-9 E880 (ICD-10 first), each followed by its own subcodes; dotted, one.
    assert top("E880", 6) == ["icd10:E88.0", "icd9:E880", "icd10:E88.01", "icd10:E88.02", "icd10:E88.09",
                              "icd9:E880.0"]
    assert top("E880.1", 1) == ["icd9:E880.1"] and top("E88.01", 1) == ["icd10:E88.01"]
    # Anything else is a plain search.
    assert index.code_matches("E1") == index.code_matches("heart failure") == [] and top("heart failure", 1) == [
        "icd10:I50"]


# ---- CLI ------------------------------------------------------------------------------------------

def test_cli_ingest_build_search(tmp_path, monkeypatch):
    from dxr.cli import main

    monkeypatch.setenv("DXR_TOOLS__EMBEDDING__KIND", "package")
    source = tmp_path / "tiny.jsonl"
    source.write_text("\n".join(json.dumps({"id": d.doc_id.split(":")[1], "title": d.title, "text": d.text})
                                for d in TINY) + "\n")
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "wh")]
    result = runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(source), "--corpus", "tiny"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("corpus tiny source tiny.jsonl-") and result.stdout.endswith(
        ": 4 documents (0 duplicates dropped), 4 chunks\n")
    result = runner.invoke(main, [*data, "corpus", "build", "--lexical-only"])
    assert result.exit_code == 0, result.output
    assert "literature: 4 documents, 4 chunks, 0 embedded, 0 reused" in result.stdout
    result = runner.invoke(main, [*data, "corpus", "search", "loop diuretics congestion", "-k", "1"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].split()[2:] == ["tiny:hf", "Heart", "failure"]
    result = runner.invoke(main, [*data, "corpus", "search", "loop diuretics", "--fusion", "rrf", "--dense-share", "2"])
    assert result.exit_code == 2 and "2.0 is not in the range 0<=x<=1" in result.output
    result = runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2 and "missing.jsonl does not exist" in result.output
    result = runner.invoke(main, [*data, "corpus", "ingest", "medline"])
    assert result.exit_code == 2 and "FORMAT medline needs a PATH" in result.output


def test_cli_build_name_icd_builds_the_dictionary_index_never_a_literature_one(tmp_path, wh, monkeypatch):
    # `dxr corpus build --name icd` built every literature corpus, embeddings included (an hour for the shared data on
    # a loaded machine), into the index that `dxr corpus search --name icd` reads as the ICD dictionary's.
    from dxr.cli import main
    from tools.corpus import store_documents, writing_corpus

    # A model that cannot load: the dictionary's index is lexical and must not ask for one.
    monkeypatch.setenv("DXR_TOOLS__EMBEDDING__KIND", "path")
    monkeypatch.setenv("DXR_TOOLS__EMBEDDING__PATH", str(tmp_path / "no-model"))
    jsonl_corpus(tmp_path / "tiny.jsonl", TINY)
    data = ["--data-dir", str(wh.root)]
    runner = CliRunner()
    assert runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(tmp_path / "tiny.jsonl"),
                                "--corpus", "tiny"]).exit_code == 0
    with writing_corpus(wh, "icd"):
        store_documents(wh, icd_documents(*tiny_vocabulary()), "icd", "vocabulary")
    result = runner.invoke(main, [*data, "corpus", "build", "--name", "icd"])
    assert result.exit_code == 0, result.output
    assert "icd: 3 documents, 6 chunks, 0 embedded, 0 reused" in result.stdout  # title + notes sections
    assert json.loads((wh.forecast_dir / "corpus" / "icd" / "manifest.json").read_text())["corpora"] == ["icd"]
    result = runner.invoke(main, [*data, "corpus", "search", "E11.9", "--name", "icd", "-k", "1"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].split()[2] == "icd10:E11.9"
    result = runner.invoke(main, [*data, "corpus", "build", "--name", "icd", "--corpus", "tiny"], prog_name="dxr")
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == (
        "Error: index name 'icd' is the ICD dictionary's (corpus icd, lexical): drop --corpus to build it, or choose "
        "another --name for these corpora (usage: dxr corpus build -h)")


def test_cli_a_build_of_an_index_another_build_holds_is_refused_before_reading_corpora_or_loading_a_model(
        tmp_path, monkeypatch):
    import fcntl

    import dxr.cli.corpus
    import tools.embeddings
    from dxr.cli import main
    from warehouse.store import Warehouse

    jsonl_corpus(tmp_path / "tiny.jsonl", TINY)
    wh = Warehouse(tmp_path / "wh")
    ingest(wh, "jsonl", tmp_path / "tiny.jsonl", "tiny")
    read_chunks, calls = dxr.cli.corpus.read_chunks, []
    monkeypatch.setattr(dxr.cli.corpus, "read_chunks", lambda *a: calls.append("read corpora") or read_chunks(*a))
    monkeypatch.setattr(tools.embeddings, "make_embedder",
                        lambda config: calls.append("load model") or CountingEmbedder())
    lock = wh.forecast_dir / "corpus" / ".literature.lock"
    lock.parent.mkdir(parents=True)
    build = ["--data-dir", str(wh.root), "corpus", "build", "--run-id", "build-1"]
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another build of the index (flock: per open file, so also in one process)
        result = CliRunner().invoke(main, build)
    assert (result.exit_code, result.output) == (
        1, f"Error: index {lock.parent / 'literature'} is being built by another process: wait for it to finish, "
           "then rerun\n")
    assert calls == [] and not wh.has_rows("runs", run_id="build-1")
    result = CliRunner().invoke(main, build)
    assert result.exit_code == 0 and calls == ["read corpora", "load model"], result.output
    assert result.stdout.startswith("literature: 4 documents, 4 chunks, 4 embedded, 0 reused")
    read, indexing, indexed, started, finished = result.stderr.splitlines()
    assert (read, indexing, started) == (
        "literature: 4 documents from tiny (0 cross-corpus duplicates dropped)",
        "literature: indexing 4 chunks for BM25", "literature: embedding 4 of 4 chunks")
    assert indexed.startswith("literature: indexed 4/4 chunks (100%) in "), indexed
    assert finished.startswith("literature: embedded 4/4 chunks (100%) in "), finished


def test_cli_dense_build_and_search_print_no_library_progress_bar(tmp_path, monkeypatch):
    """transformers draws a 'Loading weights' bar each time the embedding model loads: every dense search."""
    from dxr.cli import main

    monkeypatch.setenv("DXR_TOOLS__EMBEDDING__KIND", "package")
    jsonl_corpus(tmp_path / "tiny.jsonl", TINY)
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "wh")]
    assert runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(tmp_path / "tiny.jsonl"),
                                  "--corpus", "tiny"]).exit_code == 0
    result = runner.invoke(main, [*data, "corpus", "build"])
    assert result.exit_code == 0 and "literature: embedding 4 of 4 chunks\n" in result.stderr, result.output
    assert "Loading weights" not in result.stderr
    result = runner.invoke(main, [*data, "corpus", "search", "loop diuretics congestion", "-k", "1", "--mode", "dense"])
    assert result.exit_code == 0 and result.stdout.split()[2] == "tiny:hf", result.output
    assert result.stderr == ""


def test_loading_an_embedding_model_draws_no_bar_but_still_warns_of_weights_missing_from_it(tmp_path):
    """Only the bar goes: a model directory whose checkpoint lacks a weight loads with that weight random, and
    transformers' report of it must reach stderr. A fresh process, as a CLI command is: in this one transformers
    may have been imported (its logging level fixed) and its bar switched off by an earlier test."""
    from safetensors.torch import load_file, save_file

    from tools.embeddings import default_model_path

    shipped = Path(default_model_path())
    broken = tmp_path / "minilm-without-word-embeddings"
    broken.mkdir()
    for part in shipped.iterdir():
        if part.name != "model.safetensors":
            (broken / part.name).symlink_to(part)
    weights = load_file(shipped / "model.safetensors")
    del weights["embeddings.word_embeddings.weight"]
    save_file(weights, broken / "model.safetensors")
    environment = {name: value for name, value in os.environ.items() if not name.startswith("TRANSFORMERS_")}
    # Both models load at once: each process spends its seconds importing torch and transformers.
    loads = {model: subprocess.Popen([sys.executable, "-c", "import sys; from tools.embeddings import "
                                      "SentenceTransformerEmbedder; SentenceTransformerEmbedder(sys.argv[1])",
                                      str(model)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=environment, cwd=Path(__file__).resolve().parents[1])  # the repository's tools
             for model in (shipped, broken)}
    try:
        for model, expected_warning in ((shipped, False), (broken, True)):
            _, stderr = loads[model].communicate(timeout=300)
            assert loads[model].returncode == 0, stderr
            assert "Loading weights" not in stderr
            assert ("embeddings.word_embeddings.weight | MISSING" in stderr) == expected_warning, stderr
    finally:
        for load in loads.values():
            load.kill()  # a load still running after a failed check; no effect on an ended one


def test_cli_search_refuses_fusion_options_outside_hybrid_mode(tmp_path, monkeypatch):
    from dxr.cli import main

    monkeypatch.setenv("DXR_TOOLS__EMBEDDING__KIND", "package")
    source = tmp_path / "tiny.jsonl"
    jsonl_corpus(source, TINY)
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "wh")]
    assert runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(source), "--corpus", "tiny"]).exit_code == 0
    assert runner.invoke(main, [*data, "corpus", "build"]).exit_code == 0
    search = [*data, "corpus", "search", "loop diuretics congestion", "-k", "1"]
    for mode, fusion_options in (("bm25", ["--fusion", "rrf"]), ("dense", ["--dense-share", "0.5"]),
                                 ("bm25", ["--fusion", "zscore"])):  # the default value, given explicitly
        result = runner.invoke(main, [*search, "--mode", mode, *fusion_options], prog_name="dxr")
        assert (result.exit_code, result.output) == (
            2, f"Error: {fusion_options[0]} applies to --mode hybrid only, not --mode {mode}: drop it "
               "(usage: dxr corpus search -h)\n")
    # Without them every mode searches, and hybrid takes them.
    for options in (["--mode", "bm25"], ["--mode", "dense"], ["--mode", "hybrid", "--fusion", "rrf", "--dense-share",
                                                              "0.5"]):
        result = runner.invoke(main, [*search, *options])
        assert result.exit_code == 0, result.output
        assert result.stdout.splitlines()[0].split()[2:] == ["tiny:hf", "Heart", "failure"], options


def test_cli_hybrid_search_of_a_lexical_only_index_says_it_is_bm25_and_refuses_fusion_options(tmp_path):
    from dxr.cli import main

    source = tmp_path / "tiny.jsonl"
    jsonl_corpus(source, TINY)
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "wh")]
    assert runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(source), "--corpus", "tiny"]).exit_code == 0
    assert runner.invoke(main, [*data, "corpus", "build", "--lexical-only"]).exit_code == 0
    search = [*data, "corpus", "search", "loop diuretics congestion", "-k", "1"]
    bm25 = runner.invoke(main, [*search, "--mode", "bm25"])
    assert bm25.exit_code == 0 and bm25.stderr == "", bm25.output
    # Hybrid, asked for or by default, answers as BM25 does and says so once on stderr.
    for options in ([], ["--mode", "hybrid"]):
        result = runner.invoke(main, [*search, *options])
        assert (result.exit_code, result.stdout) == (0, bm25.stdout), result.output
        assert result.stderr == "index 'literature' has no dense vectors (built lexical-only): searched with BM25 " \
                                "alone\n"
    for fusion_options in (["--fusion", "rrf"], ["--dense-share", "0.5"], ["--mode", "hybrid", "--fusion", "zscore"]):
        result = runner.invoke(main, [*search, *fusion_options], prog_name="dxr")
        option = fusion_options[-2]
        assert (result.exit_code, result.output) == (
            2, f"Error: {option} weighs BM25 against dense vectors, but index 'literature' has none (built "
               "lexical-only), so its search is BM25 alone: drop it, or rebuild it with a dense part (`dxr corpus "
               "build --name literature --corpus tiny`) (usage: dxr corpus search -h)\n"), fusion_options
    # The dictionary's index is lexical whatever its build options: dropping the option is the only fix.
    build_index(chunk_frame(icd_documents(*tiny_vocabulary())), tmp_path / "wh" / "forecast" / "corpus" / "icd", None,
                name="icd", corpora=["icd"])
    result = runner.invoke(main, [*data, "corpus", "search", "diabetes", "--name", "icd", "--fusion", "rrf"],
                           prog_name="dxr")
    assert (result.exit_code, result.output) == (
        2, "Error: --fusion weighs BM25 against dense vectors, but index 'icd' has none (built lexical-only), so "
           "its search is BM25 alone: drop it (usage: dxr corpus search -h)\n")


def test_pubmedqa_hits_carry_the_question_as_title_and_a_build_names_documents_ingested_without(wh, tmp_path):
    from dxr.cli import main
    from tools.corpus import source_key, store_documents

    source = tmp_path / "pqal.json"
    source.write_text(json.dumps({"21645374": {
        "QUESTION": "Do loop diuretics relieve congestion in heart failure?",
        "CONTEXTS": ["Loop diuretics were given to 40 patients admitted with congestion."], "LABELS": ["RESULTS"],
        "LONG_ANSWER": "Loop diuretics relieve congestion.", "YEAR": "2011"}}))
    runner = CliRunner()
    data = ["--data-dir", str(wh.root)]
    search = [*data, "corpus", "search", "loop diuretics congestion", "--mode", "bm25", "-k", "1"]
    # As an ingest before titles were read from QUESTION left it: the same document without a title.
    [document] = read_pubmedqa(source, "pubmedqa")
    document.title = ""
    store_documents(wh, [document], "pubmedqa", source_key(source))
    result = runner.invoke(main, [*data, "corpus", "build", "--lexical-only"])
    assert result.exit_code == 0, result.output
    assert ("literature: 1 PubMedQA documents of corpus pubmedqa without a title: if ingested before titles were read "
            "from QUESTION, ingest the same file again (dxr corpus ingest pubmedqa PATH --corpus pubmedqa), then "
            "build\n") in result.stderr
    result = runner.invoke(main, search)  # an index built from them still searches, without a title
    assert result.exit_code == 0 and result.stdout.splitlines()[0].split()[2:] == ["pmid:21645374"], result.output
    assert runner.invoke(main, [*data, "corpus", "ingest", "pubmedqa", str(source)]).exit_code == 0
    result = runner.invoke(main, [*data, "corpus", "build", "--lexical-only"])
    assert result.exit_code == 0 and "without a title" not in result.output, result.output
    result = runner.invoke(main, search)
    assert result.stdout.splitlines()[0].split()[2:] == [
        "pmid:21645374", "Do", "loop", "diuretics", "relieve", "congestion", "in", "heart", "failure?"], result.output


def test_cli_ingest_and_build_register_their_runs(tmp_path):
    # Every producing command takes --run-id and registers its run (foundation contract), corpus commands too.
    from dxr.cli import main
    from warehouse.store import Warehouse

    jsonl_corpus(tmp_path / "tiny.jsonl", TINY)
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "wh")]
    result = runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(tmp_path / "tiny.jsonl"), "--corpus", "tiny",
                                  "--run-id", "ing-1"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, [*data, "corpus", "build", "--lexical-only", "--run-id", "build-1"])
    assert result.exit_code == 0, result.output
    # A PATH that is not there is a usage error, refused before a run is registered.
    result = runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(tmp_path / "missing.jsonl"),
                                  "--run-id", "ing-2"])
    assert result.exit_code == 2 and "missing.jsonl does not exist" in result.output
    assert runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(tmp_path / "tiny.jsonl")]).exit_code == 0
    runs = Warehouse(tmp_path / "wh").read("runs").sort("started_at")
    assert runs.select("run_id", "kind", "status", "cohort_id").rows()[:2] == [
        ("ing-1", "corpus:ingest", "finished", None), ("build-1", "corpus:build", "finished", None)]
    assert runs.height == 3 and runs["run_id"][2].startswith("corpus-") and runs["status"][2] == "finished"
    assert json.loads(runs["config_json"][0]) == {"format": "jsonl", "path": str(tmp_path / "tiny.jsonl"),
                                                  "corpus": "tiny", "fulltext_dir": None, "chunk_chars": 1000}
    built = json.loads(runs["config_json"][1])
    assert built["indexes"] == [{"name": "literature", "corpora": ["tiny"], "lexical_only": True}]
    result = runner.invoke(main, [*data, "corpus", "build", "--lexical-only", "--run-id", "a b"])
    assert result.exit_code == 2 and "run id 'a b' has unsafe characters" in result.output

def test_cli_build_refuses_chunks_other_than_the_ingested_ones(tmp_path, monkeypatch):
    # Ledger rows name their evidence's chunk by id, to be joined to the chunks table: an index chunked with another
    # size would hand out ids (and texts) that table does not hold.
    from dxr.cli import main

    long = doc("ckd", "Chronic kidney disease", " ".join(["Chronic kidney disease progresses to dialysis."] * 6))
    jsonl_corpus(tmp_path / "tiny.jsonl", [long, TINY[1]])
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "wh")]
    monkeypatch.setenv("DXR_TOOLS__CHUNK_CHARS", "200")
    result = runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(tmp_path / "tiny.jsonl"), "--corpus", "tiny"])
    assert result.exit_code == 0 and result.stdout.endswith(": 2 documents (0 duplicates dropped), 3 chunks\n")
    monkeypatch.delenv("DXR_TOOLS__CHUNK_CHARS")
    result = runner.invoke(main, [*data, "corpus", "build", "--lexical-only"])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (
        "Error: corpus tiny (1 chunk): not the chunks ingested, which another tools.chunk_chars than 1000 made; "
        "re-ingest it (dxr corpus ingest) or set tools.chunk_chars back, so the chunk_id of ledger rows names rows "
        "of the chunks table")
    assert not (tmp_path / "wh" / "forecast" / "corpus" / "literature").exists()
    monkeypatch.setenv("DXR_TOOLS__CHUNK_CHARS", "200")
    result = runner.invoke(main, [*data, "corpus", "build", "--lexical-only"])
    assert result.exit_code == 0 and "literature: 2 documents, 3 chunks" in result.stdout, result.output
    # Pages read by the web channel are stored whole: no chunks rows to compare with.
    from tools.corpus import documents_frame
    from warehouse.store import Warehouse

    page = Document("web:0123", "web", "web", "A page", [("Page", TINY[2].text)], url="https://example.org/hf")
    Warehouse(tmp_path / "wh").write("documents", documents_frame([page], "web", "run1-0"), corpus="web",
                                     source="run1-0")
    result = runner.invoke(main, [*data, "corpus", "build", "--lexical-only", "--name", "pages", "--corpus", "web"])
    assert result.exit_code == 0 and "pages: 1 documents, 1 chunks" in result.stdout, result.output


def test_a_named_build_without_a_literature_corpus_to_default_to_is_refused(tmp_path):
    # With only the ICD dictionary (and web pages) stored, `--name` alone chose no corpus, and no corpus named read
    # every stored one: an index `dx` of the dictionary and the pages, embedded unless --lexical-only.
    from dxr.cli import main
    from tools.corpus import documents_frame, store_documents
    from warehouse.store import Warehouse

    wh = Warehouse(tmp_path / "wh")
    store_documents(wh, [Document("icd:10:I50", "icd", "icd", "I50 Heart failure", [("Title", "Heart failure")])],
                    "icd", "vocabulary")
    page = Document("web:0123", "web", "web", "A page", [("Page", TINY[2].text)], url="https://example.org/hf")
    wh.write("documents", documents_frame([page], "web", "run1-0"), corpus="web", source="run1-0")
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "corpus", "build", "--lexical-only", "--name", "dx"])
    assert (result.exit_code, result.output) == (
        1, "Error: no literature corpus ingested (only icd) for index dx: name its corpora with --corpus, or ingest "
           "one first (dxr corpus ingest FORMAT PATH)\n")
    assert not (tmp_path / "wh" / "forecast" / "corpus" / "dx").exists()


def test_cli_refuses_names_that_escape_or_collide_and_queries_without_words(tmp_path):
    from dxr.cli import main

    source = tmp_path / "tiny.jsonl"
    source.write_text(json.dumps({"id": "hf", "text": "Heart failure readmission is frequent."}) + "\n")
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "wh")]

    def error(*arguments: str, exit_code: int = 2) -> str:  # malformed names are usage errors
        result = runner.invoke(main, [*data, "corpus", *arguments])
        assert result.exit_code == exit_code and result.output.count("\n") == 1, result.output
        return result.output

    assert "'--corpus': corpus 'web' is reserved for pages read by the web channel" in error(
        "ingest", "jsonl", str(source), "--corpus", "web")
    assert "--corpus icd is reserved for the ICD dictionary" in error("ingest", "jsonl", str(source), "--corpus", "icd")
    assert "'--corpus': corpus '../x': use letters, digits and _.:- only" in error(
        "ingest", "jsonl", str(source), "--corpus", "../x")
    assert runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(source)]).exit_code == 0
    for name in (".", "..", "../escaped", "a/b"):
        assert f"index name {name!r}: use letters, digits and _.- only, not starting with a dot" in error(
            "build", "--lexical-only", "--name", name)
    assert not (tmp_path / "wh" / "forecast" / "escaped").exists()
    assert runner.invoke(main, [*data, "corpus", "build", "--lexical-only"]).exit_code == 0
    assert "'QUERY': query '  ' has no words to search for" in error("search", "  ")
    assert error("search", "heart", "--name", "other", exit_code=1) == (
        "Error: no corpus index named 'other' (built: literature): build it with "
        "`dxr corpus build --name other --corpus CORPUS`\n")  # a plain build never makes it
    dense = error("search", "heart", "--mode", "dense", exit_code=1)
    assert "has no dense vectors (built lexical-only): use mode bm25" in dense


def test_words_outside_ascii_are_searched_as_the_index_holds_them(tmp_path):
    docs = [Document("x:1", "x", "jsonl", "Sjögren syndrome",
                     [("Text", "Sjögren syndrome raises the lymphoma risk.")]),
            Document("x:2", "x", "jsonl", "Staging", [("Text", "The sj gren protocol stages lymphoma.")]),
            Document("x:3", "x", "jsonl", "Thalassemia", [("Text", "β-thalassemia major needs chronic transfusion.")])]
    build_index(chunk_frame(docs), tmp_path / "idx", None)
    index = CorpusIndex(tmp_path / "idx")
    # Cut down to ASCII, 'Sjögren' became 'sj gren' and found the decoy; 'β' had no words at all.
    assert [h.doc_id for h in index.search("Sjögren lymphoma", k=3, mode="bm25")][0] == "x:1"
    assert [h.doc_id for h in index.search("Sjögren", k=3, mode="bm25")] == ["x:1"]
    assert [h.doc_id for h in index.search("β thalassemia", k=3, mode="bm25")] == ["x:3"]
    assert support_cue("Sjögren syndrome raises the lymphoma risk.", ["Sjögren syndrome"], ["lymphoma"]) == \
        (True, 1.0)


def test_search_refuses_k_below_one_and_wordless_queries(tmp_path):
    build_index(chunk_frame(TINY), tmp_path / "idx", None)
    index = CorpusIndex(tmp_path / "idx")
    for k in (0, -1):
        with pytest.raises(InputError, match=rf"k = {k}: a search returns at least 1 hit"):
            index.search("heart failure", k=k)
    with pytest.raises(InputError, match=r"query '\?\?' has no words to search for"):
        index.search("??")


def test_cli_arxiv_full_texts_from_a_directory_and_misplaced_fulltext_dir(tmp_path):
    from dxr.cli import main
    from warehouse.locks import held
    from warehouse.store import Warehouse

    (tmp_path / "meta").mkdir()
    (tmp_path / "texts").mkdir()
    (tmp_path / "meta" / "a.jsonl").write_text(json.dumps({"id": "2101.00001v2", "title": "T",
                                                            "abstract": "Heart failure."}) + "\n")
    (tmp_path / "texts" / "2101.00001.txt").write_text("Full text about heart failure readmission.")
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "wh")]
    with held(Warehouse(tmp_path / "wh"), "corpus:arxiv", shared=False, busy="an ingest"):
        result = runner.invoke(main, [*data, "corpus", "ingest", "arxiv", str(tmp_path / "meta"),
                                      "--fulltext-dir", str(tmp_path / "texts")])
    assert (result.exit_code, result.output) == (
        1, "Error: corpus 'arxiv' is being ingested or read for an index by another dxr process (dxr corpus ingest "
           "or build): retry when it has finished\n")
    result = runner.invoke(main, [*data, "corpus", "ingest", "arxiv", str(tmp_path / "meta"),
                                  "--fulltext-dir", str(tmp_path / "texts")])
    assert result.exit_code == 0 and result.stdout.endswith(": 1 documents (0 duplicates dropped), 2 chunks\n")
    result = runner.invoke(main, [*data, "corpus", "ingest", "jsonl", str(tmp_path / "meta" / "a.jsonl"),
                                  "--fulltext-dir", str(tmp_path / "texts")])
    assert result.exit_code == 2 and "--fulltext-dir applies to FORMAT arxiv only, not jsonl" in result.output
    result = runner.invoke(main, [*data, "corpus", "ingest", "arxiv", str(tmp_path / "meta"),
                                  "--fulltext-dir", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_ingest_reads_arxiv_full_texts_from_a_directory_and_refuses_one_for_another_format(tmp_path, wh):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "2101.00001v2", "title": "T", "abstract": "Heart."}) + "\n")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "2101.00001.txt").write_text("Full text about readmission.")
    summary = ingest(wh, "arxiv", tmp_path / "a.jsonl", fulltext_dir=tmp_path / "texts")
    assert (summary.corpus, summary.documents, summary.chunks) == ("arxiv", 1, 2)
    [document] = load_documents(wh, ["arxiv"])
    assert document.sections == [("Abstract", "Heart."), ("Full text", "Full text about readmission.")]
    with pytest.raises(InputError, match="^full texts from a directory apply to format arxiv only, not jsonl$"):
        ingest(wh, "jsonl", tmp_path / "a.jsonl", fulltext_dir=tmp_path / "texts")
    with pytest.raises(InputError, match="^full texts from a directory apply to format arxiv only, not jsonl$"):
        read_documents("jsonl", tmp_path / "a.jsonl", fulltext_dir=tmp_path / "texts")  # read arXiv's way before


def test_arxiv_authors_and_categories_are_kept_in_documents(tmp_path, wh):
    # The snapshot writes both as strings; other exports write lists. Other formats have neither.
    records = [{"id": "2101.00001v2", "title": "T1", "abstract": "Heart failure.", "authors": "A. Smith and B. Jones",
                "categories": "q-bio.QM stat.AP"},
               {"id": "2101.00002", "title": "T2", "abstract": "Readmission.", "authors": ["C. Wu", "D. Roe"],
                "categories": ["cs.LG", "q-bio.TO"]},
               {"id": "2101.00003", "title": "T3", "abstract": "Dialysis."}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    ingest(wh, "arxiv", tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl").write_text(json.dumps({"id": "x", "title": "T", "text": "Heart failure."}) + "\n")
    ingest(wh, "jsonl", tmp_path / "b.jsonl", corpus="notes")
    rows = wh.connect().execute("SELECT doc_id, authors, categories FROM documents ORDER BY doc_id").fetchall()
    assert rows == [("arxiv:2101.00001", "A. Smith and B. Jones", "q-bio.QM stat.AP"),
                    ("arxiv:2101.00002", "C. Wu, D. Roe", "cs.LG q-bio.TO"),
                    ("arxiv:2101.00003", None, None), ("notes:x", None, None)]
    (tmp_path / "c.jsonl").write_text(json.dumps({**records[0], "authors": 7}) + "\n")
    with pytest.raises(InputError, match=r"c\.jsonl:1: field 'authors' must be a string, got a number$"):
        ingest(wh, "arxiv", tmp_path / "c.jsonl")


def test_documents_ingested_before_authors_and_categories_were_kept_open_with_them_null(tmp_path, wh):
    from tools.corpus import documents_frame

    path = wh.partition_path("documents", corpus="old", source="s")
    path.parent.mkdir(parents=True)
    documents_frame([doc("1", "T", "Heart failure.")], "old", "s").drop("authors", "categories").write_parquet(path)
    assert wh.connect().execute("SELECT doc_id, authors, categories FROM documents").fetchall() == [
        ("tiny:1", None, None)]
    assert wh.read("documents").select("doc_id", "authors", "categories").rows() == [("tiny:1", None, None)]

@pytest.mark.parametrize("module", ["tools.corpus.documents", "tools.index", "tools.passages", "tools.text",
                                    "tools.sanitize", "tools.ledger", "tools.web.channel"])
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0, f"{module}: {result}"


def test_cli_icd_dictionary_from_the_vocabulary_tables(tmp_path):
    from dxr.cli import main
    from warehouse.locks import held
    from warehouse.store import Warehouse

    codes, notes = tiny_vocabulary()
    wh = Warehouse(tmp_path / "wh")
    wh.write("icd_codes", codes.filter(pl.col("icd_version") == 10), icd_version=10)
    wh.write("icd_codes", codes.filter(pl.col("icd_version") == 9), icd_version=9)
    wh.write("icd_notes", notes, icd_version=10)
    runner = CliRunner()
    data = ["--data-dir", str(tmp_path / "wh")]
    with held(wh, "corpus:icd", shared=False, busy="an ingest"):
        result = runner.invoke(main, [*data, "corpus", "ingest", "icd"])
    assert (result.exit_code, result.output) == (
        1, "Error: corpus 'icd' is being ingested or read for an index by another dxr process (dxr corpus ingest "
           "or build): retry when it has finished\n")
    result = runner.invoke(main, [*data, "corpus", "ingest", "icd"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "corpus icd source vocabulary: 3 documents (0 duplicates dropped), 6 chunks\n"
    result = runner.invoke(main, [*data, "corpus", "build"])
    assert result.exit_code == 0 and "icd: 3 documents, 6 chunks, 0 embedded" in result.stdout, result.output
    result = runner.invoke(main, [*data, "corpus", "search", "--name", "icd", "diabetes type II", "-k", "1"])
    assert result.stdout.splitlines()[0].split()[2:4] == ["icd9:250.00", "250.00"], result.output


def test_cli_search_defaults_are_the_index_defaults():
    from dxr.cli.corpus import search_command

    defaults = {param.name: param.default for param in search_command.params}
    assert (defaults["fusion"], defaults["dense_share"]) == (DEFAULT_FUSION, DEFAULT_DENSE_SHARE)
