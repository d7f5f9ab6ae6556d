"""Benchmark: the LLM client's own overhead, and the embedded backend on Direct Forecast.

Client overhead (no model) per call: the replay backend without cache (hashing, schema
validation, telemetry), a cache miss that writes the cache file, a cache hit, and a round trip
over real HTTP to an OpenAI-compatible emulator on 127.0.0.1 that answers at once.

Embedded backend (`--embedded-data-dir`, a warehouse holding the demo's `default` cohort, e.g.
`data/` after `dxr demo`): server start-up time, generation tokens/s on a short fixed prompt, and
Direct Forecast on the first `--embedded-patients` held_out trajectories with the response cache
off (every call reaches the model): wall time including start-up, patients/hour, tokens per
patient, the server's peak resident memory, ranking statuses. Prints tables; writes JSON to benchmarks/results/llm.json.

    python benchmarks/llm.py [--calls 500] [--embedded-data-dir data --embedded-patients 8 [--embedded-threads N]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"

from benchmarks.provenance import write_result  # noqa: E402
from models.llm.backends import (Completion, OpenAIBackend, ReplayBackend, append_recording,  # noqa: E402
                                 make_backend)
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
    await asyncio.gather(*(client.complete_json(m, PROMPT.schema, PROMPT.version,
                                                CallContext("bench", "direct", str(i)))
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


async def generation_speed(config: LLMConfig, data_dir: Path, repeats: int = 3) -> dict:
    """Server start-up seconds and output tokens/s on a short prompt (generation dominates its time)."""
    backend = make_backend(config, data_dir)
    started = time.perf_counter()
    await asyncio.to_thread(backend.server.start)
    startup_s = time.perf_counter() - started
    request = {"model": config.model, "temperature": 0, "max_tokens": 256,
               "messages": [{"role": "user", "content": "Write a short paragraph about the heart."}]}
    tokens, seconds = 0, 0.0
    try:
        for _ in range(repeats):
            sent = time.perf_counter()
            completion = await backend.complete(request)
            seconds += time.perf_counter() - sent
            tokens += completion.tokens_out
    finally:
        await backend.close()
    return {"server_startup_s": round(startup_s, 2), "generation_tokens": tokens,
            "generation_tokens_per_s": round(tokens / seconds, 1)}


def server_peak_rss_mib(pid: int) -> int:
    """Peak resident memory of the llama.cpp server process so far (Linux `VmHWM`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def embedded_direct(data_dir: Path, patients: int, threads: int = 0) -> dict:
    """Direct Forecast with the embedded backend on the first `patients` held_out trajectories, cache off;
    `threads` as `llm.local_threads` (0 = the default)."""
    from tasks.direct import forecast_direct
    from tasks.forecast import shard_inputs
    from warehouse.cohorts import code_titles, get_cohort
    from warehouse.schemas import NON_RUN_TABLES
    from warehouse.store import Warehouse
    from warehouse.vocab import Vocabulary

    wh = Warehouse(data_dir)
    cohort_id = get_cohort(wh, "default")["cohort_id"]
    trajectories, pretarget = shard_inputs(wh, cohort_id, 0, "held_out", limit=patients)
    config = LLMConfig(backend="local", cache=False, local_threads=threads)
    speed = asyncio.run(generation_speed(config, data_dir))
    client = LLMClient.from_config(config, data_dir)
    vocabulary = Vocabulary.from_warehouse(wh.connect(tables=NON_RUN_TABLES), cohort_id)

    async def run():
        try:
            result = await forecast_direct(client, trajectories, pretarget, vocabulary, "bench", cohort_id, 20,
                                           code_titles(wh, cohort_id))
            return result, server_peak_rss_mib(client.backend.server.process.pid)
        finally:
            await client.close()

    started = time.perf_counter()
    (ranked, status), peak_rss = asyncio.run(run())
    wall = time.perf_counter() - started
    calls = client.telemetry()
    n = trajectories.height
    return {**speed, "threads": client.backend.server.threads,
            "batch_threads": client.backend.server.batch_threads, "context_window": config.context_window,
            "patients": n, "wall_s_incl_startup": round(wall, 1), "patients_per_hour": round(n * 3600 / wall, 1),
            "calls_per_patient": round(calls.height / n, 2),
            "tokens_in_per_patient": round(calls["tokens_in"].sum() / n, 1),
            "tokens_out_per_patient": round(calls["tokens_out"].sum() / n, 1),
            "direct_output_tokens_per_s": round(calls["tokens_out"].sum() / (calls["latency_ms"].sum() / 1000), 1),
            "server_peak_rss_mib": peak_rss,
            "status": dict(status.group_by("status").len().sort("status").iter_rows()),
            "valid_codes_per_patient": round(ranked.height / n, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--embedded-data-dir", type=Path, default=None,
                        help="warehouse with the demo's default cohort; runs the embedded backend part")
    parser.add_argument("--embedded-patients", type=int, default=8)
    parser.add_argument("--embedded-threads", type=int, default=0,
                        help="generation threads of the embedded server (llm.local_threads; 0 = the default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        timings = asyncio.run(replay_rows(args.calls, Path(workdir))) + asyncio.run(http_rows(args.calls))
    rows = [{"path": label, "calls": args.calls, "ms_per_call": round(1000 * seconds / args.calls, 3),
             "calls_per_s": round(args.calls / seconds, 1)} for label, seconds in timings]
    print(f"{'path':40} {'calls':>6} {'ms/call':>9} {'calls/s':>9}")
    for row in rows:
        print(f"{row['path']:40} {row['calls']:>6} {row['ms_per_call']:>9} {row['calls_per_s']:>9}")
    result = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_average_at_start": os.getloadavg()[0], "rows": rows}
    if args.embedded_data_dir is not None:
        embedded = embedded_direct(args.embedded_data_dir.resolve(), args.embedded_patients, args.embedded_threads)
        result["embedded"] = embedded
        print("\nembedded backend (llama.cpp server, packaged Gemma 3 270M GGUF)")
        for key, value in embedded.items():
            print(f"  {key:32} {value}")
    write_result(RESULTS / "llm.json", result)


if __name__ == "__main__":
    main()
