"""Benchmark: overhead of the LLM client itself (no model): replay backend, response cache, local HTTP.

Measures per call: the replay backend without cache (hashing, schema validation, telemetry),
a cache miss that writes the cache file, a cache hit, and a round trip over real HTTP to an
OpenAI-compatible emulator on 127.0.0.1 that answers at once. Prints a table; writes JSON to
benchmarks/results/llm.json.

    python benchmarks/llm.py [--calls 500]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from models.llm.backends import Completion, OpenAIBackend, ReplayBackend, append_recording  # noqa: E402
from models.llm.cache import ResponseCache  # noqa: E402
from models.llm.client import CallContext, LLMClient  # noqa: E402
from models.llm.config import LLMConfig  # noqa: E402
from models.llm.prompts import load_prompt  # noqa: E402

PROMPT = load_prompt("direct_forecast")
REPLY = json.dumps({"predictions": [{"code": f"I50.{i:02d}", "confidence": 95 - i} for i in range(25)]})


def questions(n: int) -> list[list[dict]]:
    # A Direct-Forecast-sized payload (~6,000 characters of history) that differs per call.
    history = "Encounter: heart failure, diabetes, kidney disease; labs and notes. " * 90
    return [[{"role": "system", "content": PROMPT.system}, {"role": "user", "content": f"patient {i}\n{history}"}]
            for i in range(n)]


async def time_calls(client: LLMClient, batch: list[list[dict]]) -> float:
    """Seconds for all calls of `batch`, issued concurrently as a stage would."""
    started = time.perf_counter()
    await asyncio.gather(*(client.complete_json(m, PROMPT.schema, PROMPT.version, CallContext("bench", "direct", str(i)))
                           for i, m in enumerate(batch)))
    return time.perf_counter() - started


async def replay_rows(n: int, workdir: Path) -> list[dict]:
    config = LLMConfig(backend="replay", replay_file=workdir / "replay.jsonl", model="bench")
    batch = questions(n)
    probe = LLMClient(config, backend=None)
    for messages in batch:
        append_recording(config.replay_file, probe.request(messages, PROMPT.schema), Completion(REPLY, 1500, 0, 400))
    plain = LLMClient(config, ReplayBackend(config.replay_file))
    cached = LLMClient(config, ReplayBackend(config.replay_file), ResponseCache(workdir / "cache"))
    return [("replay, no cache", await time_calls(plain, batch)),
            ("replay, cache miss (writes file)", await time_calls(cached, batch)),
            ("cache hit", await time_calls(cached, batch))]


async def http_rows(n: int) -> list[tuple[str, float]]:
    async def chat(request: web.Request) -> web.Response:
        await request.json()
        return web.json_response({"choices": [{"message": {"content": REPLY}}],
                                  "usage": {"prompt_tokens": 1500, "completion_tokens": 400}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    config = LLMConfig(backend="openai", base_url=f"http://127.0.0.1:{port}/v1", model="bench", cache=False)
    client = LLMClient(config, OpenAIBackend(config.base_url, config.timeout_s))
    try:
        return [("openai backend, local HTTP emulator", await time_calls(client, questions(n)))]
    finally:
        await client.close()
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        timings = asyncio.run(replay_rows(args.calls, Path(workdir))) + asyncio.run(http_rows(args.calls))
    rows = [{"path": label, "calls": args.calls, "ms_per_call": round(1000 * seconds / args.calls, 3),
             "calls_per_s": round(args.calls / seconds, 1)} for label, seconds in timings]
    print(f"{'path':40} {'calls':>6} {'ms/call':>9} {'calls/s':>9}")
    for row in rows:
        print(f"{row['path']:40} {row['calls']:>6} {row['ms_per_call']:>9} {row['calls_per_s']:>9}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "llm.json").write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                                                  "rows": rows}, indent=2))
    print(f"wrote {RESULTS / 'llm.json'}")


if __name__ == "__main__":
    main()
