"""PMC JATS XML and MEDLINE XML adapters (lxml; no DTD loading, no network).

A malformed file or a missing required element raises InputError naming the file and the element.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from lxml import etree

from dxr.errors import InputError
from tools.corpus.documents import Document, clean_text, stable_doc_id
from tools.corpus.files import open_binary

# Never resolve entities or fetch DTDs: corpus files are untrusted input and we are offline.
_PARSER = etree.XMLParser(resolve_entities=False, load_dtd=False, no_network=True, recover=False, huge_tree=True)


def parse_xml(path: Path) -> etree._Element:
    try:
        with open_binary(path) as handle:
            return etree.parse(handle, _PARSER).getroot()
    except etree.XMLSyntaxError as exc:
        # lxml's message usually ends with the position already; add the line only when it does not.
        where = "" if f"line {exc.lineno}" in exc.msg else f", line {exc.lineno}"
        raise InputError(f"{path}: not well-formed XML ({exc.msg}{where}); fix or remove the file") from None
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot read ({exc}); check the file is complete and in the encoding its "
                         "XML declaration names") from None


# Floating objects (tables, figures) may sit inside a paragraph, yet they are not its prose: a table inlined
# there ran its cells together with the sentences around it ('...(Table 1).Table 1.Distribution...2219 45%8595').
# TeX source of a formula is markup ('\documentclass{minimal}...'), not words; its MathML or image stands for it.
_LEFT_OUT = frozenset({"table-wrap", "table-wrap-group", "fig", "fig-group", "supplementary-material", "media",
                       "tex-math"})
# Block elements meet their neighbours without whitespace in the XML ('written<disp-formula/>in which'):
# they are word boundaries.
_BLOCKS = frozenset({"p", "break", "disp-formula", "list", "list-item", "def-list", "def-item", "term", "def",
                     "disp-quote", "boxed-text", "statement", "speech", "verse-group", "verse-line", "title",
                     "label"})
# What a section holds as running text besides <p> (lists of criteria, quotes, boxes); floats are left out.
_SECTION_TEXT = frozenset({"p", "list", "def-list", "disp-quote", "boxed-text", "statement", "speech",
                           "verse-group", "disp-formula"})


def _text(element) -> str:
    """The prose of an element: floats and TeX left out, block elements read as word boundaries."""
    if element is None:
        return ""
    parts: list[str] = []

    def walk(node) -> None:
        parts.append(node.text or "")
        for child in node:
            # Comments and processing instructions are not text, but the text after them is.
            name = _local(child.tag)
            if name and name not in _LEFT_OUT:
                block = " " if name in _BLOCKS else ""
                parts.append(block)
                walk(child)
                parts.append(block)
            else:
                parts.append(" ")
            parts.append(child.tail or "")

    walk(element)
    return clean_text("".join(parts))


def _local(tag) -> str:
    return etree.QName(tag).localname if isinstance(tag, str) else ""


def read_jats(path: Path, corpus: str) -> Iterator[Document]:
    """One JATS article: PMCID (required), PMID, DOI, title, abstract and body sections."""
    root = parse_xml(path)
    articles = [root] if _local(root.tag) == "article" else list(root.iter("{*}article"))
    if not articles:
        raise InputError(f"{path}: no <article> element (root is <{_local(root.tag)}>); "
                         "is this PMC JATS XML? use FORMAT medline for MEDLINE citations")
    for article in articles:
        meta = article.find("./{*}front/{*}article-meta")
        if meta is None:
            raise InputError(f"{path}: <article> has no <front>/<article-meta>; not a JATS article")
        ids = {el.get("pub-id-type"): clean_text(el.text) for el in meta.findall("{*}article-id")}
        pmcid = ids.get("pmc") or ids.get("pmcid")
        if not pmcid:
            raise InputError(f"{path}: <article-meta> has no <article-id pub-id-type=\"pmc\">; "
                             "PMC documents are keyed by PMCID (use FORMAT jsonl for other articles)")
        title = _text(meta.find("./{*}title-group/{*}article-title"))
        if not title:
            raise InputError(f"{path}: <article-meta> has no <title-group>/<article-title>")
        sections = []
        for abstract in meta.findall("{*}abstract"):
            if abstract.get("abstract-type") in (None, "", "structured", "summary"):
                sections.append(("Abstract", _abstract_text(abstract)))
        body = article.find("{*}body")
        if body is not None:
            sections.extend(_body_sections(body))
        sections = [(h, t) for h, t in sections if t]
        doc_id = stable_doc_id(corpus, pmcid=pmcid)
        yield Document(doc_id=doc_id, corpus=corpus, source_format="jats", title=title, sections=sections,
                       url=f"https://pmc.ncbi.nlm.nih.gov/articles/{doc_id.split(':', 1)[1]}/",
                       doi=ids.get("doi"), pmcid=pmcid, pmid=ids.get("pmid"), meta={"file": str(path)})


def _abstract_text(abstract) -> str:
    parts = []
    for sec in abstract.findall("{*}sec"):
        # Some publishers end the heading with its colon ('Background:'); the label gets one colon.
        label = _text(sec.find("{*}title")).rstrip(":").rstrip()
        body = " ".join(_text(p) for p in sec.findall(".//{*}p"))
        parts.append(f"{label}: {body}" if label else body)
    if not parts:
        parts = [_text(p) for p in abstract.findall(".//{*}p")] or [_text(abstract)]
    return clean_text(" ".join(parts))


def _body_sections(body) -> list[tuple[str, str]]:
    """Flatten nested <sec> into (heading path, paragraphs directly under that section)."""
    out: list[tuple[str, str]] = []

    def walk(sec, path: list[str]):
        heading = _text(sec.find("{*}title"))
        here = path + [heading] if heading else path
        paragraphs = [_text(child) for child in sec if _local(child.tag) in _SECTION_TEXT]
        out.append((" / ".join(here) or "Body", clean_text(" ".join(paragraphs))))
        for child in sec.findall("{*}sec"):
            walk(child, here)

    loose = [_text(child) for child in body if _local(child.tag) in _SECTION_TEXT]
    if loose:
        out.append(("Body", clean_text(" ".join(loose))))
    for sec in body.findall("{*}sec"):
        walk(sec, [])
    return out


def read_medline(path: Path, corpus: str) -> Iterator[Document]:
    """MEDLINE/PubMed citation XML: PMID (required), title, abstract (labelled parts kept).

    Update files withdraw citations: a <DeleteCitation> PMID, and a citation revised into a 'Retracted
    Publication', come as records marked `meta["withdrawn"]` ("deleted", "retracted"); `ingest` removes
    their documents (retracted work is no evidence).
    """
    root = parse_xml(path)
    citations = list(root.iter("MedlineCitation"))
    deletions = [clean_text(pmid.text) for pmid in root.iterfind(".//DeleteCitation/PMID")]
    if not citations and not deletions:
        raise InputError(f"{path}: no <MedlineCitation> element (root is <{_local(root.tag)}>); "
                         "is this MEDLINE XML? use FORMAT jats for PMC articles")
    for index, citation in enumerate(citations):
        pmid = clean_text(citation.findtext("PMID"))
        if not pmid:
            raise InputError(f"{path}: <MedlineCitation> #{index + 1} has no <PMID>")
        article = citation.find("Article")
        # A citation of an article in another language may have only its original-language title.
        title = (_text(article.find("ArticleTitle")) or _text(article.find("VernacularTitle"))) \
            if article is not None else ""
        if not title:
            raise InputError(f"{path}: <MedlineCitation> PMID {pmid} has no <Article>/<ArticleTitle>")
        parts = []
        for node in article.findall("./Abstract/AbstractText"):
            label = node.get("Label")
            parts.append(f"{label}: {_text(node)}" if label else _text(node))
        doi = None
        for loc in article.findall("ELocationID"):
            if loc.get("EIdType") == "doi":
                doi = clean_text(loc.text)
        sections = [("Abstract", clean_text(" ".join(parts)))] if parts else []
        meta = {"file": str(path)}
        if any(clean_text(kind.text) == "Retracted Publication"
               for kind in article.iterfind("./PublicationTypeList/PublicationType")):
            meta["withdrawn"] = "retracted"
        yield Document(doc_id=stable_doc_id(corpus, pmid=pmid), corpus=corpus, source_format="medline",
                       title=title, sections=sections, url=f"https://pubmed.ncbi.nlm.nih.gov/{pmid}/",
                       doi=doi, pmid=pmid, meta=meta)
    for pmid in deletions:
        yield Document(doc_id=stable_doc_id(corpus, pmid=pmid), corpus=corpus, source_format="medline", title="",
                       sections=[], pmid=pmid, meta={"withdrawn": "deleted"})
