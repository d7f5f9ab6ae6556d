"""Corpus commands: ingest documents, build the BM25 + dense index, search it."""

from __future__ import annotations

import re
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import click
from click.core import ParameterSource

from dxr.cli import main, settings, valid, warehouse
from dxr.errors import InputError, NotFoundError

FORMAT_NAMES = ["jats", "medline", "arxiv", "medquad", "pubmedqa", "jsonl", "icd"]
LITERATURE = "literature"
# Corpus names are warehouse partition values; index names are directories under the index root,
# so neither may hold a path separator, and an index name may not start with a dot ('.', '..').
CORPUS_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
INDEX_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def check_corpus_names(ctx: click.Context, param: click.Parameter, value):
    """The callback of an option naming corpora (each value of a repeatable one)."""
    for name in () if value is None else value if param.multiple else (value,):
        if not CORPUS_NAME.fullmatch(name):
            raise click.BadParameter(f"corpus {name!r}: use letters, digits and _.:- only (e.g. guidelines)", ctx,
                                     param)
    return value


def check_new_corpus_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The callback of the corpus an ingest writes: never the one the web channel writes."""
    from tools.corpus import WEB_CORPUS  # pages read by the web channel: an ingested corpus must not mix with them

    if check_corpus_names(ctx, param, value) == WEB_CORPUS:
        raise click.BadParameter(f"corpus {WEB_CORPUS!r} is reserved for pages read by the web channel: choose "
                                 "another name", ctx, param)
    return value


def check_index_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not INDEX_NAME.fullmatch(value):
        raise click.BadParameter(f"index name {value!r}: use letters, digits and _.- only, not starting with a dot "
                                 "(it names a directory under the index root)", ctx, param)
    return value


def check_ingest_path(ctx: click.Context, param: click.Parameter, path: Path | None) -> Path | None:
    """The callback of an ingest's PATH: it exists (FORMAT, an argument before it, is parsed first)."""
    from tools.corpus import check_input_path

    fmt = ctx.params["fmt"]
    if path is None or fmt == "icd":  # the command refuses a PATH given to icd, and a PATH missing for the others
        return path
    return valid.checked(ctx, param, path, lambda given: check_input_path(fmt, given))


def index_root(ctx: click.Context) -> Path:
    config = settings(ctx)
    return Path(config.tools.corpus_dir) if config.tools.corpus_dir else config.forecast_dir / "corpus"


@main.group()
def corpus() -> None:
    """Local literature corpora and the ICD dictionary: ingest, build, search.

    \b
    Example:
      dxr corpus ingest pubmedqa ../shared/data/corpora/pubmedqa/ori_pqal.json
      dxr corpus build
      dxr corpus search "chronic kidney disease progression to dialysis"
    """


@corpus.command("ingest")
@click.argument("fmt", metavar="FORMAT", type=click.Choice(FORMAT_NAMES))
@click.argument("path", required=False, type=click.Path(path_type=Path), callback=check_ingest_path)
@click.option("--corpus", "corpus_name", default=None, callback=check_new_corpus_name,
              help="Corpus name (default: per format, e.g. pmc, medquad).")
@click.option("--fulltext-dir", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="arXiv only: directory of <id>.txt full texts, the id without its version and an old-style "
                   "id's / as _ (2301.01234.txt, math_0406594.txt).")
@click.option("--run-id", default=None, callback=valid.run_id, help="Run id to register (generated when absent).")
@click.pass_context
def ingest_command(ctx: click.Context, fmt: str, path: Path | None, corpus_name: str | None,
                   fulltext_dir: Path | None, run_id: str | None) -> None:
    """Parse FORMAT files at PATH (a file or a directory) into the documents and chunks tables.

    FORMAT icd takes no PATH: it reads the ICD vocabulary tables (or the packaged vocabularies).
    Re-ingesting the same PATH replaces its rows.

    \b
    Example:
      dxr corpus ingest jats ../shared/data/corpora/samples
      dxr corpus ingest icd
    """
    from tools.dictionary import CORPUS as ICD
    from warehouse.runs import registered_run

    if corpus_name == ICD and fmt != "icd":
        raise click.UsageError(f"--corpus {ICD} is reserved for the ICD dictionary (dxr corpus ingest icd): "
                               "choose another name", ctx)
    if fulltext_dir is not None and fmt != "arxiv":
        raise click.UsageError(f"--fulltext-dir applies to FORMAT arxiv only, not {fmt}: drop it", ctx)
    if fmt == "icd" and path is not None:
        raise click.UsageError("FORMAT icd takes no PATH: it reads the ICD vocabulary tables", ctx)
    if fmt != "icd" and path is None:
        raise click.UsageError(f"FORMAT {fmt} needs a PATH (a file or a directory)", ctx)
    wh = warehouse(ctx)
    chunk_chars = settings(ctx).tools.chunk_chars
    config = {"format": fmt, "path": None if path is None else str(path), "corpus": corpus_name,
              "fulltext_dir": None if fulltext_dir is None else str(fulltext_dir), "chunk_chars": chunk_chars}
    with registered_run(wh, "corpus:ingest", config, run_id):
        summary = _ingest(wh, fmt, path, corpus_name, fulltext_dir, chunk_chars)
    unsearchable = f", {summary.without_text} without text: not searchable" if summary.without_text else ""
    withdrawn = f", {summary.withdrawn} deleted or retracted: left out" if summary.withdrawn else ""
    if summary.unmatched_deletions:
        withdrawn += (f", {summary.unmatched_deletions} deleted PMID(s) not in these files: nothing removed "
                      "(ingest an update in one directory with its baseline)")
    click.echo(f"corpus {summary.corpus} source {summary.source}: {summary.documents} documents "
               f"({summary.duplicates} duplicates dropped{unsearchable}{withdrawn}), {summary.chunks} chunks")


def _ingest(wh, fmt: str, path: Path | None, corpus_name: str | None, fulltext_dir: Path | None, chunk_chars: int):
    """Store the documents and chunks of `dxr corpus ingest`; returns its IngestSummary. Both ingests hold the
    corpus's lock themselves."""
    if fmt == "icd":
        from tools.dictionary import CORPUS, ingest_dictionary

        return ingest_dictionary(wh, corpus_name or CORPUS, chunk_chars)
    from tools.corpus import ingest

    return ingest(wh, fmt, path, corpus_name, chunk_chars, progress=lambda f: click.echo(f"  read {f}", err=True),
                  fulltext_dir=fulltext_dir)


@corpus.command("build")
@click.option("--name", default=None, callback=check_index_name,
              help=f"Index name (default: {LITERATURE}, plus icd when ingested; icd alone rebuilds the ICD "
                   "dictionary's index).")
@click.option("--corpus", "corpora", multiple=True, callback=check_corpus_names,
              help="Corpora to include (default: every literature corpus).")
@click.option("--lexical-only", is_flag=True, help="BM25 only, no embeddings (the icd index always is).")
@click.option("--run-id", default=None, callback=valid.run_id, help="Run id to register (generated when absent).")
@click.pass_context
def build_command(ctx: click.Context, name: str | None, corpora: tuple[str, ...], lexical_only: bool,
                  run_id: str | None) -> None:
    """Build the BM25 + dense index of ingested corpora (embeddings cached with the index).

    Without options: the `literature` index over every corpus except icd, and a lexical `icd`
    index when the ICD dictionary was ingested.

    \b
    Example:
      dxr corpus build
      dxr corpus build --name pmc-only --corpus pmc
    """
    from tools.corpus import WEB_CORPUS, reading_corpora
    from tools.dictionary import CORPUS as ICD
    from tools.embeddings import make_embedder
    from tools.index import building_index
    from warehouse.corpora import stored_corpora
    from warehouse.runs import registered_run

    config = settings(ctx)
    wh = warehouse(ctx)
    ingested = [corpus for corpus in stored_corpora(wh) if corpus != WEB_CORPUS]
    if not ingested and not corpora:  # named corpora (`web` too) are checked as they are read
        raise InputError("no corpus ingested yet: run `dxr corpus ingest FORMAT PATH` first")
    if name == ICD and set(corpora) - {ICD}:
        raise click.UsageError(f"index name {ICD!r} is the ICD dictionary's (corpus {ICD}, lexical): drop --corpus "
                               "to build it, or choose another --name for these corpora", ctx)
    plans = []
    if name or corpora:
        # `--name icd` alone builds the dictionary's index, the one `dxr corpus search --name icd` expects, never a
        # literature index under its name (and with embeddings it never has).
        chosen = list(corpora) or ([ICD] if name == ICD else [c for c in ingested if c != ICD])
        if not chosen:  # no corpus named reads every stored one: the dictionary and the web pages
            raise InputError(f"no literature corpus ingested (only {', '.join(ingested)}) for index {name}: name its "
                             "corpora with --corpus, or ingest one first (dxr corpus ingest FORMAT PATH)")
        plans.append((name or LITERATURE, chosen, lexical_only or chosen == [ICD]))
    else:
        literature = [c for c in ingested if c != ICD]
        if literature:
            plans.append((LITERATURE, literature, lexical_only))
        if ICD in ingested:
            plans.append((ICD, [ICD], True))
    root = index_root(ctx)
    run_config = {"indexes": [{"name": n, "corpora": c, "lexical_only": lex} for n, c, lex in plans],
                  "index_root": str(root), "chunk_chars": config.tools.chunk_chars,
                  "embedding": config.tools.embedding.model_dump(mode="json")}
    embedder = None
    # Each index's build lock, then every planned corpus, is taken before the run is registered: another build of
    # the index, or an ingest of a corpus, refuses the build at once, before it reads a corpus or loads a model, and
    # without recording a failed run that never started. The indexes are then built from what was read: ingests may
    # go on.
    with ExitStack() as building, ExitStack() as reading:
        builds = [building.enter_context(building_index(root / index_name)) for index_name, _, _ in plans]
        reading.enter_context(reading_corpora(wh, [corpus for _, chosen, _ in plans for corpus in chosen]))
        with registered_run(wh, "corpus:build", run_config, run_id):
            read = [(*plan, read_chunks(wh, *plan[:2], config.tools.chunk_chars)) for plan in plans]
            reading.close()
            for (index_name, chosen, lexical, chunks), build in zip(read, builds):
                if not lexical and embedder is None:
                    embedder = make_embedder(config.tools.embedding)
                manifest = build(chunks, None if lexical else embedder, name=index_name, corpora=chosen,
                                 progress=lambda line: click.echo(line, err=True))
                click.echo(f"{index_name}: {manifest['n_documents']} documents, {manifest['n_chunks']} chunks, "
                           f"{manifest['embedded']} embedded, {manifest['embeddings_reused']} reused, "
                           f"{manifest['build_seconds']:.1f} s, {manifest['bytes'] / 1e6:.1f} MB -> "
                           f"{root / index_name}")


def read_chunks(wh, index_name: str, chosen: list[str], chunk_chars: int):
    """The chunks an index of the corpora `chosen` is built from; the caller holds their `reading_corpora` locks."""
    from tools.corpus import check_stored_chunks, load_documents
    from tools.corpus.documents import dedupe
    from tools.index import chunk_frame

    documents, dropped = dedupe(load_documents(wh, chosen))
    without_text = sum(1 for d in documents if not d.text)
    unsearchable = f", {without_text} without text: not indexed" if without_text else ""
    click.echo(f"{index_name}: {len(documents)} documents from {', '.join(chosen)} "
               f"({len(dropped)} cross-corpus duplicates dropped{unsearchable})", err=True)
    # PubMedQA documents ingested before their QUESTION was read as the title have none, and a build alone cannot
    # give them one: the index takes its titles from the documents table, which only a new ingest rewrites.
    untitled = Counter(d.corpus for d in documents if d.source_format == "pubmedqa" and not d.title)
    for corpus_name, count in sorted(untitled.items()):
        click.echo(f"{index_name}: {count} PubMedQA documents of corpus {corpus_name} without a title: if ingested "
                   "before titles were read from QUESTION, ingest the same file again (dxr corpus ingest pubmedqa "
                   f"PATH --corpus {corpus_name}), then build", err=True)
    chunks = chunk_frame(documents, chunk_chars)
    check_stored_chunks(wh, chunks, chunk_chars)
    return chunks


@corpus.command("search")
@click.argument("query", callback=valid.search_query)
@click.option("--name", default=LITERATURE, show_default=True, callback=check_index_name,
              help="Index to search (e.g. icd).")
@click.option("-k", "k", default=5, show_default=True, type=click.IntRange(1, 100))
@click.option("--mode", type=click.Choice(["hybrid", "bm25", "dense"]), default="hybrid", show_default=True)
@click.option("--fusion", type=click.Choice(["zscore", "minmax", "rrf"]), default="zscore", show_default=True,
              help="How hybrid mode fuses BM25 and dense: z-scored or min-max scores, or reciprocal ranks.")
@click.option("--dense-share", type=click.FloatRange(0, 1), default=0.7, show_default=True,
              help="Dense part of the hybrid fusion weight (0.5 = equal); default chosen on dev questions.")
@click.pass_context
def search_command(ctx: click.Context, query: str, name: str, k: int, mode: str, fusion: str,
                   dense_share: float) -> None:
    """Search an index; prints rank, score, document, title and a query-focused passage.

    \b
    Example:
      dxr corpus search "recurrence of atrial fibrillation after ablation" -k 3
    """
    from tools.dictionary import CORPUS as ICD
    from tools.embeddings import make_embedder
    from tools.index import CorpusIndex, build_command

    # The fusion options weigh the two retrievers against each other: with one retriever they would change
    # nothing, and a user who asked for them would not learn that.
    fusion_options = [option for option, parameter in (("--fusion", "fusion"), ("--dense-share", "dense_share"))
                      if ctx.get_parameter_source(parameter) not in (ParameterSource.DEFAULT,
                                                                     ParameterSource.DEFAULT_MAP)]
    if mode != "hybrid" and fusion_options:
        raise click.UsageError(f"{fusion_options[0]} applies to --mode hybrid only, not --mode {mode}: drop it", ctx)
    directory = index_root(ctx) / name
    if not (directory / "manifest.json").exists():
        built = sorted(p.parent.name for p in index_root(ctx).glob("*/manifest.json"))
        # A plain build makes only the default indexes; any other index is named, with its corpora, when built.
        how = "dxr corpus build" if name in (LITERATURE, ICD) else build_command(directory, manifest=None)
        raise NotFoundError(f"no corpus index named {name!r} (built: {', '.join(built) or 'none'}): "
                            f"build it with `{how}`")
    needs_embedder = mode != "bm25" and (directory / "dense.faiss").exists()
    embedder = make_embedder(settings(ctx).tools.embedding) if needs_embedder else None
    index = CorpusIndex(directory, embedder)
    # A lexical-only index (the icd index always is) answers a hybrid search with BM25 alone, as documented; the
    # command says so, and refuses fusion options that would change nothing there.
    lexical_fallback = mode == "hybrid" and not index.has_dense
    if lexical_fallback and fusion_options:
        # Only the dictionary's build is lexical whatever its options: for any other index a rebuild helps.
        dense_build = build_command(directory, index.manifest).removesuffix(" --lexical-only")
        rebuild = "" if index.manifest["corpora"] == [ICD] else f", or rebuild it with a dense part (`{dense_build}`)"
        raise click.UsageError(f"{fusion_options[0]} weighs BM25 against dense vectors, but index {name!r} has "
                               f"none (built lexical-only), so its search is BM25 alone: drop it{rebuild}", ctx)
    hits = index.search(query, k=k, mode=mode, fusion=fusion, dense_share=dense_share)
    if lexical_fallback:  # said once the search stood, not before a refusal of the query
        click.echo(f"index {name!r} has no dense vectors (built lexical-only): searched with BM25 alone", err=True)
    if not hits:
        click.echo("no result")
    for hit in hits:
        click.echo(f"{hit.rank:>2}  {hit.score:.4f}  {hit.doc_id}  {hit.title[:80]}")
        click.echo(f"    {hit.passage[:300]}")
