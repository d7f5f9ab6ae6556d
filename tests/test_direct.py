"""Direct Forecast end to end on the tiny cohort (replay backend), Union + RRF, and the information boundary."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta

import polars as pl
import pytest

from dxr.errors import NotFoundError
from models.llm.backends import Completion, append_recording
from models.llm.client import FEEDBACK_RESERVE_CHARS, LLMClient
from models.llm.config import LLMConfig
from models.llm.prompts import load_prompt
from tasks.direct import (RRF_K0, direct_prompt, direct_shard, fuse_prior_direct, prompt_fields, rrf_fuse,
                          rrf_prior_direct_shard)
from tasks.efficiency import run_efficiency
from tasks.forecast import (CANDIDATE_GENERATION_SIZE, CANDIDATE_STAGES, LLM_RUN_KEYS, shard_inputs, shard_status,
                            stage_candidates, write_shard_outputs)
from tests.conftest import FUROSEMIDE, cohort_inputs, write_described_meds
from tests.sentinel import assert_no_leak, forecast_store_texts
from warehouse.cohorts import CohortOptions, build_cohort, code_titles
from warehouse.datasets import ingest_meds
from warehouse.vocab import Vocabulary

# 21 valid ICD-10-CM codes in the model's own spelling, most likely first.
VALID = ["I50.22", "E11.9", "N17.9", "I10", "J18.9", "I48.91", "N18.30", "E78.5", "I25.10", "J44.9", "E87.1",
         "D64.9", "I50.23", "E11.22", "Z79.4", "K21.9", "F32.9", "E03.9", "G47.33", "M19.90", "Z95.1"]


def predictions(codes, start=95.0):
    return {"predictions": [{"code": c, "confidence": start - i} for i, c in enumerate(codes)]}


def test_rrf_on_a_hand_example():
    # prior A, B, C; direct C, A, D: A = 1/61 + 1/62, C = 1/63 + 1/61, B = 1/62, D = 1/63.
    fused = rrf_fuse([["A", "B", "C"], ["C", "A", "D"]])
    assert fused == [("A", 1 / 61 + 1 / 62), ("C", 1 / 61 + 1 / 63), ("B", 1 / 62), ("D", 1 / 63)]
    assert RRF_K0 == 60
    # Equal scores are ordered by code.
    assert rrf_fuse([["B"], ["A"]]) == [("A", 1 / 61), ("B", 1 / 61)]


def one_reply_each(tmp_path) -> LLMConfig:
    """A replay backend that answers each trajectory once, as the llama.cpp server is asked (no re-ask)."""
    return LLMConfig(backend="replay", replay_file=tmp_path / "replay.jsonl", model="recorded",
                     response_format="json_object_schema", validation_retries=0)


def record_replies(config: LLMConfig, wh, cohort_id, trajectories, pretarget, replies) -> list[str]:
    """Record one reply per trajectory for exactly the request Direct Forecast will send; returns prompt texts."""
    vocabulary = Vocabulary.from_warehouse(wh.connect(), cohort_id)
    titles = code_titles(wh, cohort_id)
    probe = LLMClient(config, backend=None)
    texts = []
    for trajectory_id, reply in zip(trajectories["trajectory_id"].to_list(), replies):
        rendered = direct_prompt(pretarget.filter(pl.col("trajectory_id") == trajectory_id), vocabulary, config,
                                 code_titles=titles)
        texts += [m["content"] for m in rendered.messages]
        request = probe.request(rendered.messages, load_prompt("direct_forecast").schema)
        append_recording(config.replay_file, request, Completion(json.dumps(reply), 800, 0, 300))
    return texts


def test_direct_forecast_end_to_end_with_recorded_replies(planted_cohort, tmp_path):
    wh, cohort_id, sentinels = planted_cohort
    trajectories, pretarget = cohort_inputs(wh, cohort_id)
    assert trajectories.height == 3
    config = one_reply_each(tmp_path)
    rising = predictions(VALID)
    rising["predictions"][5]["confidence"] = 99  # confidences must not increase: invalid, no retry left
    # Codes tagged with their ICD version, as V(.) reads them, pass the reply's schema: V(.) resolves them, or
    # drops and counts them (an ICD-9 code in an ICD-10 cohort), rather than the schema having them re-asked.
    tagged = ["ICD10:I50.22", "ICD-10-CM E11.9", "ICD_N179", "icd10 I10"]
    replies = [
        predictions(VALID[:19] + ["i50.22", "U99.99", "ICD-9-CM 428.0"]),  # a duplicate, an unknown, an ICD-9 code
        predictions(tagged + VALID[len(tagged):]),
        rising,
    ]
    prompt_texts = record_replies(config, wh, cohort_id, trajectories, pretarget, replies)

    assert direct_shard(wh, cohort_id, 0, trajectories, pretarget, 20, "run-d", config) == 3
    ids = trajectories["trajectory_id"].to_list()
    status = wh.read("ranking_status", run_id="run-d", system="direct").sort("trajectory_id")
    assert status.select("trajectory_id", "status").rows() == [(ids[0], "short"), (ids[1], "ok"), (ids[2], "failed")]
    assert status["detail"][0] == "19 of 20 codes; dropped 1 duplicate, 1 not_in_vocabulary, 1 wrong_icd_version"
    assert status["detail"][1] is None
    assert status["detail"][2] == (f"direct reply for {ids[2]} stayed invalid after 1 attempt: at predictions/5/"
                                   "confidence: 99 is higher than the 91.0 before it; confidences must not increase")

    rankings = wh.read("rankings", run_id="run-d", system="direct")
    second = rankings.filter(pl.col("trajectory_id") == ids[1]).sort("rank")
    assert second["code"].to_list() == [f"DIAGNOSIS//ICD//10//{c.replace('.', '')}" for c in VALID]
    assert second["score"].to_list() == [95.0 - i for i in range(21)]
    assert second["native"].all() and rankings["cohort_id"].unique().to_list() == [cohort_id]
    # D is also the Direct Forecast stage's candidates, confidences as scores, with the number of
    # pre-target encounters that record each code.
    candidates = wh.read("candidates", run_id="run-d", stage="direct_forecast")
    own = candidates.filter(pl.col("trajectory_id") == ids[1]).sort("rank")
    assert own.select("code", "score").equals(second.select("code", "score"))
    assert candidates.height == rankings.height
    recorded = {(t, c): n for t, c, n in pretarget.group_by("trajectory_id", "code").agg(
        pl.col("encounter_id").n_unique()).iter_rows()}
    counts = [recorded.get((t, c), 0) for t, c in candidates.select("trajectory_id", "code").iter_rows()]
    assert candidates["history_count"].to_list() == counts and max(counts) > 0

    calls = wh.read("llm_calls", run_id="run-d", stage="direct").sort("trajectory_id")
    assert calls.select("trajectory_id", "status", "cache_hit", "tokens_in", "tokens_out").rows() == [
        (ids[0], "ok", False, 800, 300), (ids[1], "ok", False, 800, 300), (ids[2], "invalid", False, 800, 300)]
    assert calls["prompt_version"].unique().to_list() == ["direct_forecast/5"]

    # A rerun answers everything from the response cache: no backend call, same rankings.
    (tmp_path / "replay.jsonl").write_text("")
    direct_shard(wh, cohort_id, 0, trajectories, pretarget, 20, "run-d", config)
    rerun = wh.read("llm_calls", run_id="run-d", stage="direct")
    assert rerun["cache_hit"].all() and rerun.height == 3 and rerun["tokens_in"].sum() == 0
    assert wh.read("rankings", run_id="run-d", system="direct").equals(rankings)

    # The boundary: no planted target-encounter marker in any prompt, cache-key input or store file.
    cache_inputs = [json.loads(p.read_text())["key_input"] for p in (wh.forecast_dir / "llm_cache").rglob("*.json")]
    assert len(cache_inputs) == 3
    assert_no_leak(sentinels, {"prompts": prompt_texts, "cache_key_inputs": cache_inputs,
                               **forecast_store_texts(wh.forecast_dir)})
    # ...while the prompts do carry the pre-target history (the harness is not looking at empty text).
    assert any("I50.22 " in text for text in prompt_texts)


def test_direct_forecast_reports_its_progress_as_trajectories_finish(planted_cohort, tmp_path, caplog):
    # A shard of an LLM system runs for minutes to hours: each finished trajectory (one in ten, on larger shards)
    # says how far the shard is and how its lists came out so far.
    wh, cohort_id, _ = planted_cohort
    trajectories, pretarget = cohort_inputs(wh, cohort_id)
    config = one_reply_each(tmp_path)
    rising = predictions(VALID)
    rising["predictions"][5]["confidence"] = 99
    record_replies(config, wh, cohort_id, trajectories, pretarget,
                   [predictions(VALID[:19] + ["U99.99"]), predictions(VALID), rising])

    caplog.set_level("INFO", logger="tasks.direct")
    direct_shard(wh, cohort_id, 0, trajectories, pretarget, 20, "run-p", config)
    lines = [r.getMessage() for r in caplog.records if r.name == "tasks.direct"]
    assert [line.split(" (")[0] for line in lines] == [f"direct: {n} of 3 trajectories done" for n in (1, 2, 3)]
    assert re.fullmatch(r"direct: 3 of 3 trajectories done \(1 failed, 1 ok, 1 short\) in \d+ s", lines[-1])


def test_a_reply_that_breaks_the_schema_and_the_order_is_told_both_at_once(planted_cohort, tmp_path):
    # The order was checked only once the schema held, so a reply with a confidence above 100 and a rising one
    # needed a second re-ask to hear of the order.
    wh, cohort_id, _ = planted_cohort
    trajectories, pretarget = cohort_inputs(wh, cohort_id)
    config = one_reply_each(tmp_path)
    both = predictions(VALID)
    both["predictions"][2]["confidence"] = 101
    both["predictions"][6]["confidence"] = 95
    record_replies(config, wh, cohort_id, trajectories.head(1), pretarget, [both])

    direct_shard(wh, cohort_id, 0, trajectories.head(1), pretarget, 20, "run-both", config)
    error = wh.read("llm_calls", run_id="run-both")["error"].item()
    assert error.split("; at ") == [
        "at predictions/2/confidence: 101 is greater than the maximum of 100",
        "predictions/2/confidence: 101 is higher than the 94.0 before it; confidences must not increase",
        "predictions/6/confidence: 95 is higher than the 90.0 before it; confidences must not increase"], error


def test_direct_forecast_names_medications_by_the_cohorts_code_titles(wh_vocab, tmp_path):
    ingest_meds(wh_vocab, write_described_meds(tmp_path / "meds"), "described")
    cohort_id = build_cohort(wh_vocab, "described", "default", CohortOptions(), seed=7)["cohort_id"]
    trajectories, pretarget = cohort_inputs(wh_vocab, cohort_id)
    config = one_reply_each(tmp_path)
    texts = record_replies(config, wh_vocab, cohort_id, trajectories, pretarget, [predictions(VALID)] * 3)
    # The first encounters of subjects 2 and 4 had furosemide, recorded by its NDC.
    assert FUROSEMIDE == "MEDICATION//NDC//00054829725"
    assert sum("  Medications: Furosemide (NDC 00054829725)" in text for text in texts) == 2
    # Direct Forecast sends exactly these prompts: the replay file holds no other request.
    direct_shard(wh_vocab, cohort_id, 0, trajectories, pretarget, 20, "run-t", config)
    status = wh_vocab.read("ranking_status", run_id="run-t", system="direct")
    assert status["status"].to_list() == ["ok"] * 3


def test_the_record_shows_the_patients_undated_facts_and_no_fact_of_the_target_encounter(wh_vocab, tmp_path):
    # A MEDS export's static rows (no time, no encounter) such as race or language were left out of the record the
    # LLM reads, while the EHR prior takes them as the patient's own tokens. A per-admission fact (insurance, as
    # MIMIC-IV's admissions table holds it) is its encounter's: the earlier encounter's is shown in its block, the
    # target encounter's, even undated, nowhere.
    from tests.conftest import t, tiny_events, write_tiny_meds

    rows = [(1, None, "RACE//WHITE", None, None, None), (1, None, "LANGUAGE//ENGLISH", None, None, None),
            (1, None, "HEIGHT//CM", 172.0, None, None),
            (1, t(10, 1), "INSURANCE//Medicare", None, None, 102), (1, None, "INSURANCE//Medicaid", None, None, 103)]
    extra = pl.DataFrame(rows, schema=tiny_events().schema, orient="row")
    ingest_meds(wh_vocab, write_tiny_meds(tmp_path / "meds", pl.concat([tiny_events(), extra])), "static")
    cohort_id = build_cohort(wh_vocab, "static", "final", CohortOptions(), seed=7)["cohort_id"]
    _, pretarget = cohort_inputs(wh_vocab, cohort_id)
    events = pretarget.filter(pl.col("trajectory_id") == f"{cohort_id}:1:103")
    text = direct_prompt(events, Vocabulary.from_warehouse(wh_vocab.connect(), cohort_id), LLMConfig()
                         ).messages[1]["content"]
    assert text.split("\n\n")[1].splitlines()[1:] == [
        "Sex: F", "Born: 1950", "Recorded without a date: HEIGHT//CM 172; LANGUAGE//ENGLISH; RACE//WHITE"]
    assert "  Other: INSURANCE//Medicare" in text.splitlines() and "Medicaid" not in text


def test_history_is_shortened_to_the_context_window_diagnoses_last(planted_cohort):
    wh, cohort_id, _ = planted_cohort
    trajectories, pretarget = shard_inputs(wh, cohort_id, 0, "all")
    vocabulary = Vocabulary.from_warehouse(wh.connect(), cohort_id)
    events = pretarget.filter(pl.col("trajectory_id") == trajectories["trajectory_id"][0])
    roomy = direct_prompt(events, vocabulary, LLMConfig())
    assert roomy.truncated_chars == 0 and "Encounter 1:" in roomy.messages[1]["content"]
    # Notes and labs go before any diagnosis; then the oldest encounter; the newest one stays. The budget leaves
    # FEEDBACK_RESERVE_CHARS free for a re-ask (at one character per token, as many tokens).
    prompt = load_prompt("direct_forecast")
    fixed = len(prompt.system.format(**prompt_fields(vocabulary))) + len(prompt.user.format(history=""))
    for history_chars, kept in [(497, ["Encounter 1:", "Encounter 2:"]), (397, ["Encounter 2:"])]:
        tight_config = LLMConfig(context_window=300 + fixed + history_chars + FEEDBACK_RESERVE_CHARS,
                                 max_output_tokens=300, chars_per_token=1.0)
        tight = direct_prompt(events, vocabulary, tight_config)
        user = tight.messages[1]["content"]
        assert tight.truncated_chars > 0
        assert f"[history shortened to fit: {tight.truncated_chars} characters omitted (" in user
        assert "Note [" not in user and "Labs:" not in user
        assert [title for title in ("Encounter 1:", "Encounter 2:") if title in user] == kept
        assert "  Diagnoses: I50.22 " in user
        assert sum(len(m["content"]) for m in tight.messages) <= fixed + history_chars


def test_a_cohort_harmonized_to_categories_is_asked_for_categories():
    # Under `category` V(.) reads I50.22 and I50.23 as one code I50: asked for full codes, the model's 20 would
    # collapse into fewer.
    events = pl.DataFrame(record_of("t", 1), orient="row", schema=["trajectory_id", "time", "code", "numeric_value",
                                                                  "text_value", "encounter_id"])
    specific = Vocabulary({"DIAGNOSIS//ICD//10//I5022": "Chronic systolic heart failure"})
    categories = Vocabulary({"DIAGNOSIS//ICD//10//I50": "Heart failure"}, harmonization="category")
    asked = {name: direct_prompt(events, vocabulary, LLMConfig()).messages[0]["content"]
             for name, vocabulary in (("specific", specific), ("categories", categories))}
    assert "- Prefer specific billable codes;" in asked["specific"] and '"code": "I50.22"' in asked["specific"]
    assert ("- Give ICD categories only (the first three characters of a code, four for ICD-9 E codes, e.g. I50 or "
            "428), each at most once;") in asked["categories"]
    assert '"code": "I50",' in asked["categories"] and "billable" not in asked["categories"]
    # The example reply is in the version the prompt tells the model to use.
    icd9 = Vocabulary({"DIAGNOSIS//ICD//9//4280": "Congestive heart failure, unspecified"})
    system = direct_prompt(events, icd9, LLMConfig()).messages[0]["content"]
    assert "(ICD-9-CM); never mix versions" in system and '"code": "428.0",' in system and "I50" not in system


def test_union_rrf_of_prior_and_direct_lists(planted_cohort):
    wh, cohort_id, _ = planted_cohort
    trajectories, pretarget = cohort_inputs(wh, cohort_id)
    first = trajectories["trajectory_id"][0]
    dx = "DIAGNOSIS//ICD//10//"

    def ranking(system, codes):
        return pl.DataFrame({"run_id": "run-r", "cohort_id": cohort_id, "system": system, "trajectory_id": first,
                             "rank": list(range(1, len(codes) + 1)), "code": [dx + c for c in codes],
                             "score": [1.0] * len(codes), "native": True},
                            schema_overrides={"rank": pl.Int32})

    def statuses(system, trajectory_ids):
        return pl.DataFrame({"run_id": "run-r", "system": system, "trajectory_id": trajectory_ids,
                             "status": ["short" if t == first else "failed" for t in trajectory_ids],
                             "detail": None}, schema_overrides={"detail": pl.String})

    with pytest.raises(NotFoundError, match="run 'run-r' has no ehr_prior rankings; Union"):
        rrf_prior_direct_shard(wh, cohort_id, 0, trajectories, 20, "run-r")
    # Written to another shard number, as after a rebuild of the cohort with another shard size.
    for system, codes, shard in (("ehr_prior", ["I10", "E119", "N179"], 7), ("direct", ["N179", "I10", "J189"], 0)):
        wh.write("rankings", ranking(system, codes), run_id="run-r", system=system, shard=shard)
        wh.write("candidates", stage_candidates(ranking(system, codes), pretarget, CANDIDATE_STAGES[system]),
                 run_id="run-r", stage=CANDIDATE_STAGES[system], shard=shard)
    wh.write("ranking_status", statuses("direct", trajectories["trajectory_id"]), run_id="run-r", system="direct",
             shard=0)
    # A forecast that never reached some of the trajectories (killed, or run on a smaller limit) is no input,
    # even when a stale partition repeats the status of one it did reach.
    wh.write("ranking_status", statuses("ehr_prior", [first]), run_id="run-r", system="ehr_prior", shard=7)
    wh.write("ranking_status", statuses("ehr_prior", [first, first]), run_id="run-r", system="ehr_prior", shard=8)
    with pytest.raises(NotFoundError, match=f"run 'run-r' has no ehr_prior rankings for 2 of the 3 trajectories to "
                                        f"fuse \\(e.g. {trajectories['trajectory_id'][1]}\\)"):
        rrf_prior_direct_shard(wh, cohort_id, 0, trajectories, 20, "run-r")
    wh.delete("ranking_status", run_id="run-r", system="ehr_prior", shard=8)
    wh.write("ranking_status", statuses("ehr_prior", trajectories["trajectory_id"]), run_id="run-r",
             system="ehr_prior", shard=7)
    rrf_prior_direct_shard(wh, cohort_id, 0, trajectories, 20, "run-r")
    fused = wh.read("rankings", run_id="run-r", system="rrf_prior_direct").filter(pl.col("trajectory_id") == first)
    assert fused.sort("rank").select("rank", "code", "score").rows() == [
        (1, dx + "I10", 1 / 61 + 1 / 62), (2, dx + "N179", 1 / 63 + 1 / 61), (3, dx + "E119", 1 / 62),
        (4, dx + "J189", 1 / 63)]
    status = wh.read("ranking_status", run_id="run-r", system="rrf_prior_direct").sort("trajectory_id")
    assert status.filter(pl.col("trajectory_id") == first)["detail"].to_list() == ["4 of 20 codes"]
    others = status.filter(pl.col("trajectory_id") != first)
    assert others["detail"].to_list() == ["0 of 20 codes; no ehr_prior list; no direct list"] * 2


def test_union_rrf_fuses_the_priors_pi_f_whatever_k_its_forecast_had(planted_cohort):
    # Spec §2 and §5: the prior's list is pi_F, its top 20, and §1 scores the first K of one list: a prior forecast
    # with --k 10 has 10 rankings, but the fusion takes its 20 candidates, as it does after --k 20.
    wh, cohort_id, _ = planted_cohort
    trajectories, pretarget = cohort_inputs(wh, cohort_id)
    omega = wh.read("cohort_vocabulary", cohort_id=cohort_id).sort("code")["code"].to_list()
    prior_codes, direct_codes = omega[:25], [omega[30], omega[0], omega[18]]

    def forecast(system, run_id, codes, k):
        listed = pl.concat([pl.DataFrame({"trajectory_id": t, "rank": range(1, len(codes) + 1), "code": codes,
                                          "score": [float(-r) for r in range(len(codes))], "native": True},
                                         schema_overrides={"rank": pl.Int32})
                            for t in trajectories["trajectory_id"]]).with_columns(
            run_id=pl.lit(run_id), cohort_id=pl.lit(cohort_id), system=pl.lit(system))
        ranked = listed.filter(pl.col("rank") <= k)
        write_shard_outputs(wh, system, 0, run_id, ranked, shard_status(ranked, trajectories, k, run_id, system),
                            pretarget, listed.filter(pl.col("rank") <= CANDIDATE_GENERATION_SIZE))

    fused = {}
    for k in (10, 20):
        forecast("ehr_prior", f"run-k{k}", prior_codes, k)
        forecast("direct", f"run-k{k}", direct_codes, k)
        rrf_prior_direct_shard(wh, cohort_id, 0, trajectories, k, f"run-k{k}")
        fused[k] = (wh.read("rankings", run_id=f"run-k{k}", system="rrf_prior_direct")
                    .filter(pl.col("trajectory_id") == trajectories["trajectory_id"][0]).sort("rank")["code"].to_list())
    expected = [code for code, _ in rrf_fuse([prior_codes[:20], direct_codes])]
    assert fused[10] == fused[20] == expected and len(expected) == 21
    # A prior forecast made before stage candidates were written is refused, not fused as an empty list.
    wh.delete("candidates", run_id="run-k20", stage="candidate_generation")
    with pytest.raises(NotFoundError, match="run 'run-k20' has ehr_prior rankings but no candidate_generation "
                                            "candidates for 3 trajectories"):
        rrf_prior_direct_shard(wh, cohort_id, 0, trajectories, 20, "run-k20")


def test_fusion_keeps_only_vocabulary_codes(planted_cohort):
    wh, cohort_id, _ = planted_cohort
    trajectories, _ = shard_inputs(wh, cohort_id, 0, "all")
    vocabulary = Vocabulary.from_warehouse(wh.connect(), cohort_id)
    tid = trajectories["trajectory_id"][0]
    frame = pl.DataFrame({"trajectory_id": [tid, tid], "rank": [1, 2],
                          "code": ["DIAGNOSIS//ICD//10//I10", "DIAGNOSIS//ICD//10//NOTACODE"]})
    ranked, _ = fuse_prior_direct(frame, frame.clear(), trajectories.head(1), vocabulary, "r", cohort_id, 20)
    assert ranked["code"].to_list() == ["DIAGNOSIS//ICD//10//I10"]


def test_dxr_forecast_direct_through_the_flow(planted_cohort, tmp_path, monkeypatch, prefect_harness):
    from click.testing import CliRunner

    from dxr.cli import main

    wh, cohort_id, _ = planted_cohort
    trajectories, pretarget = shard_inputs(wh, cohort_id, 0, "held_out")
    config = LLMConfig(backend="replay", replay_file=tmp_path / "cli.jsonl", model="recorded",
                       response_format="json_object_schema")
    record_replies(config, wh, cohort_id, trajectories, pretarget, [predictions(VALID)] * trajectories.height)
    for key, value in {"BACKEND": "replay", "REPLAY_FILE": config.replay_file, "MODEL": "recorded",
                       "RESPONSE_FORMAT": "json_object_schema"}.items():
        monkeypatch.setenv(f"DXR_LLM__{key}", str(value))

    def forecast(system):
        return CliRunner().invoke(main, ["--data-dir", str(wh.root), "forecast", "--cohort", "default", "--system",
                                         system, "--split", "held_out", "--run-id", "cli-d"])

    result = forecast("direct")
    assert result.exit_code == 0, result.output
    assert ("run cli-d: system direct wrote rankings for cohort default (held_out): 2 trajectories, 2 ok\n"
            in result.output)
    status = wh.read("ranking_status", run_id="cli-d", system="direct")
    assert status["status"].to_list() == ["ok"] * trajectories.height == ["ok", "ok"]
    assert forecast("direct").exit_code == 0
    assert wh.read("llm_calls", run_id="cli-d", stage="direct")["cache_hit"].to_list() == [True, True]
    # The run records which model and prompt made its lists, and refuses to mix in another model's.
    recorded = json.loads(wh.read("runs", run_id="cli-d", kind="forecast:direct")["config_json"][0])
    assert {key: recorded[key] for key in LLM_RUN_KEYS} == {
        "llm_backend": "replay", "llm_model": "recorded", "llm_model_identity": str(config.replay_file),
        "prompt_versions": [load_prompt("direct_forecast").version], "llm_temperature": 0.0, "llm_seed": 7,
        "llm_max_output_tokens": 1500, "llm_context_window": 8192, "llm_chars_per_token": 2.7,
        "llm_response_format": "json_object_schema", "llm_validation_retries": 2, "llm_max_tokens_field": "max_tokens"}
    monkeypatch.setenv("DXR_LLM__MODEL", "another")
    result = forecast("direct")
    assert result.exit_code == 1
    assert ("Error: run cli-d already holds a forecast by direct with other options (llm_model 'recorded' -> "
            "'another'): rerun with the recorded options, pass a new --run-id, or delete the run first "
            "(`dxr run delete cli-d`: every system's lists and its evaluation go)") in result.output
    monkeypatch.setenv("DXR_LLM__MODEL", "recorded")
    # ...nor another sampling or history window: the run's lists were made under the recorded ones.
    monkeypatch.setenv("DXR_LLM__TEMPERATURE", "0.7")
    monkeypatch.setenv("DXR_LLM__CONTEXT_WINDOW", "4096")
    result = forecast("direct")
    assert result.exit_code == 1
    assert ("other options (llm_context_window 8192 -> 4096, llm_temperature 0.0 -> 0.7)") in result.output
    monkeypatch.delenv("DXR_LLM__TEMPERATURE")
    monkeypatch.delenv("DXR_LLM__CONTEXT_WINDOW")

    result = forecast("rrf_prior_direct")
    assert result.exit_code == 1
    assert ("Error: run 'cli-d' has no ehr_prior rankings; Union + RRF fuses lists of the same run: first run "
            f"dxr forecast --cohort {cohort_id} --system ehr_prior --run-id cli-d") in result.output


def test_dxr_forecast_where_every_trajectory_failed_is_an_error(planted_cohort, tmp_path, monkeypatch,
                                                              prefect_harness):
    wh, cohort_id, _ = planted_cohort
    # Every reply breaks the contract (confidences rise) and no re-ask is left: every trajectory `failed`.
    config = LLMConfig(backend="replay", replay_file=tmp_path / "replay.jsonl", validation_retries=0)
    trajectories, pretarget = shard_inputs(wh, cohort_id, 0, "held_out")
    rising = {"predictions": [{"code": c, "confidence": i} for i, c in enumerate(VALID)]}
    record_replies(config, wh, cohort_id, trajectories, pretarget, [rising] * trajectories.height)
    for key, value in {"BACKEND": "replay", "REPLAY_FILE": str(config.replay_file), "VALIDATION_RETRIES": "0"}.items():
        monkeypatch.setenv(f"DXR_LLM__{key}", value)
    result, lines = failed_cli_forecast(wh, "bad")
    assert len(lines) == 1 and lines[0].startswith(
        "Error: run bad: every direct forecast failed (2 of 2 trajectories), e.g. direct reply for "), result.output
    assert lines[0].endswith(": fix the cause, then rerun with --run-id bad (details in ranking_status and llm_calls)")
    # The cause fixed by another setting (here: a model whose replies keep the contract, as another replay file):
    # the run made no list, so the rerun is not refused for having other options.
    fixed = LLMConfig(backend="replay", replay_file=tmp_path / "fixed.jsonl", validation_retries=0)
    record_replies(fixed, wh, cohort_id, trajectories, pretarget, [predictions(VALID)] * trajectories.height)
    monkeypatch.setenv("DXR_LLM__REPLAY_FILE", str(fixed.replay_file))
    from click.testing import CliRunner

    from dxr.cli import main

    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "forecast", "--cohort", "default", "--system",
                                       "direct", "--split", "held_out", "--run-id", "bad"])
    assert result.exit_code == 0, result.output
    assert wh.read("ranking_status", run_id="bad", system="direct")["status"].to_list() == ["ok", "ok"]


def test_a_rerun_keeps_the_failed_attempts_calls_and_their_cost_as_superseded(planted_cohort, tmp_path, monkeypatch,
                                                                              prefect_harness):
    # The first attempt's replies all break the contract; the rerun under the same run id, its cause fixed, used to
    # delete the calls (and the cost) of that attempt with its lists.
    wh, cohort_id, _ = planted_cohort
    monkeypatch.chdir(tmp_path)   # no ./dxr.toml of the checkout: prices come only from the file named below
    config_file = tmp_path / "priced.toml"
    config_file.write_text('[llm.prices.recorded]\ninput = 2.0\noutput = 10.0\n')
    monkeypatch.setenv("DXR_CONFIG", str(config_file))
    config = LLMConfig(backend="replay", replay_file=tmp_path / "replay.jsonl", model="recorded", validation_retries=0)
    trajectories, pretarget = shard_inputs(wh, cohort_id, 0, "held_out")
    rising = {"predictions": [{"code": c, "confidence": i} for i, c in enumerate(VALID)]}
    record_replies(config, wh, cohort_id, trajectories, pretarget, [rising] * trajectories.height)
    for key, value in {"BACKEND": "replay", "REPLAY_FILE": str(config.replay_file), "MODEL": "recorded",
                       "VALIDATION_RETRIES": "0"}.items():
        monkeypatch.setenv(f"DXR_LLM__{key}", value)
    failed_cli_forecast(wh, "again")
    first = wh.read("llm_calls", run_id="again")
    # Each call: 800 tokens in at $2/M and 300 out at $10/M.
    assert first["status"].to_list() == ["invalid", "invalid"] and first["cost_usd"].to_list() == [0.0046, 0.0046]

    fixed = LLMConfig(backend="replay", replay_file=tmp_path / "fixed.jsonl", model="recorded", validation_retries=0)
    record_replies(fixed, wh, cohort_id, trajectories, pretarget, [predictions(VALID)] * trajectories.height)
    monkeypatch.setenv("DXR_LLM__REPLAY_FILE", str(fixed.replay_file))
    from click.testing import CliRunner

    from dxr.cli import main

    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "forecast", "--cohort", "default", "--system",
                                       "direct", "--split", "held_out", "--run-id", "again"])
    assert result.exit_code == 0, result.output
    kept = wh.read("llm_calls", run_id="again")
    assert kept["status"].to_list() == ["ok", "ok"] and kept["cost_usd"].to_list() == [0.0046, 0.0046]
    superseded = wh.read("superseded_llm_calls", run_id="again")
    assert superseded.drop("superseded_at").sort("call_id").equals(first.sort("call_id"))
    assert not set(kept["call_id"]) & set(superseded["call_id"])
    rows = run_efficiency(wh, "again", {}).to_dicts()
    assert [(r["system"], r["cost_usd"], r["superseded_calls"], r["superseded_cost_usd"]) for r in rows] == [
        ("direct", pytest.approx(0.0092), 2, pytest.approx(0.0092))]


def failed_cli_forecast(wh, run_id: str | None):
    """`dxr forecast --system direct` over held_out (under a generated run id when `run_id` is None), which must
    exit 1; its output and its Error/run lines."""
    from click.testing import CliRunner

    from dxr.cli import main

    given = [] if run_id is None else ["--run-id", run_id]
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "forecast", "--cohort", "default", "--system",
                                       "direct", "--split", "held_out", *given])
    assert result.exit_code == 1, result.output
    return result, [line for line in result.output.splitlines() if line.startswith(("Error", "run "))]


def test_dxr_forecast_against_an_endpoint_that_is_down_stops_at_once(planted_cohort, monkeypatch, prefect_harness):
    wh, _, _ = planted_cohort
    # Nothing listens there: the first request that has used up its retries stops the run with one error
    # (no trajectory after it waits out its own retries to fail alike).
    for key, value in {"BACKEND": "openai", "BASE_URL": "http://127.0.0.1:1/v1", "TRANSPORT_RETRIES": "0",
                       "MAX_CONCURRENCY": "1"}.items():
        monkeypatch.setenv(f"DXR_LLM__{key}", value)
    result, lines = failed_cli_forecast(wh, "down")
    assert len(lines) == 1 and lines[0].startswith(
        "Error: direct: gave up after 1 attempt: cannot connect to http://127.0.0.1:1/v1/chat/completions "
        "(ClientConnectorError"), result.output
    assert lines[0].endswith("start the endpoint, or check llm.base_url and llm.backend"), result.output
    assert wh.read("ranking_status", run_id="down").is_empty()
    # The request that was made is on record; the other trajectory's, never sent, is not.
    calls = wh.read("llm_calls", run_id="down")
    assert calls.select("stage", "backend", "status", "cache_hit").rows() == [
        ("direct", "openai", "transport_error", False)]
    assert calls["error"][0].startswith("cannot connect to http://127.0.0.1:1/v1/chat/completions")


def test_a_failed_forecast_under_a_generated_run_id_names_the_run_to_resume(planted_cohort, monkeypatch,
                                                                              prefect_harness):
    wh, _, _ = planted_cohort
    # Without --run-id the line said only why the run stopped: the generated id that a rerun must name to resume
    # the run (its replies cached so far reused) was left to be found with dxr run list.
    for key, value in {"BACKEND": "openai", "BASE_URL": "http://127.0.0.1:1/v1", "TRANSPORT_RETRIES": "0",
                       "MAX_CONCURRENCY": "1"}.items():
        monkeypatch.setenv(f"DXR_LLM__{key}", value)
    result, lines = failed_cli_forecast(wh, None)
    failed = wh.read("runs").filter(pl.col("kind") == "forecast:direct")
    assert failed["status"].to_list() == ["failed"]
    run_id = failed["run_id"][0]
    assert len(lines) == 1 and lines[0].startswith(
        f"Error: run {run_id} (recorded failed; resume it with --run-id {run_id}): direct: gave up after 1 "
        "attempt: cannot connect to http://127.0.0.1:1/v1/chat/completions"), result.output


def test_a_forecast_stopped_by_a_signal_under_a_generated_run_id_names_the_run_to_resume(planted_cohort, monkeypatch,
                                                                                        prefect_harness):
    # SIGTERM or Ctrl-C unwinds as SystemExit (dxr.cli.terminated) after the run is recorded failed: its line said
    # only 'dxr: stopped by SIGTERM', not which run to resume.
    from click.testing import CliRunner

    import flows.forecast
    from dxr.cli import main
    from warehouse.runs import registered_run

    wh, cohort_id, _ = planted_cohort

    def stopped_by_sigterm(data_dir, cohort, system, run_id, **options):
        with registered_run(wh, f"forecast:{system}", {}, run_id, cohort_id):
            raise SystemExit(128 + 15)

    monkeypatch.setattr(flows.forecast, "forecast_flow", stopped_by_sigterm)
    result = CliRunner().invoke(main, ["--data-dir", str(wh.root), "forecast", "--cohort", "default", "--system",
                                       "repeat_history"])
    assert result.exit_code == 143, result.output
    run_id = wh.read("runs").filter(pl.col("kind") == "forecast:repeat_history")["run_id"].to_list()
    assert len(run_id) == 1 and result.output.splitlines()[-1] == (
        f"dxr: run {run_id[0]} recorded failed; resume it with --run-id {run_id[0]}")


def test_a_run_stopped_by_a_configuration_error_records_the_calls_it_made():
    import asyncio

    from aiohttp import web

    from dxr.errors import ConfigError
    from models.llm.backends import OpenAIBackend
    from tasks.direct import forecast_direct
    from tests.conftest import serving

    # Three records told apart by their encounters: the first is refused as no request of the run could succeed,
    # the second is still being computed then, and the third waits for a free slot (two in flight at most).
    released = {}

    async def handler(request):
        encounters = (await request.json())["messages"][-1]["content"].count("Encounter ")
        if encounters == 2:
            await released["event"].wait()  # computing until the run has stopped
        return web.json_response({"error": {"message": "Unsupported parameter: 'seed'"}}, status=400)

    records = {"t-refused": 1, "t-in-flight": 2, "t-queued": 3}
    pretarget = pl.DataFrame([row for t, n in records.items() for row in record_of(t, n)], orient="row",
                             schema={"trajectory_id": pl.String, "time": pl.Datetime("us"), "code": pl.String,
                                     "numeric_value": pl.Float32, "text_value": pl.String, "encounter_id": pl.Int64})

    async def scenario():
        released["event"] = asyncio.Event()
        async with serving(handler) as url:
            config = LLMConfig(backend="openai", base_url=url, model="served", cache=False, max_concurrency=2)
            client = LLMClient(config, OpenAIBackend(url, 60))
            try:
                # The run stops without waiting for the request in flight (which would wait forever).
                with pytest.raises(ConfigError, match="HTTP 400 .*Unsupported parameter: 'seed'"):
                    await asyncio.wait_for(forecast_direct(
                        client, pl.DataFrame({"trajectory_id": list(records)}), pretarget,
                        Vocabulary({"DIAGNOSIS//ICD//10//I5022": "x"}), "r", "c", 20), 20)
            finally:
                released["event"].set()
                await client.close()
            return client.telemetry(), url

    calls, url = asyncio.run(scenario())
    refusal = (f"HTTP 400 from {url}/chat/completions: Unsupported parameter: 'seed'; the endpoint refuses the "
               "request's parameters: check llm.model, llm.response_format and llm.base_url")
    assert calls.sort("trajectory_id").select("trajectory_id", "status", "error").rows() == [
        ("t-in-flight", "cancelled", "cancelled in flight: the run stopped (another request's error, or an interrupt)"),
        ("t-refused", "rejected", refusal)]


def test_an_endpoint_that_is_down_fails_the_forecast_not_each_trajectory():
    import asyncio

    from models.llm.backends import OpenAIBackend
    from models.llm.client import EndpointUnreachableError
    from tasks.direct import forecast_direct

    config = LLMConfig(backend="openai", base_url="http://127.0.0.1:1/v1", cache=False, backoff_s=0.0,
                       transport_retries=1, max_concurrency=1)
    class Counting(OpenAIBackend):
        requests = 0

        async def complete(self, request):
            Counting.requests += 1
            return await super().complete(request)

    client = LLMClient(config, Counting(config.base_url, 10))
    ids = [f"t{i}" for i in range(5)]
    pretarget = pl.DataFrame([row for t in ids for row in record_of(t, 1)], orient="row",
                             schema=["trajectory_id", "time", "code", "numeric_value", "text_value", "encounter_id"])

    async def scenario():
        try:
            return await forecast_direct(client, pl.DataFrame({"trajectory_id": ids}), pretarget,
                                         Vocabulary({"DIAGNOSIS//ICD//10//I5022": "x"}), "r", "c", 20)
        finally:
            await client.close()

    with pytest.raises(EndpointUnreachableError, match="^direct: gave up after 2 attempts: cannot connect to "):
        asyncio.run(scenario())
    # The others' requests went out while the first backed off, but none used up its retries as well.
    assert Counting.requests < 2 * len(ids)


def test_a_rerun_under_another_model_is_refused_unless_the_run_predates_recording_it(wh):
    from dxr.errors import InputError
    from tasks.forecast import check_rerun, forecast_config
    from warehouse.runs import registered_run

    options = forecast_config("c1", "direct", "held_out", 20, None)
    llm = {"llm_backend": "local", "llm_model": "m", "llm_model_identity": "m.gguf@0123456789abcdef",
           "prompt_versions": ["direct_forecast/2"]}
    with registered_run(wh, "forecast:direct", options, "old", "c1"):
        pass
    check_rerun(wh, "old", options | llm)  # recorded before runs named their model: nothing to compare
    # Recorded before runs named their request settings: compared on the model, not on those.
    settings = {"llm_temperature": 0.7, "llm_seed": None, "llm_context_window": 4096}
    with registered_run(wh, "forecast:direct", options | llm, "older", "c1"):
        pass
    check_rerun(wh, "older", options | llm | settings)
    with registered_run(wh, "forecast:direct", options | llm, "new", "c1"):
        pass
    check_rerun(wh, "new", options | llm)
    with pytest.raises(InputError, match="other options \\(llm_model_identity 'm.gguf@0123456789abcdef' -> "
                                         "'m.gguf@fedcba9876543210'\\)"):
        check_rerun(wh, "new", options | llm | {"llm_model_identity": "m.gguf@fedcba9876543210"})


# ---- Direct Forecast against a real local HTTP endpoint ------------------------------------------

def record_of(trajectory_id: str, encounters: int, codes=VALID[:8]) -> list[tuple]:
    """Pre-target rows of one trajectory: `encounters` encounters, each with `codes`."""
    return [(trajectory_id, datetime(2020, 1, 1) + timedelta(days=10 * e), "DIAGNOSIS//ICD//10//" + c.replace(".", ""),
             None, None, e) for e in range(encounters) for c in codes]


def records_of(records: dict[str, int]) -> pl.DataFrame:
    """Pre-target rows of trajectories with `records[id]` encounters each."""
    return pl.DataFrame([row for t, n in records.items() for row in record_of(t, n)], orient="row",
                        schema={"trajectory_id": pl.String, "time": pl.Datetime("us"), "code": pl.String,
                                "numeric_value": pl.Float32, "text_value": pl.String, "encounter_id": pl.Int64})


# The vocabulary of the records above: the VALID codes.
VALID_VOCABULARY = {"DIAGNOSIS//ICD//10//" + c.replace(".", ""): f"title of {c}" for c in VALID}


def direct_over_http(handler, records: dict[str, int], **overrides):
    """forecast_direct of trajectories with `records[id]` encounters each, against `handler` as the endpoint:
    (rankings, status, llm_calls), or the exception it raised."""
    import asyncio

    from models.llm.backends import OpenAIBackend
    from tasks.direct import forecast_direct
    from tests.conftest import serving

    vocabulary, pretarget = Vocabulary(VALID_VOCABULARY), records_of(records)

    async def scenario():
        async with serving(handler) as url:
            config = LLMConfig(backend="openai", base_url=url, model="served", cache=False, backoff_s=0.0,
                               transport_retries=1, **overrides)
            client = LLMClient(config, OpenAIBackend(url, 10))
            try:
                ranked, status = await forecast_direct(client, pl.DataFrame({"trajectory_id": list(records)}),
                                                       pretarget, vocabulary, "r", "c", 20)
            except Exception as exc:  # noqa: BLE001  (the test looks at which)
                return exc
            finally:
                await client.close()
        return ranked, status.sort("trajectory_id"), client.telemetry().sort("trajectory_id")

    return asyncio.run(scenario())


def test_llm_calls_order_a_trajectorys_attempts_and_say_why_each_was_made(wh, tmp_path, monkeypatch):
    import asyncio
    import time
    from datetime import timezone

    from models.llm.backends import ContextLengthError, ReplayBackend
    from models.llm.cache import ResponseCache
    from models.llm.client import prompt_budget, refit_chars_per_token
    from tasks.direct import check_confidence_order, forecast_direct

    vocabulary, pretarget = Vocabulary(VALID_VOCABULARY), records_of({"t-reasked": 1, "t-long": 30, "t-plain": 2})
    config = LLMConfig(backend="replay", replay_file=tmp_path / "replay.jsonl", model="recorded", context_window=4096,
                       max_output_tokens=1000, chars_per_token=3.0)
    probe, schema = LLMClient(config, backend=None), load_prompt("direct_forecast").schema

    def rendered(trajectory_id: str, chars_per_token: float | None = None):
        events = pretarget.filter(pl.col("trajectory_id") == trajectory_id)
        return direct_prompt(events, vocabulary, config, chars_per_token)

    def record(messages: list[dict], reply: Completion) -> None:
        append_recording(config.replay_file, probe.request(messages, schema), reply)

    # t-reasked: two replies whose confidences rise (each re-asked with its errors), then a valid one.
    first_prompt = rendered("t-reasked").messages
    conversation = first_prompt
    for rising_at in (5, 7, None):
        reply = predictions(VALID)
        if rising_at:
            reply["predictions"][rising_at]["confidence"] = 99
        record(conversation, Completion(json.dumps(reply), 800, 0, 300))
        conversation = probe.retry_conversation(first_prompt, json.dumps(reply), check_confidence_order(reply),
                                                prompt_budget(config))
    # t-long: the server counts more prompt tokens than the window leaves (it cuts the reply off at the full
    # window), so the record is rendered again, shorter, and answered.
    long_prompt = rendered("t-long").messages
    prompt_tokens = config.context_window - config.max_output_tokens + 1
    record(long_prompt, Completion('{"predictions": [{"code": "I50', prompt_tokens, 0, 7, finish_reason="length"))
    refusal = ContextLengthError("cut off", prompt_tokens=prompt_tokens, context_window=config.context_window)
    shorter = rendered("t-long", refit_chars_per_token(config, long_prompt, refusal, config.chars_per_token))
    assert shorter.truncated_chars > 0
    record(shorter.messages, Completion(json.dumps(predictions(VALID)), 600, 0, 300))
    record(rendered("t-plain").messages, Completion(json.dumps(predictions(VALID)), 100, 0, 300))

    def utc() -> datetime:
        return datetime.now(timezone.utc).replace(tzinfo=None)

    def forecast() -> tuple[datetime, datetime]:
        """Direct Forecast of the three, its calls written to run r; the UTC times around it."""
        client = LLMClient(config, ReplayBackend(config.replay_file), ResponseCache(tmp_path / "cache"))
        before = utc()
        _, status = asyncio.run(forecast_direct(client, pl.DataFrame({"trajectory_id": ["t-reasked", "t-long",
                                                                                      "t-plain"]}),
                                                pretarget, vocabulary, "r", "c", 20))
        assert status["status"].to_list() == ["ok", "ok", "ok"], status.rows()
        wh.write("llm_calls", client.telemetry(), run_id="r", stage="direct", shard=0)
        return before, utc()

    # Each trajectory's attempts in order, as docs/llm.md queries one trajectory's.
    def attempts() -> list[tuple]:
        return wh.connect().execute(
            "SELECT trajectory_id, attempt, attempt_reason, status, cache_hit, transport_retries, started_at "
            "FROM llm_calls ORDER BY trajectory_id, attempt").fetchall()

    expected = [("t-long", 1, "first", "invalid"), ("t-long", 2, "context_refused", "ok"),
                ("t-plain", 1, "first", "ok"),
                ("t-reasked", 1, "first", "invalid"), ("t-reasked", 2, "invalid_reply", "invalid"),
                ("t-reasked", 3, "invalid_reply", "ok")]
    monkeypatch.setenv("TZ", "Pacific/Auckland")  # a host far from UTC records UTC all the same
    time.tzset()
    try:
        before, after = forecast()
    finally:
        monkeypatch.undo()
        time.tzset()
    first = attempts()
    assert [row[:4] for row in first] == expected
    assert {row[4:6] for row in first} == {(False, 0)}
    # Each row has its own start, and a trajectory's attempts started one after another.
    assert all(before <= row[-1] <= after for row in first)
    assert all(earlier[-1] <= later[-1] for earlier, later in zip(first, first[1:]) if earlier[0] == later[0])

    # A cached rerun answers every request from the cache in the same order: the same attempts, new times.
    (tmp_path / "replay.jsonl").write_text("")
    before, _ = forecast()
    again = attempts()
    assert [row[:4] for row in again] == expected and {row[4:6] for row in again} == {(True, 0)}
    assert all(row[-1] >= before for row in again)


def completion(reply: dict):
    from aiohttp import web

    return web.json_response({"choices": [{"message": {"content": json.dumps(reply)}}],
                              "usage": {"prompt_tokens": 100, "completion_tokens": 50}})


def test_a_reply_that_cannot_be_read_fails_its_trajectory_only():
    from aiohttp import web

    async def handler(request):
        prompt = (await request.json())["messages"][-1]["content"]
        if "Encounter 2:" in prompt:  # the longer record: a proxy's error page with status 200
            return web.Response(status=200, body=b"<html>upstream proxy error</html>", content_type="text/html")
        return completion(predictions(VALID))

    ranked, status, calls = direct_over_http(handler, {"t-bad": 2, "t-good": 1})
    assert status.select("trajectory_id", "status").rows() == [("t-bad", "failed"), ("t-good", "ok")]
    assert status["detail"][0].startswith("direct: gave up after 2 attempts: HTTP 200 from http://127.0.0.1:")
    assert ranked.filter(pl.col("trajectory_id") == "t-good").height == 21
    # The transport retry sent the same request again within its row: one attempt, sent twice.
    assert calls.select("trajectory_id", "status", "attempt", "attempt_reason", "transport_retries").rows() == [
        ("t-bad", "transport_error", 1, "first", 1), ("t-good", "ok", 1, "first", 0)]


@pytest.mark.parametrize("endpoint", ["openai", "azure"])
def test_a_prompt_refused_by_the_content_filter_fails_its_trajectory_only(endpoint):
    from aiohttp import web

    # The endpoints' own refusals of a flagged prompt (HTTP 400): every other record still gets its forecast.
    refusals = {"openai": {"message": "Invalid prompt: your prompt was flagged as potentially violating our usage "
                                      "policy. Please try again with a different prompt.",
                           "type": "invalid_request_error", "param": None, "code": "invalid_prompt"},
                "azure": {"message": "The response was filtered due to the prompt triggering Azure OpenAI's content "
                                     "management policy. Please modify your prompt and retry.",
                          "type": None, "param": "prompt", "code": "content_filter", "status": 400}}

    async def handler(request):
        if "Encounter 2:" in (await request.json())["messages"][-1]["content"]:
            return web.json_response({"error": refusals[endpoint]}, status=400)
        return completion(predictions(VALID))

    ranked, status, calls = direct_over_http(handler, {"t-flagged": 2, "t-good": 1})
    assert status.select("trajectory_id", "status").rows() == [("t-flagged", "failed"), ("t-good", "ok")]
    assert status["detail"][0].startswith("HTTP 400 from http://127.0.0.1:")
    assert status["detail"][0].endswith("(request rejected: the endpoint's content filter refused this prompt; the "
                                        "run's other requests go on)")
    assert calls.select("trajectory_id", "status").rows() == [("t-flagged", "rejected"), ("t-good", "ok")]
    assert ranked["trajectory_id"].unique().to_list() == ["t-good"]


def test_a_backend_that_refuses_every_request_stops_the_run(tmp_path):
    import asyncio

    from aiohttp import web

    from dxr.errors import ConfigError
    from models.llm.backends import ReplayBackend, UnrecordedRequestError
    from tasks.direct import forecast_direct

    async def unknown_model(request):
        return web.json_response({"error": {"message": "model 'served' not found"}}, status=404)

    error = direct_over_http(unknown_model, {"t1": 1, "t2": 1})
    assert type(error) is ConfigError and "HTTP 404 from http://127.0.0.1:" in str(error)
    assert str(error).endswith(": model 'served' not found; check llm.base_url (the OpenAI-compatible base URL, "
                               "usually ending in /v1) and llm.model")

    # The replay backend fails loudly on a request it has no recording for.
    (tmp_path / "empty.jsonl").write_text("")
    config = LLMConfig(backend="replay", replay_file=tmp_path / "empty.jsonl", cache=False)
    client = LLMClient(config, ReplayBackend(config.replay_file))
    pretarget = pl.DataFrame(record_of("t1", 1), orient="row", schema=["trajectory_id", "time", "code",
                                                                      "numeric_value", "text_value", "encounter_id"])
    with pytest.raises(UnrecordedRequestError, match="has no response for request"):
        asyncio.run(forecast_direct(client, pl.DataFrame({"trajectory_id": ["t1"]}), pretarget,
                                    Vocabulary({"DIAGNOSIS//ICD//10//I5022": "x"}), "r", "c", 20))


@pytest.mark.parametrize("server", ["refuses", "cuts the reply"])
def test_a_prompt_too_long_for_the_context_is_shortened_and_asked_again(server):
    from aiohttp import web

    # A server with a 4,096-token window that counts 2 characters per token (the client budgets 3). Given a
    # prompt that leaves less than max_tokens, OpenAI refuses it; llama.cpp's server answers until the window
    # is full, cutting the reply.
    async def handler(request):
        body = await request.json()
        prompt_tokens = sum(len(m["content"]) for m in body["messages"]) // 2
        if prompt_tokens + body["max_tokens"] <= 4096:
            return completion(predictions(VALID))
        if server == "cuts the reply":
            return web.json_response({"choices": [{"message": {"content": '{"predictions": [{"code": "I50'},
                                                   "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 7}})
        return web.json_response({"error": {"message": (
            f"This model's maximum context length is 4096 tokens. However, you requested "
            f"{prompt_tokens + body['max_tokens']} tokens ({prompt_tokens} in the messages, {body['max_tokens']} "
            "in the completion). Please reduce the length of the messages or completion."),
            "code": "context_length_exceeded"}}, status=400)

    ranked, status, calls = direct_over_http(handler, {"t-long": 30, "t-short": 1}, context_window=4096,
                                             max_output_tokens=1000, chars_per_token=3.0)
    assert status.select("trajectory_id", "status").rows() == [("t-long", "ok"), ("t-short", "ok")]
    detail = status["detail"][0]
    assert detail.startswith("prompt shortened: the endpoint found it too long for the context (")
    assert "history truncated by" in detail and status["detail"][1] is None
    first = "rejected" if server == "refuses" else "invalid"
    assert calls.select("trajectory_id", "status").rows() == [("t-long", first), ("t-long", "ok"), ("t-short", "ok")]
    assert calls["truncated_chars"].to_list()[:2] == [0, int(detail.rsplit("truncated by ", 1)[1].split()[0])]
    assert ranked["trajectory_id"].unique().sort().to_list() == ["t-long", "t-short"]


@pytest.mark.parametrize("server_window", [4096, 900])
def test_a_server_window_smaller_than_configured_is_told_from_the_output_limit(server_window):
    from aiohttp import web

    # A llama.cpp server started with a smaller --n_ctx than llm.context_window (8,192), counting 2 characters
    # per token: it refuses a prompt that fills its window, and cuts off the reply of one that leaves less than
    # max_tokens, after fewer tokens than max_output_tokens. That cut was reported as the output limit and
    # re-asked until the trajectory failed, naming llm.max_output_tokens instead of the window.
    async def handler(request):
        body = await request.json()
        prompt_tokens = sum(len(m["content"]) for m in body["messages"]) // 2
        if prompt_tokens >= server_window:
            return web.json_response({"error": {"message": (
                f"This model's maximum context length is {server_window} tokens. However, you requested "
                f"{prompt_tokens + body['max_tokens']} tokens ({prompt_tokens} in the messages, {body['max_tokens']} "
                "in the completion). Please reduce the length of the messages or completion."),
                "code": "context_length_exceeded"}}, status=400)
        if prompt_tokens + body["max_tokens"] <= server_window:
            return completion(predictions(VALID))
        return web.json_response({"choices": [{"message": {"content": '{"predictions": [{"code": "I50'},
                                               "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": prompt_tokens,
                                            "completion_tokens": server_window - prompt_tokens}})

    ranked, status, calls = direct_over_http(handler, {"t-long": 30, "t-short": 1}, context_window=8192,
                                             max_output_tokens=1000, chars_per_token=3.0)
    if server_window > 1000:  # room for a prompt besides the reply: asked once more, shorter, and answered
        assert status.select("trajectory_id", "status").rows() == [("t-long", "ok"), ("t-short", "ok")]
        assert status["detail"][0].startswith("prompt shortened: the endpoint found it too long for the context (")
        assert calls.select("trajectory_id", "status").rows() == [("t-long", "invalid"), ("t-long", "ok"),
                                                                  ("t-short", "ok")]
        assert ranked["trajectory_id"].unique().sort().to_list() == ["t-long", "t-short"]
    else:  # the reply alone would fill the window: failed at once, naming the window and the setting to fix
        assert status.select("trajectory_id", "status").rows() == [("t-long", "failed"), ("t-short", "failed")]
        prompt_tokens, output_tokens = calls.filter(pl.col("trajectory_id") == "t-short").select(
            "tokens_in", "tokens_out").row(0)
        assert status["detail"][1] == (
            "direct reply for t-short was cut off by the context window: the endpoint stopped it after "
            f"{output_tokens} output tokens, before llm.max_output_tokens = 1000, with {prompt_tokens} prompt tokens, "
            "so its window looks like 900 tokens, smaller than llm.context_window = 8192: set llm.context_window to "
            "the endpoint's (a llama.cpp server's --n_ctx)")
        assert calls["trajectory_id"].to_list() == ["t-long", "t-short"]  # no re-ask of a cut reply
