"""ICD vocabulary tables, code helpers, harmonization and the validator V(.), on the packaged data."""

from __future__ import annotations

import doctest
from collections import Counter
from datetime import datetime

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dxr.errors import InputError, NotFoundError
from tests.conftest import shared_data
from warehouse import vocab
from warehouse.schemas import TABLES
from warehouse.store import Warehouse, conform
from warehouse.vocab import (Vocabulary, dotted, gem_table, harmonize_codes, harmonized_vocabulary, icd9_codes,
                             icd10_codes, icd10_notes, load_vocabularies, meds_code, parse_meds_code)


def dx(version: int, raw: str) -> str:
    return f"DIAGNOSIS//ICD//{version}//{raw}"


@pytest.fixture(scope="session")
def tables() -> dict[str, pl.DataFrame]:
    """Every vocabulary table, built once (about 6 s)."""
    icd10, icd9 = icd10_codes(), icd9_codes()
    return {"icd10": icd10, "icd9": icd9, "notes": icd10_notes(), "gem": gem_table(),
            "titles": pl.concat([icd10, icd9]).select("code", "title")}


@pytest.fixture(scope="session")
def icd10_vocabulary(tables) -> Vocabulary:
    """Ω of an ICD-10 cohort without a dataset dictionary: the release's billable codes."""
    billable = tables["icd10"].filter("billable")
    return Vocabulary(dict(zip(billable["code"], billable["title"])))


def titles_of(frame: pl.DataFrame, *codes: str) -> dict[str, str]:
    return dict(frame.filter(pl.col("code").is_in(list(codes))).select("code", "title").iter_rows())


# ---- code helpers --------------------------------------------------------------------------------

def test_doctests():
    assert doctest.testmod(vocab).failed == 0


def test_meds_code_round_trip():
    assert meds_code(10, "I50.22") == "DIAGNOSIS//ICD//10//I5022"
    assert meds_code(10, " i5022 ") == "DIAGNOSIS//ICD//10//I5022"
    assert meds_code(9, "E849.7") == "DIAGNOSIS//ICD//9//E8497"
    assert parse_meds_code("DIAGNOSIS//ICD//9//V4581") == ("DIAGNOSIS", 9, "V4581")
    assert parse_meds_code("PROCEDURE//ICD//10//02703ZZ") == ("PROCEDURE", 10, "02703ZZ")


@pytest.mark.parametrize("bad", ["DIAGNOSIS//ICD//10//I50.22", "diagnosis//icd//10//I5022", "DIAGNOSIS//ICD//11//I5022",
                                 "ICD10//I5022", "I5022", "DIAGNOSIS//ICD//10//", "LAB//123//mg", None])
def test_parse_meds_code_rejects_malformed(bad):
    with pytest.raises(InputError, match="malformed MEDS ICD code"):
        parse_meds_code(bad)


def test_meds_code_rejects_bad_input():
    with pytest.raises(InputError, match="use 9 or 10"):
        meds_code(11, "I5022")
    with pytest.raises(InputError, match="'I50 22'"):
        meds_code(10, "I50 22")


def test_dotted():
    assert [dotted(10, c) for c in ("I5022", "I50", "S72001A", "E119", "I30-I5A")] == [
        "I50.22", "I50", "S72.001A", "E11.9", "I30-I5A"]
    assert [dotted(9, c) for c in ("4280", "428", "25000", "V4581", "V45", "E8497", "E849", "E0000", "001-139")] == [
        "428.0", "428", "250.00", "V45.81", "V45", "E849.7", "E849", "E000.0", "001-139"]


# ---- table builders ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key,table", [("icd10", "icd_codes"), ("icd9", "icd_codes"), ("notes", "icd_notes"),
                                       ("gem", "gem_map")])
def test_builders_conform_to_schema(tables, key, table):
    arrow = conform(TABLES[table], tables[key])
    assert arrow.column_names == list(TABLES[table].columns)
    assert arrow.num_rows == tables[key].height


def test_icd10_codes(tables):
    codes = tables["icd10"]
    # 98,505 items in the FY2026 tabular list; 39 blocks named like their only category are merged into it.
    assert codes.height == 98_466
    assert codes["code"].n_unique() == codes.height
    assert codes["billable"].sum() == 74_731
    assert codes.filter(pl.col("parent").is_null())["raw_code"].len() == 22  # the chapters
    dangling = codes.filter(pl.col("parent").is_not_null() & ~pl.col("parent").is_in(codes["code"].implode()))
    assert dangling.height == 0
    rows = {r["raw_code"]: r for r in codes.filter(
        pl.col("raw_code").is_in(["I5022", "I502", "I50", "R99", "B99", "S72001A"])).iter_rows(named=True)}
    assert rows["I5022"] == {
        "code": "DIAGNOSIS//ICD//10//I5022", "icd_version": 10, "raw_code": "I5022", "dotted": "I50.22",
        "title": "Chronic systolic (congestive) heart failure", "parent": "DIAGNOSIS//ICD//10//I502",
        "chapter": "DIAGNOSIS//ICD//10//I00-I99", "billable": True}
    assert (rows["I502"]["billable"], rows["I50"]["billable"], rows["I50"]["parent"]) == (
        False, False, "DIAGNOSIS//ICD//10//I30-I5A")
    # R99 is both a block and its only (billable) category; B99 the same but with children.
    assert (rows["R99"]["billable"], rows["R99"]["parent"]) == (True, "DIAGNOSIS//ICD//10//R00-R99")
    assert (rows["B99"]["billable"], rows["B99"]["parent"]) == (False, "DIAGNOSIS//ICD//10//A00-B99")
    assert rows["S72001A"]["billable"] and rows["S72001A"]["dotted"] == "S72.001A"


def test_icd9_codes(tables):
    codes = tables["icd9"]
    assert codes["code"].n_unique() == codes.height == 17_726
    assert codes["billable"].sum() == 14_567
    dangling = codes.filter(pl.col("parent").is_not_null() & ~pl.col("parent").is_in(codes["code"].implode()))
    assert dangling.height == 0
    picked = codes.filter(pl.col("raw_code").is_in(["4280", "428", "E8497", "E849", "V4581", "38600"]))
    assert picked.sort("raw_code").select("raw_code", "dotted", "title", "parent", "chapter", "billable").rows() == [
        ("38600", "386.00", "Ménière's disease, unspecified", dx(9, "3860"), dx(9, "320-389"), True),
        ("428", "428", "Heart failure", dx(9, "420-429"), dx(9, "390-459"), False),
        ("4280", "428.0", "Congestive heart failure, unspecified", dx(9, "428"), dx(9, "390-459"), True),
        ("E849", "E849", "Place of occurrence", dx(9, "E846-E849"), dx(9, "E000-E999"), False),
        ("E8497", "E849.7", "Accidents occurring in residential institution", dx(9, "E849"), dx(9, "E000-E999"), True),
        ("V4581", "V45.81", "Aortocoronary bypass status", dx(9, "V458"), dx(9, "V01-V91"), True),
    ]


def test_icd10_notes_own_and_inherited(tables):
    notes = tables["notes"]
    assert notes.select("code", "kind", "text").n_unique() == notes.height
    assert set(notes["kind"].unique()) == set(vocab.NOTE_KINDS)
    i5022 = notes.filter(pl.col("code") == dx(10, "I5022"))
    rows = set(i5022.select("kind", "text", "inherited_from").iter_rows())
    # I50.22 has no notes of its own: everything comes from I50.2, I50 and chapter 9.
    assert i5022["inherited_from"].null_count() == 0
    assert ("excludes1", "combined systolic (congestive) and diastolic (congestive) heart failure (I50.4-)",
            dx(10, "I502")) in rows
    assert ("inclusion_term", "Heart failure with reduced ejection fraction [HFrEF]", dx(10, "I502")) in rows
    assert ("excludes2", "cardiac arrest (I46.-)", dx(10, "I50")) in rows
    assert ("code_first", "heart failure due to hypertension (I11.0)", dx(10, "I50")) in rows
    assert ("excludes2", "neoplasms (C00-D49)", dx(10, "I00-I99")) in rows
    assert i5022.height == 22
    own = notes.filter(pl.col("code") == dx(10, "I502"), pl.col("inherited_from").is_null())
    assert own.select("kind", "text").rows() == [
        ("inclusion_term", "Heart failure with reduced ejection fraction [HFrEF]"),
        ("inclusion_term", "Systolic left ventricular heart failure"),
        ("excludes1", "combined systolic (congestive) and diastolic (congestive) heart failure (I50.4-)"),
        ("code_also", "end stage heart failure, if applicable (I50.84)"),
    ]
    # Non-billable codes list their own notes only.
    assert notes.filter(pl.col("code") == dx(10, "I502"), pl.col("inherited_from").is_not_null()).height == 0


def test_gem_one_to_many(tables):
    gem = tables["gem"]
    assert gem.group_by("direction").len().sort("direction").rows() == [("10to9", 78_838), ("9to10", 23_912)]
    forward = gem.filter(pl.col("direction") == "9to10")
    postop = forward.filter(pl.col("source_code") == dx(9, "99859")).sort("target_code")
    assert postop.select("target_code", "approximate", "combination").rows() == [
        (dx(10, "K6811"), True, False), (dx(10, "T814XXA"), True, False)]
    glanders = forward.filter(pl.col("source_code") == dx(9, "0730")).sort("target_code")
    assert glanders.select("target_code", "combination", "scenario", "choice_list").rows() == [
        (dx(10, "A70"), True, 1, 1), (dx(10, "J17"), True, 1, 2)]
    no_dx = forward.filter(pl.col("source_code") == dx(9, "E9342"))
    assert no_dx.select("target_code", "no_map").rows() == [(None, True)]
    backward = gem.filter(pl.col("direction") == "10to9", pl.col("source_code") == dx(10, "I5022"))
    assert sorted(backward["target_code"]) == [dx(9, "4280"), dx(9, "42822"), dx(9, "42822")]


def test_load_vocabularies_is_idempotent(tmp_path, tables):
    wh = Warehouse(tmp_path)
    written = load_vocabularies(wh)
    assert written == {
        "icd_codes[icd_version=10]": tables["icd10"].height, "icd_codes[icd_version=9]": tables["icd9"].height,
        "icd_notes[icd_version=10]": tables["notes"].height, "gem_map[direction=9to10]": 23_912,
        "gem_map[direction=10to9]": 78_838,
    }
    assert load_vocabularies(wh) == {}
    with wh.connect() as con:
        counts = con.execute("SELECT icd_version, count(*), sum(billable::INT) FROM icd_codes "
                             "GROUP BY 1 ORDER BY 1").fetchall()
        assert counts == [(9, 17_726, 14_567), (10, 98_466, 74_731)]
        assert con.execute("SELECT count(*) FROM gem_map").fetchone() == (102_750,)
    wh.delete("gem_map", direction="10to9")
    assert load_vocabularies(wh) == {"gem_map[direction=10to9]": 78_838}
    assert set(load_vocabularies(wh, force=True)) == set(written)


# ---- harmonization --------------------------------------------------------------------------------

SOURCES = [dx(9, "4280"), dx(9, "99859"), dx(9, "V4581"), dx(9, "E8497"), dx(9, "E9342"), dx(10, "I5022"),
           dx(9, "4280")]


def test_harmonize_native_is_identity(tables):
    out = harmonize_codes(SOURCES, "native", tables["gem"], tables["titles"])
    assert out.rows() == [(c, c) for c in sorted(set(SOURCES))]


def test_harmonize_icd10_maps_to_every_gem_target(tables):
    # Every non-NoDx target of every forward row: both alternatives of a choice list (780.60 fever → R50.2 and
    # R50.9; 998.59 → K68.11 and T81.4XXA, read as its tables' ancestor T81.4), both parts of a combination
    # (ornithosis with pneumonia → A70 + J17). A code the GEM does not list (585) or maps to NoDx only (E934.2)
    # gets no row.
    sources = [dx(9, "78060"), dx(9, "99859"), dx(9, "0730"), dx(9, "585"), dx(9, "E9342"), dx(10, "I5022")]
    out = harmonize_codes(sources, "icd10", tables["gem"], tables["titles"])
    assert out.rows() == [(dx(10, "I5022"), dx(10, "I5022")),
                          (dx(9, "0730"), dx(10, "A70")), (dx(9, "0730"), dx(10, "J17")),
                          (dx(9, "78060"), dx(10, "R502")), (dx(9, "78060"), dx(10, "R509")),
                          (dx(9, "99859"), dx(10, "K6811")), (dx(9, "99859"), dx(10, "T814"))]


def test_harmonize_icd10_closest_one_code_per_choice_list(tables):
    out = harmonize_codes(pl.Series(SOURCES), "icd10_closest", tables["gem"], tables["titles"])
    assert out.rows() == [
        (dx(10, "I5022"), dx(10, "I5022")),
        (dx(9, "4280"), dx(10, "I509")),
        # Two alternatives: K68.11 "Postprocedural retroperitoneal abscess", and T81.4XXA, split after the
        # GEM's release (no code of the tables, so no title), read as its ancestor T81.4 "Infection following a
        # procedure". It shares "infection" with "Other postoperative infection"; the untitled code once lost
        # the tie to the lower code, the abscess, and would have entered Ω without a title.
        (dx(9, "99859"), dx(10, "T814")),
        (dx(9, "E8497"), dx(10, "Y92199")),
        (dx(9, "V4581"), dx(10, "Z951")),
    ]  # E934.2 maps to NoDx only: no row


def test_harmonize_icd10_closest_picks_alternatives_by_title_and_keeps_combinations(tables):
    sources = [dx(9, "78060"), dx(9, "27669"), dx(9, "0730")]
    out = harmonize_codes(sources, "icd10_closest", tables["gem"], tables["titles"])
    # The GEM lists R50.2 (drug induced fever) and R50.9 for 780.60 "Fever, unspecified", E87.70 and
    # E87.79 for 276.69 "Other fluid overload": one alternative each, the one named like the source.
    # Ornithosis with pneumonia needs two codes (one per choice list of its combination): both stay.
    assert out.rows() == [(dx(9, "0730"), dx(10, "A70")), (dx(9, "0730"), dx(10, "J17")),
                          (dx(9, "27669"), dx(10, "E8779")), (dx(9, "78060"), dx(10, "R509"))]


def test_harmonize_icd10_closest_maps_codes_missing_from_the_gem_through_their_children(tables):
    # 585 and 276.6 were billable before being split (585.1-585.9, 276.61/276.69), so the GEM does
    # not list them; their children's codes share N18 and E87.7. 780.6's children spread over R50
    # and R68, and the V45 category's over several Z categories: no common category, no row.
    sources = [dx(9, "585"), dx(9, "2766"), dx(9, "7806"), dx(9, "V45")]
    out = harmonize_codes(sources, "icd10_closest", tables["gem"], tables["titles"])
    assert out.rows() == [(dx(9, "2766"), dx(10, "E877")), (dx(9, "585"), dx(10, "N18"))]


def test_harmonize_icd10_closest_yields_only_codes_of_the_tables(tables):
    # 165 ICD-9 codes had a GEM target that ICD-10-CM FY2026 no longer has (skull fractures S02.10XA, now
    # S02.101A-S02.109A; glaucoma H40.11X0): they became untitled Ω codes that no model output could match.
    sources = [dx(9, "80100"), dx(9, "36511"), dx(9, "99859")]
    out = harmonize_codes(sources, "icd10_closest", tables["gem"], tables["titles"])
    titled = dict(tables["titles"].iter_rows())
    assert [(source, code, titled[code]) for source, code in out.rows()] == [
        (dx(9, "36511"), dx(10, "H4011"), "Primary open-angle glaucoma"),
        (dx(9, "80100"), dx(10, "S0210"), "Unspecified fracture of base of skull"),
        (dx(9, "99859"), dx(10, "T814"), "Infection following a procedure"),
    ]
    listed = tables["gem"].filter(pl.col("direction") == "9to10")["source_code"].unique()
    for mode in ("icd10", "icd10_closest"):
        every = harmonize_codes(listed, mode, tables["gem"], tables["titles"])
        assert every.join(tables["titles"], on="code", how="anti").is_empty(), mode


def test_harmonize_category_truncates_within_version(tables):
    out = harmonize_codes(SOURCES, "category", tables["gem"], tables["titles"])
    assert out.rows() == [
        (dx(10, "I5022"), dx(10, "I50")),
        (dx(9, "4280"), dx(9, "428")),
        (dx(9, "99859"), dx(9, "998")),
        (dx(9, "E8497"), dx(9, "E849")),
        (dx(9, "E9342"), dx(9, "E934")),
        (dx(9, "V4581"), dx(9, "V45")),
    ]


def test_harmonize_rejects_bad_codes(tables):
    with pytest.raises(InputError, match="cannot harmonize 'PROCEDURE//ICD//9//3615' to icd10"):
        harmonize_codes(["PROCEDURE//ICD//9//3615"], "icd10", tables["gem"], tables["titles"])
    with pytest.raises(InputError, match="cannot harmonize 'DIAGNOSIS//ICD//10//I50.22' to category"):
        harmonize_codes([dx(10, "I50.22")], "category", tables["gem"], tables["titles"])
    assert harmonize_codes(["DIAGNOSIS//SNOMED//84114007"], "native", tables["gem"], tables["titles"]).rows() == [
        ("DIAGNOSIS//SNOMED//84114007", "DIAGNOSIS//SNOMED//84114007")]
    with pytest.raises(InputError, match="harmonization 'icd11' is unknown"):
        harmonize_codes([dx(10, "I5022")], "icd11", tables["gem"], tables["titles"])


def test_harmonized_vocabulary_titles(tables):
    omega = pl.DataFrame({"code": [dx(9, "4280"), dx(9, "V4581"), dx(9, "E8497"), dx(10, "I509")],
                          "title": ["CHF NOS (dataset title)", "Aortocoronary bypass status",
                                    "Accidents occurring in residential institution", "Heart failure NOS (dataset)"]})
    titles = pl.concat([tables["icd10"], tables["icd9"]]).select("code", "title")
    category = harmonized_vocabulary(omega, "category", tables["gem"], titles)
    assert category.rows() == [
        (dx(10, "I50"), 10, "Heart failure"),
        (dx(9, "428"), 9, "Heart failure"),
        (dx(9, "E849"), 9, "Place of occurrence"),
        (dx(9, "V45"), 9, "Other postprocedural states"),
    ]
    assert category.schema == pl.Schema({"code": pl.String, "icd_version": pl.Int8, "title": pl.String})
    icd10 = harmonized_vocabulary(omega, "icd10", tables["gem"], titles)
    # I50.9 was already in Ω: it keeps the dataset's own title.
    assert icd10.rows() == [
        (dx(10, "I509"), 10, "Heart failure NOS (dataset)"),
        (dx(10, "Y92199"), 10, "Unspecified place in other specified residential institution as the place of "
                               "occurrence of the external cause"),
        (dx(10, "Z951"), 10, "Presence of aortocoronary bypass graft"),
    ]
    native = harmonized_vocabulary(omega, "native", tables["gem"], titles)
    assert native.rows() == [
        (dx(10, "I509"), 10, "Heart failure NOS (dataset)"),
        (dx(9, "4280"), 9, "CHF NOS (dataset title)"),
        (dx(9, "E8497"), 9, "Accidents occurring in residential institution"),
        (dx(9, "V4581"), 9, "Aortocoronary bypass status"),
    ]


# ---- the validator V(.) -------------------------------------------------------------------------------

def test_validate_normalizes_and_counts_drops(icd10_vocabulary):
    items = [
        "I50.22", "i5022", " I50.22 ", "ICD_I5022", "ICD10:I50.22", "DIAGNOSIS//ICD//10//I5022",
        "E11.9 - Type 2 diabetes mellitus without complications", "E11.9 (Type 2 diabetes)",
        "ICD-10-CM: N18.6 end-stage renal disease", "Type 2 diabetes (E11.9)", "**J18.9** pneumonia",
        "I50.2", "428.0", "4280", "ICD9:428.0", "DIAGNOSIS//ICD//9//4280",
        "02703ZZ", "PROCEDURE//ICD//10//02703ZZ", "36.15",
        "", "   ", None, "heart failure", "LAB//50912//mg/dL", "CPT 99213", "Z99.2",
    ]
    result = icd10_vocabulary.validate(items)
    assert result.codes == [dx(10, "I5022"), dx(10, "E119"), dx(10, "N186"), dx(10, "J189"), dx(10, "Z992")]
    assert result.titles == ["Chronic systolic (congestive) heart failure",
                             "Type 2 diabetes mellitus without complications", "End stage renal disease",
                             "Pneumonia, unspecified organism", "Dependence on renal dialysis"]
    assert result.drops == Counter({"duplicate": 7, "wrong_icd_version": 4, "procedure_code": 3, "blank": 3,
                                    "not_in_vocabulary": 1, "malformed": 1, "non_diagnosis": 2})
    assert sum(result.drops.values()) + len(result.codes) == len(items)
    assert result.rejected[7:10] == [("I50.2", "not_in_vocabulary"), ("428.0", "wrong_icd_version"),
                                    ("4280", "wrong_icd_version")]


def test_validate_reason_of_each_item(icd10_vocabulary):
    assert icd10_vocabulary.resolve("I50.2") == (None, "not_in_vocabulary")
    assert icd10_vocabulary.resolve("V45.81") == (None, "wrong_icd_version")  # ICD-9 V code
    assert icd10_vocabulary.resolve("E849.7") == (None, "wrong_icd_version")  # ICD-9 E code
    assert icd10_vocabulary.resolve("ICD-10-PCS 02703ZZ") == (None, "procedure_code")
    assert icd10_vocabulary.resolve("ICD-11 BA00") == (None, "wrong_icd_version")
    assert icd10_vocabulary.resolve("S72.001A") == (dx(10, "S72001A"), None)
    assert icd10_vocabulary.resolve("XYZ") == (None, "malformed")


def test_validate_reads_the_code_through_formatting_noise(icd10_vocabulary):
    # What chat models write around a code: full-width digits (CJK replies), invisible characters, list bullets,
    # curly quotes, braces, a question mark; none changes which code is meant.
    written = ["Ｉ５０．２２", "I50.22\u200b", "\ufeffI50.22", "I50.22\u00ad", "- I50.22", "• I50.22", "“I50.22”",
               "{I50.22}", "< I50.22 >", "I50.22?"]
    assert [icd10_vocabulary.resolve(item) for item in written] == [(dx(10, "I5022"), None)] * len(written)


def test_validate_finds_a_code_after_words(icd10_vocabulary):
    assert icd10_vocabulary.resolve("Hypertension (I10)") == (dx(10, "I10"), None)
    assert icd10_vocabulary.resolve("ICD-10-CM code: I50.22") == (dx(10, "I5022"), None)
    # A bare 3-character word that looks like a code gives way to the dotted code after it.
    assert icd10_vocabulary.resolve("Vitamin B12 deficiency anemia (D51.0)") == (dx(10, "D510"), None)
    # A version named before the words still decides: an ICD-9 code is never read into an ICD-10 Ω.
    assert icd10_vocabulary.resolve("ICD-9 code 428.0") == (None, "wrong_icd_version")


def test_validate_finds_an_undotted_code_in_text(icd10_vocabulary):
    assert icd10_vocabulary.resolve("Heart failure (I5022)") == (dx(10, "I5022"), None)
    assert icd10_vocabulary.resolve("Essential hypertension [I10]") == (dx(10, "I10"), None)
    assert icd10_vocabulary.resolve("ICD-10 code: S72001A") == (dx(10, "S72001A"), None)
    # Never a child guessed for a non-billable parent, never a cross-version read, a written version still decides.
    assert icd10_vocabulary.resolve("Heart failure (I502)") == (None, "not_in_vocabulary")
    assert icd10_vocabulary.resolve("CHF - 42822") == (None, "malformed")
    assert icd10_vocabulary.resolve("Aortocoronary bypass (V4581)") == (None, "wrong_icd_version")
    # No ICD-9 code has the shape of I5022 (nor of I50.22): under a written ICD-9 it is no code at all.
    assert icd10_vocabulary.resolve("ICD-9: heart failure (I5022)") == (None, "malformed")
    # A number in text is read only as a code of Ω: a year is no drop reason of its own.
    assert icd10_vocabulary.resolve("CHF since 2019") == (None, "malformed")
    assert icd10_vocabulary.resolve("Portal vein thrombosis since 2019 (I81)") == (dx(10, "I81"), None)


def test_validate_looks_past_a_code_shaped_word_that_is_no_code_of_omega(icd10_vocabulary):
    assert icd10_vocabulary.resolve("T2DM (E11.9)") == (dx(10, "E119"), None)
    assert icd10_vocabulary.resolve("B12 deficiency anemia (D51.0)") == (dx(10, "D510"), None)
    assert icd10_vocabulary.resolve("CKD3 (N1830)") == (dx(10, "N1830"), None)
    # A first token that is a code of Ω is the code, whatever follows; among several codes of Ω a dotted one wins.
    assert icd10_vocabulary.resolve("I10 (I50.22)") == (dx(10, "I10"), None)
    assert icd10_vocabulary.resolve("T2DM (E119), CHF (I50.22)") == (dx(10, "I5022"), None)
    assert icd10_vocabulary.resolve("T2DM (E119), CHF (I5022)") == (dx(10, "E119"), None)
    # Without a code of Ω after it, the first token's reason stands.
    assert icd10_vocabulary.resolve("428.0 Congestive heart failure (4280)") == (None, "wrong_icd_version")
    assert icd10_vocabulary.resolve("I50.2 heart failure") == (None, "not_in_vocabulary")
    assert icd10_vocabulary.resolve("ICD-9 428.0 (I50.22)") == (None, "wrong_icd_version")


def test_validate_counts_long_ids_of_other_code_systems_as_non_diagnosis(icd10_vocabulary):
    assert icd10_vocabulary.resolve("SNOMED 84114007") == (None, "non_diagnosis")
    assert icd10_vocabulary.resolve("RxNorm 1049630") == (None, "non_diagnosis")


def test_mixed_version_vocabulary_prefers_icd10_unless_disambiguated():
    # E8300 is ICD-10 E83.00 (copper metabolism) and ICD-9 E830.0 (watercraft accident).
    omega = {dx(10, "E8300"): "Disorder of copper metabolism, unspecified",
             dx(9, "E8300"): "Accident to watercraft causing submersion, injuring occupant of small boat, unpowered",
             dx(9, "4280"): "Congestive heart failure, unspecified", dx(10, "I5022"): "Chronic systolic heart failure"}
    voc = Vocabulary(omega)
    assert voc.versions == frozenset({9, 10})
    assert [voc.resolve(i)[0] for i in ("E8300", "E83.00", "E830.0", "ICD9:E8300", "DIAGNOSIS//ICD//9//E8300",
                                        "428.0", "i5022")] == [
        dx(10, "E8300"), dx(10, "E8300"), dx(9, "E8300"), dx(9, "E8300"), dx(9, "E8300"), dx(9, "4280"),
        dx(10, "I5022")]
    assert voc.resolve(428.0) == (dx(9, "4280"), None)
    assert voc.resolve("I50.9") == (None, "not_in_vocabulary")
    assert voc.resolve("428.1") == (None, "not_in_vocabulary")


def test_category_vocabulary_resolves_full_codes_to_their_category():
    icd10 = Vocabulary({dx(10, "I50"): "Heart failure", dx(10, "E11"): "Type 2 diabetes mellitus"}, "category")
    result = icd10.validate(["I50.22", "I50", "E11.9", "428.0", "I50.99999", "I51.9"])
    assert result.codes == [dx(10, "I50"), dx(10, "E11")]
    assert result.drops == Counter({"duplicate": 2, "wrong_icd_version": 1, "not_in_vocabulary": 1})
    icd9 = Vocabulary({dx(9, "428"): "Heart failure", dx(9, "E849"): "Place of occurrence",
                       dx(9, "V45"): "Other postprocedural states"}, "category")
    assert icd9.validate(["428.0", "E849.7", "V45.81", "I50.22"]).codes == [dx(9, "428"), dx(9, "E849"), dx(9, "V45")]
    assert icd9.resolve("I50.22") == (None, "wrong_icd_version")


def test_native_vocabulary_with_other_code_systems():
    voc = Vocabulary({"DIAGNOSIS//SNOMED//84114007": "Heart failure"})
    assert voc.resolve("diagnosis//snomed//84114007") == ("DIAGNOSIS//SNOMED//84114007", None)
    assert voc.resolve("I50.22") == (None, "not_in_vocabulary")


def test_vocabulary_rejects_bad_construction():
    with pytest.raises(InputError, match="harmonization 'icd9' is unknown"):
        Vocabulary({dx(10, "I5022"): "x"}, "icd9")
    with pytest.raises(InputError, match="is a procedure"):
        Vocabulary({"PROCEDURE//ICD//10//02703ZZ": "x"})


def test_vocabulary_from_warehouse(tmp_path):
    wh = Warehouse(tmp_path)
    cohort_id = "c0ffee"
    wh.write("cohorts", pl.DataFrame({
        "cohort_id": [cohort_id], "dataset_id": ["demo"], "name": ["demo"], "target_rule": ["final"],
        "harmonization": ["category"], "min_history": [1], "created_at": [datetime(2026, 1, 1)],
        "n_trajectories": [0], "vocabulary_size": [2], "vocabulary_source": ["test"], "options_json": ["{}"],
        "dataset_fingerprint": [None], "cut_rule_version": [None],
    }), cohort_id=cohort_id)
    wh.write("cohort_vocabulary", pl.DataFrame({
        "cohort_id": [cohort_id] * 2, "code": [dx(10, "I50"), dx(10, "E11")], "icd_version": [10, 10],
        "title": ["Heart failure", None]}), cohort_id=cohort_id)
    with wh.connect() as con:
        voc = Vocabulary.from_warehouse(con, cohort_id)
        assert (len(voc), voc.harmonization) == (2, "category")
        result = voc.validate(["E11.9", "I50.22"])
        assert (result.codes, result.titles) == ([dx(10, "E11"), dx(10, "I50")], [None, "Heart failure"])
        with pytest.raises(NotFoundError, match="'nope' is not in the cohorts table"):
            Vocabulary.from_warehouse(con, "nope")


def test_mimic_iii_dictionary_as_omega():
    d = pl.read_csv(shared_data("mimic-iii-demo", "D_ICD_DIAGNOSES.csv"), schema_overrides={"icd9_code": pl.String})
    voc = Vocabulary({meds_code(9, c): t for c, t in d.select("icd9_code", "long_title").iter_rows()})
    assert (len(voc), voc.versions) == (14_567, frozenset({9}))
    result = voc.validate(["428.0", "V45.81 aortocoronary bypass status", "E849.7", "4280", "I50.22", "36.15",
                           "PROCEDURE//ICD//9//3615", "428", "Congestive heart failure (428.0)", "ICD-9 code 250.00",
                           "４０１．９", "- 038.9", "CHF - 42822", "Hypertension (4019)", "Depression (311)"])
    assert result.codes == [dx(9, "4280"), dx(9, "V4581"), dx(9, "E8497"), dx(9, "25000"), dx(9, "4019"),
                            dx(9, "0389"), dx(9, "42822"), dx(9, "311")]
    assert result.titles == ["Congestive heart failure, unspecified", "Aortocoronary bypass status",
                             "Accidents occurring in residential institution",
                             "Diabetes mellitus without mention of complication, type II or unspecified type, not "
                             "stated as uncontrolled", "Unspecified essential hypertension", "Unspecified septicemia",
                             "Chronic systolic heart failure", "Depressive disorder, not elsewhere classified"]
    assert result.drops == Counter({"duplicate": 3, "wrong_icd_version": 1, "procedure_code": 2,
                                    "not_in_vocabulary": 1})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.one_of(
    st.none(), st.text(max_size=30),
    st.sampled_from(["I50.22", "i5022", "428.0", "E11.9 - T2DM", "02703ZZ", "I50.2", "N18.6", "Z99.2", "V45.81"]),
    st.from_regex(r"[A-Z][0-9]{2}(\.[0-9A-Z]{1,4})?", fullmatch=True)), max_size=25))
def test_validate_invariants(icd10_vocabulary, items):
    result = icd10_vocabulary.validate(items)
    assert len(result.codes) + sum(result.drops.values()) == len(items)
    assert len(set(result.codes)) == len(result.codes) == len(result.titles)
    assert all(code in icd10_vocabulary for code in result.codes)
    assert set(result.drops) <= set(vocab.DROP_REASONS)
    # Canonical output validates to itself.
    again = icd10_vocabulary.validate(result.codes)
    assert (again.codes, again.drops) == (result.codes, Counter())
