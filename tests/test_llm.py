"""The LLM client on the replay backend and against a real local HTTP server (OpenAI-compatible)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from contextlib import asynccontextmanager
from importlib.metadata import version

import polars as pl
import pytest
from aiohttp import web

from dxr.errors import InputError
from models.llm.backends import (Completion, OpenAIBackend, ReplayBackend, TransportError, UnrecordedRequestError,
                                 append_recording, request_hash)
from models.llm.cache import ResponseCache
from models.llm.client import CallContext, LLMClient, LLMOutputError, prompt_budget
from models.llm.config import EMBEDDED_MODEL, LLMConfig, ModelPrice
from models.llm.telemetry import call_costs
from tests.conftest import serving

SCHEMA = {"type": "object", "required": ["answer"], "additionalProperties": False,
          "properties": {"answer": {"type": "integer"}}}
QUESTION = [{"role": "system", "content": "Reply in JSON."}, {"role": "user", "content": "How many?"}]
CONTEXT = CallContext("run-1", "unit", "c:1:10")


def replay_client(tmp_path, pairs, cache=False, **overrides) -> LLMClient:
    """A client whose replay file holds `pairs` of (messages, reply text, tokens in, tokens out)."""
    config = LLMConfig(backend="replay", replay_file=tmp_path / "replay.jsonl", model="m", **overrides)
    probe = LLMClient(config, backend=None)
    for messages, text, tokens_in, tokens_out in pairs:
        append_recording(config.replay_file, probe.request(messages, SCHEMA),
                         Completion(text, tokens_in, 0, tokens_out))
    return LLMClient(config, ReplayBackend(config.replay_file), ResponseCache(tmp_path / "cache") if cache else None)


def test_valid_reply_is_parsed_and_recorded(tmp_path):
    client = replay_client(tmp_path, [(QUESTION, '{"answer": 3}', 40, 5)])
    assert asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)) == {"answer": 3}
    row = client.telemetry().drop("call_id", "latency_ms", "started_at").to_dicts()
    assert row == [{"run_id": "run-1", "stage": "unit", "trajectory_id": "c:1:10", "backend": "replay", "model": "m",
                    "prompt_version": "unit/1", "tokens_in": 40, "tokens_cached_in": 0, "tokens_out": 5,
                    "tokens_reasoning": 0, "cache_hit": False, "status": "ok", "error": None, "truncated_chars": 0,
                    "model_identity": str(tmp_path / "replay.jsonl"), "attempt": 1, "attempt_reason": "first",
                    "transport_retries": 0, "cost_usd": None}]


def re_ask(bad: str, *errors: str) -> list[dict]:
    """The conversation the client sends after `bad` failed validation with `errors`."""
    return QUESTION + [
        {"role": "assistant", "content": bad},
        {"role": "user", "content": "That reply does not follow the required JSON structure:\n"
         + "".join(f"- {e}\n" for e in errors)
         + "Reply again with only a JSON object that fixes every listed problem."}]


def test_invalid_reply_is_retried_with_its_structural_errors(tmp_path):
    bad = '{"answer": "three", "why": "counted"}'
    feedback = re_ask(bad, "at (root): Additional properties are not allowed ('why' was unexpected)",
                      "at answer: 'three' is not of type 'integer'")
    client = replay_client(tmp_path, [(QUESTION, bad, 40, 9), (feedback, '{"answer": 3}', 90, 5)])
    assert asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)) == {"answer": 3}
    calls = client.telemetry()
    assert calls.select("attempt", "attempt_reason", "status").rows() == [(1, "first", "invalid"),
                                                                          (2, "invalid_reply", "ok")]
    assert calls["tokens_in"].to_list() == [40, 90]
    assert calls["error"][0] == ("at (root): Additional properties are not allowed ('why' was unexpected); "
                                 "at answer: 'three' is not of type 'integer'")


def test_validation_retries_are_bounded(tmp_path):
    bad = "not json at all"
    feedback = re_ask(bad, "the reply is not JSON (Expecting value at character 0)")
    client = replay_client(tmp_path, [(QUESTION, bad, 1, 1), (feedback, bad, 1, 1)], validation_retries=1)
    with pytest.raises(LLMOutputError, match="stayed invalid after 2 attempts: the reply is not JSON"):
        asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))
    assert client.telemetry()["status"].to_list() == ["invalid", "invalid"]


def test_a_re_ask_after_the_same_invalid_reply_says_so_instead_of_repeating_the_previous_request(tmp_path):
    # A deterministic model (or the cache) answers the same request with the same reply: a third request equal to
    # the second could only get the same invalid reply back.
    bad = "not json at all"
    feedback = re_ask(bad, "the reply is not JSON (Expecting value at character 0)")
    noted = [*feedback[:-1], {"role": "user", "content": feedback[-1]["content"].replace(
        "\nReply again", "\nThe same problems as in your previous reply (2 replies in a row): write a different "
        "reply.\nReply again")}]
    client = replay_client(tmp_path, [(QUESTION, bad, 1, 1), (feedback, bad, 1, 1), (noted, '{"answer": 3}', 1, 1)],
                           cache=True)
    assert asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)) == {"answer": 3}
    calls = client.telemetry()
    assert (calls["status"].to_list(), calls["cache_hit"].to_list()) == (["invalid", "invalid", "ok"], [False] * 3)


@pytest.mark.parametrize("reply", ['```json {"answer": 3}```', '```json\n{"answer": 3}\n```',
                                   'Here is the JSON:\n```json\n{"answer": 3}\n```\nIt counts every item.',
                                   # Other JSON flavours' info strings (json5 was read as content: "Extra data").
                                   '```json5\n{"answer": 3}\n```', 'Here:\n```json5 {"answer": 3}```',
                                   '``` JSON\n{"answer": 3}\n```', '```jsonc title="reply"\n{"answer": 3}\n```',
                                   '```application/json\n{"answer": 3}\n```'])
def test_a_reply_in_a_code_fence_is_read_without_a_re_ask(tmp_path, reply):
    # A fence on one line, or after a sentence, was read as "not JSON" and re-asked (the replay file holds no
    # re-ask: one would stop the run).
    client = replay_client(tmp_path, [(QUESTION, reply, 40, 9)])
    assert asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)) == {"answer": 3}
    assert client.telemetry()["status"].to_list() == ["ok"]


@pytest.mark.parametrize("reply", [
    # Another language's fence before the JSON one was read as the answer ("not JSON") and re-asked.
    'An example:\n```python\nprint(count)\n```\nThe answer:\n```json\n{"answer": 3}\n```',
    '```text\ncounted 3 items\n```\n```\n{"answer": 3}\n```',
    # A JSON fence comes before an untagged one; a fence that is not JSON gives way to the next one that is.
    '```\n{"answer": 4}\n```\n```json\n{"answer": 3}\n```', '```json\n{answer: 4}\n```\n```{"answer": 3}```',
    # Small models tag their JSON as another language: read when there is no other fence, the first that is JSON.
    '```python\n{"answer": 3}\n```', '```text\nI count 3.\n```\n```python\n{"answer": 3}\n```'])
def test_a_fence_tagged_with_another_language_is_the_answer_only_when_there_is_no_other(tmp_path, reply):
    client = replay_client(tmp_path, [(QUESTION, reply, 40, 9)])
    assert asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)) == {"answer": 3}
    assert client.telemetry()["status"].to_list() == ["ok"]


@pytest.mark.parametrize("reply", [
    # The JSON tagged as another language beside an untagged fence that is not JSON: the untagged one was the only
    # fence read, so a reply the first fence answered before cost a re-ask.
    '```python\n{"answer": 3}\n```\n```\nDone.\n```', '```\nsee the answer below\n```\n```js\n{"answer": 3}\n```'])
def test_a_fence_tagged_with_another_language_is_read_when_no_untagged_fence_holds_json(tmp_path, reply):
    client = replay_client(tmp_path, [(QUESTION, reply, 40, 9)])
    assert asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)) == {"answer": 3}
    assert client.telemetry()["status"].to_list() == ["ok"]


def test_beside_a_json_fence_a_python_one_is_not_read_and_the_error_is_the_json_fences(tmp_path):
    bad = '```json\n{answer: 3}\n```\n```python\n{"answer": 3}\n```'
    feedback = re_ask(bad, "the reply is not JSON (Expecting property name enclosed in double quotes at character 1)")
    client = replay_client(tmp_path, [(QUESTION, bad, 1, 1), (feedback, '{"answer": 3}', 1, 1)])
    assert asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)) == {"answer": 3}
    assert client.telemetry()["status"].to_list() == ["invalid", "ok"]


def test_a_json5_fence_is_still_read_as_strict_json(tmp_path):
    bad = '```json5\n{answer: 3,}\n```'  # JSON5's unquoted keys and trailing commas are not JSON
    feedback = re_ask(bad, "the reply is not JSON (Expecting property name enclosed in double quotes at character 1)")
    client = replay_client(tmp_path, [(QUESTION, bad, 1, 1), (feedback, '{"answer": 3}', 1, 1)])
    assert asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)) == {"answer": 3}
    assert client.telemetry()["status"].to_list() == ["invalid", "ok"]


def test_an_unclosed_fence_is_re_asked_with_the_error_inside_it(tmp_path):
    bad = '```json\n{"answer": 3'  # a reply cut off inside its fence
    feedback = re_ask(bad, "the reply is not JSON (Expecting ',' delimiter at character 12)")
    client = replay_client(tmp_path, [(QUESTION, bad, 1, 1), (feedback, '{"answer": 3}', 1, 1)])
    assert asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)) == {"answer": 3}
    assert client.telemetry()["status"].to_list() == ["invalid", "ok"]


def test_a_reply_cut_off_at_the_output_limit_says_so_to_the_model_and_in_the_error(tmp_path):
    # A long reply stops inside a string; a reasoning model whose reasoning used up max_completion_tokens answers
    # nothing. Both read as "not JSON" alone, which named neither the cause nor the setting.
    config = LLMConfig(backend="replay", replay_file=tmp_path / "replay.jsonl", model="m", validation_retries=1,
                       max_output_tokens=64)
    probe = LLMClient(config, backend=None)
    cut = "the reply was cut off at the limit of 64 output tokens (llm.max_output_tokens) before it was complete"
    bad = '{"answer'
    append_recording(config.replay_file, probe.request(QUESTION, SCHEMA),
                     Completion(bad, 40, 0, 64, finish_reason="length"))
    append_recording(config.replay_file, probe.request(re_ask(
        bad, cut, "the reply is not JSON (Unterminated string starting at character 1)"), SCHEMA),
        Completion("", 90, 0, 64, tokens_reasoning=64, finish_reason="length"))
    client = LLMClient(config, ReplayBackend(config.replay_file))
    with pytest.raises(LLMOutputError) as raised:
        asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))
    assert str(raised.value) == ("unit reply for c:1:10 stayed invalid after 2 attempts: " + cut
                                 + "; the reply is not JSON (Expecting value at character 0)")
    assert client.telemetry()["error"].to_list() == [
        cut + "; the reply is not JSON (Unterminated string starting at character 1)",
        cut + "; the reply is not JSON (Expecting value at character 0)"]


def test_unrecorded_request_fails_naming_its_hash(tmp_path):
    client = replay_client(tmp_path, [(QUESTION, '{"answer": 3}', 1, 1)])
    other = [{"role": "user", "content": "Something else?"}]
    expected = request_hash(client.request(other, SCHEMA))
    with pytest.raises(UnrecordedRequestError, match=f"no response for request {expected}"):
        asyncio.run(client.complete_json(other, SCHEMA, "unit/1", CONTEXT))


def test_second_identical_call_is_a_cache_hit_without_a_backend_call(tmp_path):
    client = replay_client(tmp_path, [(QUESTION, '{"answer": 3}', 40, 5)], cache=True)
    first = asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))
    second = asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))
    assert first == second == {"answer": 3}
    assert client.backend.calls == 1
    calls = client.telemetry()
    assert calls["cache_hit"].to_list() == [False, True]
    assert calls["tokens_in"].to_list() == [40, 0]  # a cache hit costs no tokens
    # A new prompt version is a different cache key: the backend is asked again.
    asyncio.run(client.complete_json(QUESTION, SCHEMA, "unit/2", CONTEXT))
    assert client.backend.calls == 2


def test_each_call_stores_its_cost_at_the_price_table_of_its_run(tmp_path):
    # $2/M input and $10/M output: 40 tokens in and 5 out cost 80 + 50 micro-dollars.
    priced = replay_client(tmp_path, [(QUESTION, '{"answer": 3}', 40, 5)],
                           prices={"m": ModelPrice(input=2.0, output=10.0)})
    asyncio.run(priced.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))
    assert priced.telemetry()["cost_usd"].to_list() == [130e-6]
    # The default table prices only the embedded model: "m" has no price, so its request's cost is unknown (null),
    # while its cache hit sent no request and cost 0.
    unpriced = replay_client(tmp_path, [(QUESTION, '{"answer": 3}', 40, 5)], cache=True)
    for _ in range(2):
        asyncio.run(unpriced.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))
    assert unpriced.telemetry().select("cache_hit", "cost_usd").rows() == [(False, None), (True, 0.0)]


def test_a_configured_price_table_adds_to_the_embedded_models_zero_price(tmp_path, monkeypatch):
    # Pricing an endpoint's model in dxr.toml replaced the whole table: the embedded model lost its price of 0, so
    # every local run stored its calls' cost as unknown.
    from dxr.config import load_settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "dxr.toml").write_text('[llm.prices."gpt-4.1-mini"]\ninput = 0.4\noutput = 1.6\n')
    prices = load_settings().llm.prices
    assert prices[EMBEDDED_MODEL] == ModelPrice() and prices["gpt-4.1-mini"] == ModelPrice(input=0.4, output=1.6)
    # A price set for the embedded model itself (say, to account for the hardware) is the one that holds.
    (tmp_path / "dxr.toml").write_text(f'[llm.prices."{EMBEDDED_MODEL}"]\ninput = 0.01\n')
    assert load_settings().llm.prices == {EMBEDDED_MODEL: ModelPrice(input=0.01)}


def test_cache_files_are_complete_json_named_by_their_key(tmp_path):
    cache = ResponseCache(tmp_path / "cache")
    cache.put("key input", Completion("text", 1, 2, 3, 4))
    files = list((tmp_path / "cache").rglob("*"))
    assert [p.name for p in files if p.is_file()] == [cache.path("key input").name]  # no temporary file left
    assert json.loads(cache.path("key input").read_text())["key_input"] == "key input"
    assert cache.get("key input") == Completion("text", 1, 2, 3, 4)
    assert cache.get("other") is None


def test_cost_is_computed_from_the_price_table():
    calls = pl.DataFrame({"model": ["m", "m", "free"], "tokens_in": [1_000_000, 0, 5],
                          "tokens_cached_in": [500_000, 0, 0], "tokens_out": [100_000, 0, 5],
                          "tokens_reasoning": [0, 0, 0], "cache_hit": [False, True, False]})
    prices = {"m": ModelPrice(input=2.0, cached_input=0.5, output=10.0)}
    # 500k uncached at $2/M + 500k cached at $0.5/M + 100k out at $10/M = 1 + 0.25 + 1 = 2.25;
    # unpriced models cost null.
    assert call_costs(calls, prices)["cost_usd"].to_list() == [2.25, 0.0, None]
    # A price without a cached-input discount bills cached tokens as input, not as free: 1M at $2/M + 100k at $10/M.
    assert call_costs(calls, {"m": ModelPrice(input=2.0, output=10.0)})["cost_usd"][0] == 3.0


# ---- a real OpenAI-compatible HTTP server on 127.0.0.1 ------------------------------------------

@asynccontextmanager
async def chat_server(delay_s: float, state: dict):
    """A local `/v1/chat/completions` endpoint that waits `delay_s` and counts requests in flight."""
    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        state["requests"].append(body)
        try:
            await asyncio.sleep(delay_s)
        finally:
            state["in_flight"] -= 1
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": '{"answer": 7}'}}],
                                  "usage": {"prompt_tokens": 12, "completion_tokens": 4,
                                            "prompt_tokens_details": {"cached_tokens": 8},
                                            "completion_tokens_details": {"reasoning_tokens": 2}}})

    async with serving(chat) as url:
        yield url


def http_client(base_url: str, **overrides) -> LLMClient:
    config = LLMConfig(backend="openai", base_url=base_url, model="served", **overrides)
    return LLMClient(config, OpenAIBackend(config.base_url, config.timeout_s, api_key=None))


async def outcome(client: LLMClient, error: type[Exception]) -> tuple:
    """The client's answer to QUESTION, or the `error` it raised instead, with its telemetry; the client is closed."""
    try:
        return await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT), client.telemetry()
    except error as exc:
        return exc, client.telemetry()
    finally:
        await client.close()


def new_state() -> dict:
    return {"in_flight": 0, "max_in_flight": 0, "requests": []}


def test_openai_backend_over_http_reads_tokens_by_kind():
    async def scenario():
        state = new_state()
        async with chat_server(0.0, state) as url:
            client = http_client(url)
            value = await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)
            await client.close()
        return value, state, client.telemetry()

    value, state, calls = asyncio.run(scenario())
    assert value == {"answer": 7}
    sent = state["requests"][0]
    assert (sent["model"], sent["temperature"], sent["seed"], sent["messages"]) == ("served", 0.0, 7, QUESTION)
    assert sent["response_format"]["json_schema"]["schema"] == SCHEMA
    assert calls.select("tokens_in", "tokens_cached_in", "tokens_out", "tokens_reasoning").row(0) == (12, 8, 4, 2)


def test_concurrency_limit_is_respected():
    async def scenario():
        state = new_state()
        async with chat_server(0.1, state) as url:
            client = http_client(url, max_concurrency=2)
            await asyncio.gather(*(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT) for _ in range(6)))
            await client.close()
        return state

    state = asyncio.run(scenario())
    assert len(state["requests"]) == 6
    assert state["max_in_flight"] == 2


def test_a_backend_that_times_out_is_retried_then_reported():
    async def scenario():
        state = new_state()
        async with chat_server(2.0, state) as url:
            client = http_client(url, timeout_s=0.2, transport_retries=1, backoff_s=0.05)
            with pytest.raises(TransportError, match="gave up after 2 attempts: timeout after 0.2s"):
                await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)
            await client.close()
        return state, client.telemetry()

    state, calls = asyncio.run(scenario())
    assert len(state["requests"]) == 2  # first try plus one retry
    assert calls.select("status", "attempt", "transport_retries").rows() == [("transport_error", 1, 1)]
    assert calls["latency_ms"][0] >= 400


def test_an_endpoint_that_cannot_be_connected_to_is_retried_then_stops_the_run():
    from dxr.errors import ConfigError
    from models.llm.client import EndpointUnreachableError

    async def scenario():
        client = http_client("http://127.0.0.1:1/v1", transport_retries=2, backoff_s=0.0)  # nothing listens there
        try:
            with pytest.raises(EndpointUnreachableError) as raised:
                await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)
        finally:
            await client.close()
        return raised.value, client.telemetry()

    error, calls = asyncio.run(scenario())
    # A configuration error: the run stops with it instead of failing request after request.
    assert isinstance(error, ConfigError)
    assert str(error).startswith("unit: gave up after 3 attempts: cannot connect to "
                                 "http://127.0.0.1:1/v1/chat/completions (ClientConnectorError")
    assert str(error).endswith("start the endpoint, or check llm.base_url and llm.backend")
    assert calls["status"].to_list() == ["transport_error"]


def test_an_embedded_server_that_stopped_answering_is_named_with_its_log(tmp_path):
    from models.llm.client import EndpointUnreachableError
    from models.llm.local_server import LocalBackend, LocalServer

    class Stopped(LocalServer):  # as if it had started, then died (killed for memory), leaving its port closed
        def start(self) -> str:
            self.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(137)"])
            self.process.wait()
            return "http://127.0.0.1:1/v1"

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "server.log").write_text("llama_model_load: loaded\nKilled\n")
    backend = LocalBackend(Stopped(tmp_path / "m.gguf", 2048, 1, tmp_path / "server.log"), 10.0)
    client = LLMClient(LLMConfig(transport_retries=0), backend)

    async def scenario():
        try:
            await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)
        finally:
            await client.close()

    with pytest.raises(EndpointUnreachableError, match="gave up after 1 attempt: the embedded llama.cpp server "
                       "at http://127.0.0.1:1/v1/chat/completions stopped answering \\(exited with code 137; last "
                       "log line: Killed; full log: .*server.log\\): run it again under the same run id to resume"):
        asyncio.run(scenario())


def test_an_embedded_server_killed_by_a_signal_is_named_so_with_the_way_to_resume(tmp_path):
    """Popen reports a server killed by SIGKILL (the out-of-memory killer, an operator's kill -9) as return code -9:
    the line names the signal, not an exit code -9, and says how to resume the run."""
    from models.llm.client import EndpointUnreachableError
    from models.llm.local_server import LocalBackend, LocalServer

    class Killed(LocalServer):  # as if it had started, then been killed, leaving its port closed
        def start(self) -> str:
            self.process = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), "
                                             "signal.SIGKILL)"])
            self.process.wait()
            return "http://127.0.0.1:1/v1"

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    backend = LocalBackend(Killed(tmp_path / "m.gguf", 2048, 1, tmp_path / "server.log"), 10.0)
    # No retry can reach a server whose process has ended: the run stops at the first attempt, without backing off.
    client = LLMClient(LLMConfig(transport_retries=3, backoff_s=30.0), backend)

    async def scenario():
        try:
            await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)
        finally:
            await client.close()

    with pytest.raises(EndpointUnreachableError) as raised:
        asyncio.run(scenario())
    message = str(raised.value)
    assert message.startswith("unit: gave up after 1 attempt: ") and client.calls[0]["transport_retries"] == 0
    assert "stopped answering (killed by signal 9 (Killed); last log line: no output; full log: " in message
    assert "code -9" not in message
    # A plain rerun in a container short of memory would lose its server again.
    assert message.endswith("server.log): if the machine or its container is short of memory (the kernel's "
                            "out-of-memory killer sends SIGKILL), free some or give it more (docs/benchmarks.md#memory "
                            "lists what each step needs), then run it again under the same run id to resume (a new "
                            "server starts; with llm.cache on, the replies already received are not asked for again)")


def test_a_backend_that_keeps_computing_timed_out_requests_uses_its_own_timeout_and_does_not_retry():
    class LocalLike(OpenAIBackend):  # as the embedded llama.cpp backend declares itself
        max_concurrency = 1
        retry_timeouts = False

        def __init__(self, url: str, timeout_s: float):
            super().__init__(url, timeout_s)
            self.timeout_s = timeout_s

    async def scenario():
        state = new_state()
        async with chat_server(2.0, state) as url:
            config = LLMConfig(backend="openai", base_url=url, model="served", timeout_s=30.0, transport_retries=3)
            client = LLMClient(config, LocalLike(url, 0.2))
            with pytest.raises(TransportError, match="gave up after 1 attempt: timeout after 0.2s"):
                await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)
            await client.close()
        return state, client.telemetry()

    state, calls = asyncio.run(scenario())
    assert len(state["requests"]) == 1  # a retry would only queue behind the request still being computed
    assert calls["status"].to_list() == ["transport_error"]


def test_the_embedded_backend_takes_the_local_timeout(tmp_path):
    from models.llm.backends import make_backend

    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # not started here: the server starts on the first request
    backend = make_backend(LLMConfig(local_timeout_s=600.0, local_model_path=tmp_path / "m.gguf"), tmp_path)
    assert (backend.timeout_s, backend.retry_timeouts, backend.max_concurrency) == (600.0, False, 1)


def test_backend_totals_count_cache_hits_as_calls_without_tokens_or_cost():
    from models.llm.telemetry import backend_totals

    calls = pl.DataFrame({"stage": ["direct"] * 3, "backend": ["openai"] * 3, "model": ["m"] * 3,
                          "trajectory_id": ["a", "a", "b"], "tokens_in": [1000, 1200, 900],
                          "tokens_cached_in": [0, 0, 400], "tokens_out": [300, 250, 280], "tokens_reasoning": [0, 0, 0],
                          "latency_ms": [1000.0, 2.0, 3000.0], "cache_hit": [False, True, False]})
    totals = backend_totals(call_costs(calls, {"m": ModelPrice(input=1.0, cached_input=0.5, output=2.0)}),
                            ["stage"]).row(0, named=True)
    assert (totals["llm_calls"], totals["backend_calls"], totals["cache_hits"]) == (3, 2, 1)
    assert (totals["tokens_in"], totals["tokens_cached_in"], totals["tokens_out"]) == (1900, 400, 580)
    assert (totals["latency_ms_p50"], totals["latency_ms_total"]) == (2000.0, 4000.0)
    # (1900 - 400) uncached at $1/M + 400 cached at $0.5/M + 580 out at $2/M; the cache hit costs nothing.
    assert totals["cost_usd"] == pytest.approx((1500 * 1.0 + 400 * 0.5 + 580 * 2.0) / 1e6)
    assert backend_totals(call_costs(calls, {}), ["stage"])["cost_usd"].to_list() == [None]


def _write_many(root: str) -> int:
    cache = ResponseCache(Path(root))
    for i in range(200):
        cache.put(f"key {i % 20}", Completion(f"reply {i % 20}", i % 20))
    return 200


def test_cache_is_safe_under_concurrent_processes(tmp_path):
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=2) as pool:
        assert list(pool.map(_write_many, [str(tmp_path)] * 4)) == [200] * 4
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 20 and not [p for p in files if p.name.startswith(".tmp-")]
    cache = ResponseCache(tmp_path)
    assert [cache.get(f"key {i}") for i in range(20)] == [Completion(f"reply {i}", i) for i in range(20)]


def test_rate_limit_spaces_request_starts():
    async def scenario():
        state = new_state()
        async with chat_server(0.0, state) as url:
            client = http_client(url, requests_per_minute=600)  # one start every 0.1 s
            started = asyncio.get_running_loop().time()
            await asyncio.gather(*(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT) for _ in range(5)))
            elapsed = asyncio.get_running_loop().time() - started
            await client.close()
        return state, elapsed

    state, elapsed = asyncio.run(scenario())
    assert len(state["requests"]) == 5
    assert 0.4 <= elapsed < 2.0  # four gaps of 0.1 s between five starts


def test_a_backend_that_admits_one_request_gets_one_at_a_time():
    class OneAtATime(OpenAIBackend):
        max_concurrency = 1  # as the embedded llama.cpp server declares

    async def scenario():
        state = new_state()
        async with chat_server(0.05, state) as url:
            config = LLMConfig(backend="openai", base_url=url, model="served", max_concurrency=4)
            client = LLMClient(config, OneAtATime(url, config.timeout_s))
            await asyncio.gather(*(client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT) for _ in range(4)))
            await client.close()
        return state, client.telemetry()

    state, calls = asyncio.run(scenario())
    assert len(state["requests"]) == 4 and state["max_in_flight"] == 1
    # Latency is time in flight, not time spent queued behind the other three calls.
    assert calls["latency_ms"].max() < 4 * 50


def test_a_rejected_request_is_recorded_and_not_retried():
    async def rejecting(request: web.Request) -> web.Response:
        state["requests"] += 1
        return web.Response(status=400, text="the prompt exceeds the context window")

    async def scenario():
        async with serving(rejecting) as url:
            client = http_client(url)
            try:
                with pytest.raises(InputError, match="HTTP 400 .* exceeds the context window"):
                    await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)
            finally:
                await client.close()
        return client.telemetry()

    state = {"requests": 0}
    calls = asyncio.run(scenario())
    assert state["requests"] == 1
    assert calls.select("status").row(0) == ("rejected",) and "HTTP 400" in calls["error"][0]


def test_a_retry_quotes_only_the_latest_reply_and_at_most_ten_errors():
    roomy = LLMClient(LLMConfig(context_window=4096, max_output_tokens=100), backend=None)
    errors = [f"at predictions/{i}/confidence: too high" for i in range(1, 13)]
    conversation = roomy.retry_conversation(QUESTION, '{"predictions": []}', errors)
    assert conversation[:2] == QUESTION and conversation[2] == {"role": "assistant", "content": '{"predictions": []}'}
    feedback = conversation[3]["content"]
    assert "at predictions/10/" in feedback and "at predictions/11/" not in feedback
    assert "- and 2 more problems of the same kinds" in feedback
    # When the quoted reply would not leave room for a new one, only the errors are appended.
    tight = LLMClient(LLMConfig(context_window=512, max_output_tokens=500), backend=None)
    assert tight.retry_conversation(QUESTION, "x" * 600, errors)[:-1] == QUESTION


def test_structural_errors_are_listed_in_reply_order_so_a_re_ask_names_the_first_ones(tmp_path):
    # Sorted as text, predictions/10 and /11 came before /2 and the re-ask's ten listed errors skipped /9.
    schema = {"type": "object", "properties": {"predictions": {"type": "array", "items": {"maximum": 100}}}}
    reply = json.dumps({"predictions": [90] + [101 + i for i in range(11)]})
    client = replay_client(tmp_path, [(QUESTION, reply, 40, 5)], validation_retries=0, response_format="none")
    with pytest.raises(LLMOutputError):
        asyncio.run(client.complete_json(QUESTION, schema, "unit/1", CONTEXT))
    assert client.telemetry()["error"].to_list() == [
        "; ".join(f"at predictions/{i}: {100 + i} is greater than the maximum of 100" for i in range(1, 12))]
    feedback = client.retry_conversation(QUESTION, reply, client.telemetry()["error"][0].split("; "))[-1]["content"]
    listed = [line.split(":")[0] for line in feedback.splitlines()[1:11]]
    assert listed == [f"- at predictions/{i}" for i in range(1, 11)]


def answering(replies: list, state: dict):
    """A handler that answers each request with the next of `replies`: (status, body bytes, headers)."""
    async def handler(request: web.Request) -> web.Response:
        state.setdefault("times", []).append(asyncio.get_running_loop().time())
        status, body, headers = replies[min(len(state["times"]), len(replies)) - 1]
        return web.Response(status=status, body=body, headers=headers, content_type="application/json")
    return handler


GOOD = (200, json.dumps({"choices": [{"message": {"content": '{"answer": 7}'}}]}).encode(), {})


def test_a_body_that_is_not_a_json_completion_is_retried_and_recorded_as_a_transport_error():
    not_utf8 = (200, b"\xff\xfe<html>proxy</html>", {})
    not_json = (200, b"<html>502 Bad Gateway</html>", {})

    async def scenario(replies: list, retries: int):
        state = {}
        async with serving(answering(replies, state)) as url:
            return *await outcome(http_client(url, transport_retries=retries, backoff_s=0.0), TransportError), url

    value, calls, _ = asyncio.run(scenario([not_utf8, not_json, GOOD], retries=2))
    assert value == {"answer": 7}
    assert calls.select("status", "error").rows() == [("ok", None)]
    error, calls, url = asyncio.run(scenario([not_json], retries=1))
    message = (f"HTTP 200 from {url}/chat/completions is not a JSON completion (JSONDecodeError: Expecting value: "
               "line 1 column 1 (char 0)); the body starts '<html>502 Bad Gateway</html>'")
    assert str(error) == f"unit: gave up after 2 attempts: {message}"
    assert calls.select("status", "error").rows() == [("transport_error", message)]


def test_refusals_of_every_request_are_run_errors_and_a_prompt_too_long_is_the_request_s():
    from dxr.errors import ConfigError
    from models.llm.backends import ContextLengthError

    def refusal(status: int, message: str) -> tuple:
        kind = "insufficient_quota" if status == 429 else "invalid_request_error"
        return status, json.dumps({"error": {"message": message, "type": kind, "code": kind}}).encode(), {}

    async def scenario(reply: tuple):
        state = {}
        async with serving(answering([reply], state)) as url:
            return *await outcome(http_client(url), Exception), url, len(state["times"])  # the type is the point

    for status, text, fix in [
            (401, "Incorrect API key provided",
             "check the API key in the environment variable named by llm.api_key_env"),
            (404, "The model `gpt-9` does not exist",
             "check llm.base_url (the OpenAI-compatible base URL, usually ending in /v1) and llm.model"),
            (400, "Unsupported parameter: 'seed'",
             "the endpoint refuses the request's parameters: check llm.model, llm.response_format and llm.base_url"),
            # OpenAI's 429 for an account out of credit: no retry, nor any other request, can succeed.
            (429, "You exceeded your current quota, please check your plan and billing details.",
             "the API key's quota is used up: check the plan and billing of the key in the environment variable "
             "named by llm.api_key_env")]:
        error, calls, url, requests = asyncio.run(scenario(refusal(status, text)))
        assert type(error) is ConfigError and requests == 1
        assert str(error) == f"HTTP {status} from {url}/chat/completions: {text}; {fix}"
        assert calls["status"].to_list() == ["rejected"]
    too_long = ("This model's maximum context length is 8192 tokens. However, you requested 9500 tokens "
                "(8000 in the messages, 1500 in the completion). Please reduce the length of the messages or "
                "completion.")
    error, calls, url, _ = asyncio.run(scenario(refusal(400, too_long)))
    assert type(error) is ContextLengthError and (error.prompt_tokens, error.context_window) == (8000, 8192)
    # llama.cpp's own llama-server gives the counts as fields.
    llama_server = {"error": {"code": 400, "message": "the request exceeds the available context size, try increasing "
                              "it", "type": "exceed_context_size_error", "n_prompt_tokens": 9001, "n_ctx": 8192}}
    error, _, _, _ = asyncio.run(scenario((400, json.dumps(llama_server).encode(), {})))
    assert type(error) is ContextLengthError and (error.prompt_tokens, error.context_window) == (9001, 8192)


def test_retry_after_is_waited_for():
    busy = (429, b'{"error": {"message": "Rate limit reached"}}', {"Retry-After": "1"})

    async def scenario():
        state = {}
        async with serving(answering([busy, GOOD], state)) as url:
            client = http_client(url, backoff_s=0.0)
            value = await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT)
            await client.close()
        return value, state["times"]

    value, times = asyncio.run(scenario())
    assert value == {"answer": 7} and len(times) == 2
    assert times[1] - times[0] >= 0.95  # the backoff alone would have asked again at once


def test_the_cache_key_and_telemetry_name_the_model_that_answers(tmp_path):
    from models.llm.backends import make_backend

    # Two models under one name and size in two directories, and a copy of the first elsewhere.
    for folder, fill in (("a", b"a"), ("b", b"b"), ("copy", b"a")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "model.gguf").write_bytes(b"GGUF" + fill * 300_000)

    def identity(folder: str) -> str:
        return make_backend(LLMConfig(local_model_path=tmp_path / folder / "model.gguf"), tmp_path).identity

    assert identity("a") != identity("b")
    assert identity("a") == identity("copy") and identity("a").startswith("model.gguf@")

    def answer(value: int):
        async def handler(request: web.Request) -> web.Response:
            return web.json_response({"choices": [{"message": {"content": json.dumps({"answer": value})}}]})
        return handler

    async def scenario():
        cache = ResponseCache(tmp_path / "cache")
        answers = []
        async with serving(answer(1)) as first, serving(answer(2)) as second:
            for url in (first, second, first):
                config = LLMConfig(backend="openai", base_url=url, model="same-name")
                client = LLMClient(config, OpenAIBackend(url, 5), cache)
                answers.append((await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))["answer"])
                answers.append(client.telemetry().select("model", "model_identity", "cache_hit").row(0))
                await client.close()
        return first, second, answers

    first, second, answers = asyncio.run(scenario())
    assert answers == [1, ("same-name", first, False), 2, ("same-name", second, False),
                       1, ("same-name", first, True)]


def test_a_re_ask_stays_within_the_prompt_budget():
    from models.llm.client import FEEDBACK_RESERVE_CHARS, MAX_ERROR_CHARS

    client = LLMClient(LLMConfig(context_window=4096, max_output_tokens=1000, chars_per_token=3.0), backend=None)
    budget = prompt_budget(client.config)
    assert budget == 9288
    # A first prompt as long as a renderer makes it: the budget less the reserve for a re-ask.
    messages = [{"role": "system", "content": "s" * 1000}, {"role": "user", "content": "h" * (budget - 1000 - 800)}]
    assert FEEDBACK_RESERVE_CHARS == 800
    errors = [f"at predictions/{i}/code: '{'Z' * 300}' does not match the pattern" for i in range(12)]
    retry = client.retry_conversation(messages, '{"predictions": []}', errors)
    assert retry[:2] == messages and retry[2]["role"] == "user"  # no room to quote the reply
    feedback = retry[2]["content"]
    assert sum(len(m["content"]) for m in retry) <= budget
    listed = [line for line in feedback.splitlines() if line.startswith("- at ")]
    assert len(listed) == 3 and all(len(line) == 2 + MAX_ERROR_CHARS for line in listed)
    assert "- and 9 more problems of the same kinds" in feedback


def test_doctests():
    import doctest

    import models.llm.backends
    import models.llm.client
    import models.llm.llama_serve
    import tasks.direct

    for module in (models.llm.backends, models.llm.client, models.llm.llama_serve, tasks.direct):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def served_locally(tmp_path: Path, url: str, window: int = 2048, threads: int = 1):
    """The embedded backend, its llama.cpp server stood in for by the local HTTP endpoint at `url`, its model a
    small file to fingerprint."""
    from models.llm.local_server import LocalBackend, LocalServer

    class Started(LocalServer):
        def start(self) -> str:
            return url

    model = tmp_path / "m.gguf"
    if not model.exists():
        model.write_bytes(b"GGUF" + b"w" * 1000)
    return LocalBackend(Started(model, window, threads, tmp_path / "server.log"), 10.0)


def test_the_cache_key_holds_the_context_window_the_model_answered_within(tmp_path):
    """A reply depends on the window it was computed in (a server with a full window cuts it off or refuses the
    prompt), which the request does not carry: another window asks again instead of replaying it."""
    from models.llm.local_server import CHAT_FORMAT, SCHEMA_GRAMMAR_VERSION, SYSTEM_FOLD_VERSION

    def counting(state: dict):
        async def handler(request: web.Request) -> web.Response:
            state["requests"] += 1
            return web.json_response({"choices": [{"message": {"content": json.dumps({"answer": state["requests"]})}}]})
        return handler

    async def ask(make_client, windows: list[int]) -> list[tuple[int, bool]]:
        answers = []
        for window in windows:
            client = make_client(window)
            value = (await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))["answer"]
            answers.append((value, client.telemetry()["cache_hit"][0]))
            await client.close()
        return answers

    async def scenario():
        local_state, http_state = {"requests": 0}, {"requests": 0}
        async with serving(counting(local_state)) as local_url, serving(counting(http_state)) as http_url:
            def local_client(window: int) -> LLMClient:
                return LLMClient(LLMConfig(context_window=window), served_locally(tmp_path, local_url, window),
                                 ResponseCache(tmp_path / "local-cache"))

            def http_client_of(window: int) -> LLMClient:
                config = LLMConfig(backend="openai", base_url=http_url, model="served", context_window=window)
                return LLMClient(config, OpenAIBackend(http_url, 10.0), ResponseCache(tmp_path / "http-cache"))

            return await ask(local_client, [2048, 4096, 2048]), await ask(http_client_of, [2048, 4096, 2048])

    local, http = asyncio.run(scenario())
    assert local == [(1, False), (2, False), (1, True)]
    assert http == [(1, False), (2, False), (1, True)]
    files = (tmp_path / "local-cache").rglob("*.json")
    keys = sorted((json.loads(json.loads(p.read_text())["key_input"]) for p in files),
                  key=lambda key: key["serving"]["context_window"])
    identity = served_locally(tmp_path, "").identity
    assert [{k: v for k, v in key.items() if k != "request"} for key in keys] == [
        {"backend": "local", "identity": identity, "prompt_version": "unit/1",
         "serving": {"chat_format": CHAT_FORMAT, "context_window": window, "system_fold": SYSTEM_FOLD_VERSION,
                     "schema_grammar": SCHEMA_GRAMMAR_VERSION, "llama_cpp_python": version("llama-cpp-python")}}
        for window in (2048, 4096)]


def test_the_cache_key_of_the_embedded_backend_holds_llama_cpp_python_not_the_server_threads(tmp_path, monkeypatch):
    """Another llama-cpp-python (its llama.cpp kernels and samplers) may compute another reply: the embedded backend
    asks again. Another thread count (another machine's cores) replays the cache. An OpenAI-compatible backend's key
    holds no version (its server's own)."""
    from models.llm import local_server

    requests: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        requests.append(1)
        return web.json_response({"choices": [{"message": {"content": json.dumps({"answer": len(requests)})}}]})

    async def ask(client: LLMClient) -> tuple[int, bool, dict]:
        value = (await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))["answer"]
        await client.close()
        return value, client.telemetry()["cache_hit"][0], client.serving

    def local_client(url: str, threads: int) -> LLMClient:
        return LLMClient(LLMConfig(context_window=2048), served_locally(tmp_path, url, threads=threads),
                         ResponseCache(tmp_path / "c"))

    async def scenario():
        async with serving(handler) as url:
            asked = [await ask(local_client(url, threads)) for threads in (1, 2, 1)]
            monkeypatch.setattr(local_server, "llama_cpp_python_version", lambda: "0.4.0")
            asked.append(await ask(local_client(url, 1)))
            http = LLMClient(LLMConfig(backend="openai", base_url=url, model="served", context_window=2048),
                             OpenAIBackend(url, 10.0), ResponseCache(tmp_path / "http"))
            return asked, await ask(http)

    asked, http = asyncio.run(scenario())
    assert [(value, hit) for value, hit, _ in asked] == [(1, False), (1, True), (1, True), (2, False)]
    installed = version("llama-cpp-python")
    assert [key["llama_cpp_python"] for _, _, key in asked] == [installed, installed, installed, "0.4.0"]
    assert http[:2] == (3, False) and http[2] == {"context_window": 2048}


def test_the_cache_key_of_the_embedded_backend_holds_how_system_messages_are_folded(tmp_path, monkeypatch):
    """The key holds the request before the embedded backend folds its system messages into the first user turn:
    a fold that renders the prompt differently is a version of its own, so the client asks again."""
    from models.llm import local_server

    received: list[list[dict]] = []

    async def handler(request: web.Request) -> web.Response:
        received.append((await request.json())["messages"])
        return web.json_response({"choices": [{"message": {"content": json.dumps({"answer": len(received)})}}]})

    async def ask(url: str) -> tuple[int, bool, dict]:
        client = LLMClient(LLMConfig(context_window=2048), served_locally(tmp_path, url), ResponseCache(tmp_path / "c"))
        value = (await client.complete_json(QUESTION, SCHEMA, "unit/1", CONTEXT))["answer"]
        hit = client.telemetry()["cache_hit"][0]
        await client.close()
        return value, hit, client.serving

    def fold_on_one_line(messages: list[dict]) -> list[dict]:  # a later fold: another rendering of the prompt
        system = " ".join(m["content"] for m in messages if m["role"] == "system")
        rest = [dict(m) for m in messages if m["role"] != "system"]
        rest[0]["content"] = f"{system} {rest[0]['content']}"
        return rest

    async def scenario():
        async with serving(handler) as url:
            first = await ask(url)
            again = await ask(url)
            monkeypatch.setattr(local_server, "fold_system_messages", fold_on_one_line)
            monkeypatch.setattr(local_server, "SYSTEM_FOLD_VERSION", local_server.SYSTEM_FOLD_VERSION + 1)
            return first, again, await ask(url)

    first, again, refolded = asyncio.run(scenario())
    assert [(value, hit) for value, hit, _ in (first, again, refolded)] == [(1, False), (1, True), (2, False)]
    assert first[2]["system_fold"] + 1 == refolded[2]["system_fold"]
    # The server got the folded prompts; the key holds the messages as the client wrote them.
    assert received == [[{"role": "user", "content": "Reply in JSON.\n\nHow many?"}],
                        [{"role": "user", "content": "Reply in JSON. How many?"}]]
    keys = [json.loads(json.loads(p.read_text())["key_input"]) for p in (tmp_path / "c").rglob("*.json")]
    assert sorted(key["serving"]["system_fold"] for key in keys) == [first[2]["system_fold"],
                                                                     refolded[2]["system_fold"]]
    assert all(key["request"]["messages"] == QUESTION for key in keys)


def test_after_an_error_that_stops_the_run_no_request_is_sent_and_none_retried():
    from dxr.errors import ConfigError
    from models.llm.client import RunStoppedError

    busy = (503, b'{"error": {"message": "overloaded"}}', {})
    unauthorized = (401, b'{"error": {"message": "Incorrect API key provided"}}', {})

    async def handler(request: web.Request) -> web.Response:
        # The first request meets a busy server and backs off; the second finds the key refused.
        state["requests"] += 1
        status, body, headers = [busy, unauthorized][min(state["requests"], 2) - 1]
        return web.Response(status=status, body=body, headers=headers, content_type="application/json")

    async def scenario():
        async with serving(handler) as url:
            client = http_client(url, backoff_s=0.5, max_concurrency=1)
            first = asyncio.ensure_future(client.complete_json(QUESTION, SCHEMA, "unit/1", CallContext("r", "u", "a")))
            await asyncio.sleep(0.1)  # the first has had its 503 and is backing off
            with pytest.raises(ConfigError, match="HTTP 401"):
                await client.complete_json(QUESTION, SCHEMA, "unit/1", CallContext("r", "u", "b"))
            with pytest.raises(RunStoppedError, match="^u: not sent, the run stopped on: HTTP 401 from "):
                await first
            with pytest.raises(RunStoppedError):
                await client.complete_json(QUESTION, SCHEMA, "unit/1", CallContext("r", "u", "c"))
            await client.close()
        return client.telemetry(), url

    state = {"requests": 0}
    calls, url = asyncio.run(scenario())
    assert state["requests"] == 2
    assert calls.select("trajectory_id", "status", "error").rows() == [
        ("a", "cancelled", f"not retried, the run stopped; HTTP 503 from {url}/chat/completions: overloaded"),
        ("b", "rejected", f"HTTP 401 from {url}/chat/completions: Incorrect API key provided; check the API key in "
                          "the environment variable named by llm.api_key_env")]


def test_reasoning_models_are_sent_max_completion_tokens_when_configured():
    from dxr.errors import ConfigError

    # OpenAI's reasoning models (o1, o3, ...) refuse max_tokens and take max_completion_tokens instead.
    async def reasoning_model(request: web.Request) -> web.Response:
        body = await request.json()
        state["requests"].append(body)
        if "max_tokens" in body:
            return web.json_response({"error": {
                "message": "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                           "'max_completion_tokens' instead.", "type": "invalid_request_error", "param": "max_tokens",
                "code": "unsupported_parameter"}}, status=400)
        return web.json_response({"choices": [{"message": {"content": '{"answer": 7}'}, "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 12, "completion_tokens": 40,
                                            "completion_tokens_details": {"reasoning_tokens": 30}}})

    async def scenario(**overrides):
        async with serving(reasoning_model) as url:
            return *await outcome(http_client(url, max_output_tokens=900, **overrides), ConfigError), url

    state = {"requests": []}
    error, calls, url = asyncio.run(scenario())
    assert [sorted(k for k in r if k.startswith("max_")) for r in state["requests"]] == [["max_tokens"]]
    assert str(error) == (f"HTTP 400 from {url}/chat/completions: Unsupported parameter: 'max_tokens' is not "
                          "supported with this model. Use 'max_completion_tokens' instead.; the model takes "
                          "max_completion_tokens instead of max_tokens: set llm.max_tokens_field = "
                          "\"max_completion_tokens\"")
    state = {"requests": []}
    value, calls, _ = asyncio.run(scenario(max_tokens_field="max_completion_tokens"))
    assert value == {"answer": 7}
    assert [{k: v for k, v in r.items() if k.startswith("max_")} for r in state["requests"]] == [
        {"max_completion_tokens": 900}]
    assert calls.select("status", "tokens_out", "tokens_reasoning").rows() == [("ok", 40, 30)]
    # The embedded llama.cpp server knows only max_tokens: it would ignore the other and not bound the reply.
    with pytest.raises(ValueError, match="llm.max_tokens_field = 'max_completion_tokens' is for OpenAI-compatible "
                                         "endpoints that take it; the embedded llama.cpp server"):
        LLMConfig(backend="local", max_tokens_field="max_completion_tokens")


def test_a_window_that_the_reserved_output_fills_is_refused_when_configured():
    # It was accepted, and every call then failed on "a prompt budget of -2085 characters".
    with pytest.raises(ValueError, match="llm.context_window = 1024 leaves no room for a prompt after "
                                         "llm.max_output_tokens = 1500: raise the window"):
        LLMConfig(context_window=1024)
    assert prompt_budget(LLMConfig(context_window=1024, max_output_tokens=1000), 2.0) == 48


def test_a_refused_temperature_names_the_setting_to_change():
    from dxr.errors import ConfigError

    # OpenAI's reasoning models take only temperature 1; the default is 0. The refusal read "check llm.model,
    # llm.response_format and llm.base_url", none of which is the one to change.
    async def reasoning_model(request: web.Request) -> web.Response:
        body = await request.json()
        temperatures.append(body["temperature"])
        if body["temperature"] != 1:
            return web.json_response({"error": {
                "message": f"Unsupported value: 'temperature' does not support {body['temperature']:g} with this "
                           "model. Only the default (1) value is supported.", "type": "invalid_request_error",
                "param": "temperature", "code": "unsupported_value"}}, status=400)
        return web.json_response({"choices": [{"message": {"content": '{"answer": 7}'}, "finish_reason": "stop"}]})

    async def scenario(**overrides):
        async with serving(reasoning_model) as url:
            client = http_client(url, max_tokens_field="max_completion_tokens", **overrides)
            return *await outcome(client, ConfigError), url

    temperatures: list[float] = []
    error, _, url = asyncio.run(scenario())
    assert str(error) == (f"HTTP 400 from {url}/chat/completions: Unsupported value: 'temperature' does not support "
                          "0 with this model. Only the default (1) value is supported.; the model refuses the "
                          "temperature sent (llm.temperature, default 0; OpenAI's reasoning models take only 1): set "
                          "llm.temperature to one it takes, e.g. DXR_LLM__TEMPERATURE=1")
    value, _, _ = asyncio.run(scenario(temperature=1))
    assert (value, temperatures) == ({"answer": 7}, [0.0, 1.0])
