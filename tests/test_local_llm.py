"""The embedded backend for real: llama.cpp's server with the packaged GGUF, started and stopped by the client.

The model is the tiny base Gemma 3 270M: these tests check the plumbing (server lifecycle, JSON
constrained by the schema, validation, telemetry, caching), not the clinical quality of its codes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from dxr.errors import ConfigError
from models.llm.client import CallContext, LLMClient
from models.llm.config import LLMConfig
from models.llm.local_server import LocalServer, fold_system_messages, packaged_model_path
from models.llm.prompts import load_prompt
from tasks.direct import direct_shard
from tasks.forecast import shard_inputs
from warehouse.vocab import Vocabulary


def test_system_messages_are_folded_into_the_first_user_turn():
    messages = [{"role": "system", "content": "rules"}, {"role": "user", "content": "record"},
                {"role": "assistant", "content": "{}"}, {"role": "user", "content": "fix it"}]
    assert fold_system_messages(messages) == [{"role": "user", "content": "rules\n\nrecord"},
                                              {"role": "assistant", "content": "{}"},
                                              {"role": "user", "content": "fix it"}]
    assert messages[1]["content"] == "record"  # the caller's messages are not modified
    assert fold_system_messages([{"role": "system", "content": "only"}]) == [{"role": "user", "content": "only"}]


def test_a_server_that_cannot_load_its_model_fails_with_its_log(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    server = LocalServer(broken, 2048, 1, tmp_path / "server.log", startup_timeout_s=60)
    with pytest.raises(ConfigError, match="exited with code .* while starting: .*full log: .*server.log"):
        server.start()
    assert server.process is None  # reaped, and its exit hook withdrawn
    with pytest.raises(ConfigError, match="does not exist"):
        LocalServer(tmp_path / "missing.gguf", 2048, 1, tmp_path / "server.log")


@pytest.mark.parametrize("described", [True, False])
def test_a_server_killed_by_a_signal_names_it_and_its_description_when_there_is_one(tmp_path, monkeypatch, described):
    # signal.strsignal returns None for a signal the C library has no description of (glibc's internal 32 and 33):
    # the line said "killed by signal 32 (None)". Those two cannot kill a test process reliably (glibc may handle
    # them), so the missing description is simulated on SIGKILL.
    if not described:
        monkeypatch.setattr(signal, "strsignal", lambda signum: None)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    server = LocalServer(model, 2048, 1, tmp_path / "server.log")
    server.process = subprocess.Popen([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    server.process.wait()
    assert server.exit_status() == ("killed by signal 9 (Killed)" if described else "killed by signal 9")


def test_a_server_that_exits_silently_is_not_described_by_an_earlier_server_s_log(tmp_path):
    # The log keeps every server's output (append): a server killed before it wrote a line (out of memory) was
    # reported with the last line of the previous server, which had started fine.
    log = tmp_path / "server.log"
    log.write_text("INFO:     Uvicorn running on http://127.0.0.1:40123 (Press CTRL+C to quit)\n")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")

    class Silent(LocalServer):
        def command(self, port: int) -> list[str]:
            return [sys.executable, "-c", "import sys; sys.exit(3)"]

    with pytest.raises(ConfigError) as raised:
        Silent(model, 2048, 1, log, startup_timeout_s=60).start()
    assert str(raised.value) == (f"the embedded llama.cpp server exited with code 3 while starting: no output "
                                 f"(full log: {log})")


def test_lazy_grammar_sampling_emits_the_tokens_of_full_grammar_sampling(tmp_path, monkeypatch):
    import llama_cpp
    from llama_cpp.llama_grammar import LlamaGrammar

    from models.llm.llama_serve import LazyGrammarLlama

    model = packaged_model_path(tmp_path)
    schema = json.dumps(load_prompt("direct_forecast").schema)
    # A prompt that asks for prose: at first the best token is one the grammar rejects, so both the
    # check of the best token alone and the fall back to the whole vocabulary are exercised.
    prompt = ("<start_of_turn>user\nTell me a short story about a heart failure patient, then list "
              "likely ICD-10-CM codes.<end_of_turn>\n<start_of_turn>model\n")
    applied_sizes = []
    apply = llama_cpp.llama_sampler_apply

    def counting_apply(sampler, array):
        applied_sizes.append(array._obj.size)
        return apply(sampler, array)

    outputs = {}
    for cls in (llama_cpp.Llama, LazyGrammarLlama):
        llm = cls(model_path=str(model), n_ctx=512, n_threads=1, verbose=False)
        tokens = llm.tokenize(prompt.encode())
        grammar = LlamaGrammar.from_json_schema(schema, verbose=False)
        with monkeypatch.context() as patch:
            if cls is LazyGrammarLlama:  # the chain's own sampling must not run: every token is sampled lazily
                patch.setattr(llama_cpp.Llama, "sample", lambda *a, **k: pytest.fail("full chain sampled"))
                patch.setattr(llama_cpp, "llama_sampler_apply", counting_apply)
            generated = []
            for token in llm.generate(tokens, temp=0.0, repeat_penalty=1.1, grammar=grammar):
                generated.append(token)
                if len(generated) == 60 or token == llm.token_eos():
                    break
        outputs[cls] = generated
        llm.close()
    assert outputs[LazyGrammarLlama] == outputs[llama_cpp.Llama]
    assert len(outputs[LazyGrammarLlama]) == 60
    vocabulary = max(applied_sizes)
    # Per token: penalties on the vocabulary, the grammar on the best token, and sometimes a full match.
    full_matches = applied_sizes.count(vocabulary) - 60
    assert applied_sizes.count(1) == 60 and 0 < full_matches < 60, full_matches


def test_the_server_s_grammar_holds_a_reply_to_the_bounds_of_an_integer(tmp_path):
    # llama-cpp-python's converter ignores minimum and maximum: asked to copy 125 into a 0-100 field, the model did,
    # and only validation refused the reply (Direct Forecast's confidences rose to 125 on the MIMIC-III demo).
    import llama_cpp
    from llama_cpp.llama_grammar import LlamaGrammar

    from models.llm.llama_serve import STOCK_JSON_SCHEMA_TO_GBNF, bounded_json_schema_to_gbnf

    schema = json.dumps({"type": "object", "required": ["n"], "additionalProperties": False,
                         "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 100}}})
    llm = llama_cpp.Llama(model_path=str(packaged_model_path(tmp_path)), n_ctx=256, n_threads=1, verbose=False)
    prompt = '<start_of_turn>user\nCopy this JSON exactly: {"n": 125}<end_of_turn>\n<start_of_turn>model\n'
    replies = {}
    try:
        for convert in (STOCK_JSON_SCHEMA_TO_GBNF, bounded_json_schema_to_gbnf):
            grammar = LlamaGrammar.from_string(convert(schema), verbose=False)
            completion = llm.create_completion(prompt, max_tokens=16, temperature=0.0, grammar=grammar)
            replies[convert] = json.loads(completion["choices"][0]["text"])["n"]
    finally:
        llm.close()
    assert replies[STOCK_JSON_SCHEMA_TO_GBNF] == 125  # what the server produced before
    assert 0 <= replies[bounded_json_schema_to_gbnf] <= 100


def test_direct_forecast_on_one_patient_with_the_embedded_server(planted_cohort):
    # One patient: the second took minutes more and adds no path, since this one's first reply already breaks the
    # confidence order and is re-asked.
    wh, cohort_id, _ = planted_cohort
    trajectories, pretarget = shard_inputs(wh, cohort_id, 0, "all", limit=1)
    config = LLMConfig(backend="local", context_window=2048, max_output_tokens=600, local_threads=2)

    assert direct_shard(wh, cohort_id, 0, trajectories, pretarget, 20, "run-local", config) == 1
    calls = wh.read("llm_calls", run_id="run-local", stage="direct")
    # One call per patient at least (more when a reply failed validation and was re-asked), all answered.
    assert set(calls["trajectory_id"]) == set(trajectories["trajectory_id"])
    assert calls["backend"].unique().to_list() == ["local"] and not calls["cache_hit"].any()
    assert calls["status"].is_in(["ok", "invalid"]).all(), calls.select("status", "error").rows()
    counted = calls.select("tokens_in", "tokens_out", "latency_ms", "status", "error")
    assert (calls["tokens_in"] > 0).all() and (calls["tokens_out"] > 0).all() and (calls["latency_ms"] > 0).all(), \
        counted.rows()
    # The schema reaches the server as a grammar, its confidences' 0-100 bounds included: every reply parses as JSON
    # of the right shape, so the only possible validation error is the confidences' order (which JSON Schema cannot
    # express).
    for error in calls["error"].drop_nulls():  # (stored errors are cut at 1,000 characters)
        parts = re.split(r"; (?=at )", error)
        assert all(part.startswith("at predictions/") and "/confidence" in part and "maximum" not in part
                   for part in parts), error
        assert all(part.endswith("confidences must not increase") for part in parts[:-1]), error  # the last may be cut

    status = wh.read("ranking_status", run_id="run-local", system="direct")
    assert status.height == 1 and status["status"].is_in(["ok", "short", "failed"]).all()
    rankings = wh.read("rankings", run_id="run-local", system="direct")
    vocabulary = Vocabulary.from_warehouse(wh.connect(), cohort_id)
    assert all(code in vocabulary for code in rankings["code"])  # V(.) let only codes of Ω through
    for (trajectory_id,), group in rankings.partition_by("trajectory_id", as_dict=True).items():
        assert group.sort("rank")["rank"].to_list() == list(range(1, group.height + 1))
        row = status.filter(pl.col("trajectory_id") == trajectory_id).row(0, named=True)
        assert row["status"] == ("ok" if group.height >= 20 else "short")

    # The rerun is answered from the response cache: no server is needed, no backend call is made.
    direct_shard(wh, cohort_id, 0, trajectories, pretarget, 20, "run-local", config)
    rerun = wh.read("llm_calls", run_id="run-local", stage="direct")
    assert rerun.height == calls.height and rerun["cache_hit"].all() and rerun["tokens_out"].sum() == 0
    assert wh.read("rankings", run_id="run-local", system="direct").sort("trajectory_id", "rank").equals(
        rankings.sort("trajectory_id", "rank"))


def test_the_client_stops_the_server_it_started(tmp_path):
    config = LLMConfig(backend="local", context_window=1024, max_output_tokens=32, local_threads=1, cache=False)
    client = LLMClient.from_config(config, tmp_path)
    schema = {"type": "object", "required": ["answer"], "additionalProperties": False,
              "properties": {"answer": {"type": "string", "maxLength": 20}}}

    async def ask():
        try:
            reply = await client.complete_json([{"role": "user", "content": "Reply in JSON."}], schema, "probe/1",
                                               CallContext("run-probe", "probe"))
            server = client.backend.server
            running = server.process
            assert server.start() == server.base_url and server.process is running  # a running server is reused
            return reply, running
        finally:
            await client.close()

    reply, process = asyncio.run(ask())
    assert set(reply) == {"answer"} and client.calls[0]["tokens_in"] > 0
    assert process.poll() is not None and client.backend.server.process is None  # stopped and reaped by close()
    assert packaged_model_path(tmp_path / "models").stat().st_size > 200 * 2**20  # assembled once, then reused


# A process that starts the embedded server, has it generate, and then waits: SIGKILLed by the test as a flow run's
# process is (the OOM killer, a scheduler's hard timeout, `kill -9` from the operator).
GENERATING_CLIENT = """
import json, sys, threading, time, urllib.request
from pathlib import Path
from models.llm.local_server import LocalServer, packaged_model_path
models = Path(sys.argv[1])
server = LocalServer(packaged_model_path(models), 4096, 1, models / "server.log")
url = server.start()
# The grammar of the schema cannot end before a thousand numbers: the reply runs to max_tokens, minutes on one thread.
schema = {"type": "object", "required": ["n"],
          "properties": {"n": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}}}
body = json.dumps({"messages": [{"role": "user", "content": "Numbers in JSON."}], "max_tokens": 3000,
                   "temperature": 0, "response_format": {"type": "json_object", "schema": schema}}).encode()
request = urllib.request.Request(f"{url}/chat/completions", body, {"Content-Type": "application/json"})
threading.Thread(target=urllib.request.urlopen, args=(request,), kwargs={"timeout": 900}, daemon=True).start()
time.sleep(3)
print(server.process.pid, flush=True)
time.sleep(900)
"""


def test_the_server_ends_with_a_sigkilled_client_in_the_middle_of_a_generation(tmp_path):
    # Asked to stop with SIGTERM, the server first finished the generation its dead client would never read: the
    # retry of the killed flow run then started a second server beside it, each with the model in memory.
    client = subprocess.Popen([sys.executable, "-c", GENERATING_CLIENT, str(tmp_path / "models")],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    server = None
    try:
        server = int(client.stdout.readline())
        os.kill(server, 0)  # up, and generating
        client.kill()
        client.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and Path(f"/proc/{server}").exists():
            time.sleep(0.2)
        log = (tmp_path / "models" / "server.log").read_text()
        assert not Path(f"/proc/{server}").exists(), f"the server outlived its SIGKILLed client:\n{log[-600:]}"
    finally:
        client.kill()
        if server is not None and Path(f"/proc/{server}").exists():
            os.kill(server, signal.SIGKILL)


def test_a_dense_record_rendered_at_the_default_budget_fits_the_window_by_the_model_s_own_count(tmp_path):
    """`llm.chars_per_token` was measured on the demo's prompts (docs/llm.md): a long record dense with dates
    and lab values (Gemma makes each digit a token) must still fit what the window leaves for the prompt."""
    from datetime import datetime, timedelta

    import llama_cpp
    from llama_cpp.llama_chat_format import format_gemma

    from tasks.direct import direct_prompt

    titles = {"I5022": "Chronic systolic (congestive) heart failure", "E119": "Type 2 diabetes mellitus without "
              "complications", "N179": "Acute kidney failure, unspecified", "J189": "Pneumonia, unspecified organism",
              "I10": "Essential (primary) hypertension"}
    labs = [("Creatinine", "mg/dL", 1.3), ("Potassium", "mEq/L", 4.1), ("Hemoglobin", "g/dL", 10.2),
            ("Glucose", "mg/dL", 142.0)]
    rows = []
    for e in range(120):  # weekly admissions: far more than the budget holds
        day = datetime(2150, 1, 1) + timedelta(days=7 * e)
        rows.append(("t", day, "HOSPITAL_ADMISSION//EMERGENCY", None, None, e))
        rows += [("t", day + timedelta(hours=h), f"LAB//{lab}//{unit}", value + e % 7 / 10, None, e)
                 for h, (lab, unit, value) in enumerate(labs)]
        rows += [("t", day + timedelta(days=2), f"DIAGNOSIS//ICD//10//{code}", None, None, e)
                 for code in list(titles)[:2 + e % 4]]
        rows.append(("t", day + timedelta(days=2), "HOSPITAL_DISCHARGE//HOME", None, None, e))
    events = pl.DataFrame(rows, orient="row", schema={
        "trajectory_id": pl.String, "time": pl.Datetime("us"), "code": pl.String, "numeric_value": pl.Float32,
        "text_value": pl.String, "encounter_id": pl.Int64})
    config = LLMConfig()
    rendered = direct_prompt(events, Vocabulary({f"DIAGNOSIS//ICD//10//{c}": t for c, t in titles.items()}), config)
    tokenizer = llama_cpp.Llama(str(packaged_model_path(tmp_path)), vocab_only=True, verbose=False)
    prompt = format_gemma(messages=fold_system_messages(rendered.messages)).prompt  # as the embedded server formats
    tokens = len(tokenizer.tokenize(prompt.encode(), add_bos=True, special=True))
    assert rendered.truncated_chars > 0
    assert tokens <= config.context_window - config.max_output_tokens, (tokens, config.chars_per_token)
