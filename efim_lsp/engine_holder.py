"""The server's engine: loaded off the event loop, replaced when its settings change.

`initialize` must answer at once, so the model loads in a worker thread after
`initialized`; progress goes to a `ProgressSink` (the server maps it onto
`$/progress`). Until the engine is ready, completion declines ("model loading")
rather than erroring or waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Literal, NamedTuple, Protocol

from engine.api import Engine, EngineInfo, InfillRequest

log = logging.getLogger(__name__)

# factory(model, *, fim_tokens, adapter, kv_disk, kv_disk_budget) -> Engine, and with a remote
# backend also (backend, endpoint, remote_model, api_key_env) as keywords. The serve command
# wraps engine.local.load_engine and engine.remote.open_remote_engine; tests inject their own.
EngineFactory = Callable[..., Engine]
# preflight(model, **factory options): a new local model's checks that read no weights
# (`engine.local.check_model`); it raises when the model cannot load.
Preflight = Callable[..., None]

LoadState = Literal["empty", "loading", "ready", "failed"]


class EngineSpec(NamedTuple):
    model: str
    fim_tokens: str
    adapter: str = "auto"
    kv_disk: bool = True
    kv_disk_budget: str = "2G"
    backend: str = "local"  # "local" | "llama.cpp" | "openai"
    endpoint: str = ""
    remote_model: str = ""
    api_key_env: str = ""

    @classmethod
    def from_settings(cls, s) -> "EngineSpec":
        """The engine keys of `efim_lsp.settings.Settings` (`ENGINE_KEYS`)."""
        return cls(s.model, s.fim_tokens, s.adapter, s.kv_disk, s.kv_disk_budget, s.backend, s.endpoint,
                   s.remote_model, s.api_key_env)

    @property
    def remote(self) -> bool:
        return self.backend != "local"

    def factory_options(self) -> dict:
        """Keywords for the engine factory (the remote ones only for a remote backend, so a
        factory that knows only the local engine keeps working)."""
        options = dict(fim_tokens=self.fim_tokens, adapter=self.adapter, kv_disk=self.kv_disk,
                       kv_disk_budget=self.kv_disk_budget)
        if self.remote:
            options.update(backend=self.backend, endpoint=self.endpoint, remote_model=self.remote_model,
                           api_key_env=self.api_key_env)
        return options

    def describe(self) -> str:
        return f"{self.model} via {self.backend} at {self.endpoint or '(no endpoint)'}" if self.remote else self.model


class ProgressSink(Protocol):
    def begin(self, title: str, message: str) -> None: ...

    def report(self, message: str, percentage: int) -> None: ...

    def end(self, message: str) -> None: ...


class _NoProgress:
    def begin(self, title: str, message: str) -> None:
        pass

    def report(self, message: str, percentage: int) -> None:
        pass

    def end(self, message: str) -> None:
        pass


class EngineHolder:
    """Holds the server's one engine: loads it, swaps it when its settings change (keeping
    the serving one where the new one cannot start), and reports its state and health."""

    def __init__(self, factory: EngineFactory, preflight: Preflight | None = None):
        """`preflight(model, **factory options)`: the new local model's checks that read no
        weights (`engine.local.check_model`); when it raises, the serving engine is kept."""
        self._factory = factory
        self._preflight = preflight
        self.state: LoadState = "empty"
        self.error: str | None = None
        self._engine: Engine | None = None
        self.info: EngineInfo | None = None
        self.spec: EngineSpec | None = None
        self.load_seconds: float | None = None
        self._generation = 0
        self._ready = asyncio.Event() if _has_loop() else None
        # (kind, message), called from the engine's thread when the engine reports a fault
        # (a crashed engine thread, out of memory: `engine.local.LocalEngine.on_fault`).
        self.on_engine_fault: Callable[[str, str], None] | None = None
        # Called with the new engine (None: there is none) each time `engine` changes, so
        # what depends on the engine (the context source) is told instead of asking.
        self.on_engine_changed: Callable[[Engine | None], None] | None = None

    @property
    def engine(self) -> Engine | None:
        """The engine that serves now (None while none is loaded)."""
        return self._engine

    def _set_engine(self, engine: Engine | None) -> None:
        if engine is self._engine:
            return
        self._engine = engine
        if self.on_engine_changed is not None:
            self.on_engine_changed(engine)

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.engine is not None

    async def wait_ready(self, timeout: float | None = None) -> bool:
        if self._ready is None:
            self._ready = asyncio.Event()
            if self.ready:
                self._ready.set()
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return self.ready

    async def load(self, spec: EngineSpec, progress: ProgressSink | None = None) -> bool:
        """Load (or replace) the engine. Returns True when this load became the engine.

        A load superseded by a newer one while it ran closes its engine and returns False.
        A local model is loaded after the old engine is closed (two models need not fit in
        memory at once), once `preflight` found nothing wrong with its files: a model that
        fails those checks leaves the old engine serving, with `error` saying why and the
        state "ready" (a failure later in the load, e.g. out of memory, ends "failed"). A
        remote engine, and any engine while the serving one keeps its model in another
        process (the engine daemon's: `model_in_this_process = False`), is built first and
        the old one serves meanwhile, and is kept, serving, when the new one cannot be built
        (a bad endpoint, an unset `apiKeyEnv`, a daemon that does not start): `error` says
        why and the state stays "ready".
        """
        progress = progress or _NoProgress()
        self._generation += 1
        generation = self._generation
        if self._ready is None:
            self._ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        if not spec.remote and self.ready and self._preflight is not None:
            # A local model closes the serving engine before loading (memory); first make sure
            # the new one can load at all, so a bad file leaves the old model serving.
            try:
                await loop.run_in_executor(None, lambda: self._preflight(spec.model, **spec.factory_options()))
            except Exception as exc:
                if generation == self._generation:
                    error = f"{type(exc).__name__}: {exc}"
                    kept = self.spec.describe() if self.spec else "?"
                    self.error = f"{error} (kept the previous model: {kept})"
                    log.error("model %s failed its checks: %s; keeping %s", spec.describe(), error, kept)
                return False
            if generation != self._generation:
                return False
        # A remote engine, or one whose model lives in the engine daemon, keeps serving until
        # the next answers: closing it first would free no memory here.
        keep_old = self.ready and (spec.remote or not self.engine.model_in_this_process)
        previous = (self.engine, self.info, self.spec)
        if not keep_old:
            self._ready.clear()
            old, self.info = self.engine, None
            self.state, self.error, self.spec = "loading", None, spec
            self._set_engine(None)
            if old is not None:
                await loop.run_in_executor(None, _close_quietly, old)
        progress.begin("efim", f"loading model {spec.describe()}")
        started = time.monotonic()
        try:
            engine = await loop.run_in_executor(None, lambda: self._factory(spec.model, **spec.factory_options()))
            info = engine.info()
            engine.on_fault = self._engine_fault
        except Exception as exc:
            if generation == self._generation:
                error = f"{type(exc).__name__}: {exc}"
                if keep_old and self.engine is previous[0] and self.engine is not None:
                    self.error = f"{error} (kept the previous engine: {previous[2].describe() if previous[2] else '?'})"
                    log.error("engine %s failed to start: %s; keeping the previous one", spec.describe(), error)
                else:
                    self.state, self.error = "failed", error
                    log.error("model %s failed to load: %s", spec.describe(), self.error)
                progress.end(f"model failed to load: {error}")
            return False
        if generation != self._generation:
            await loop.run_in_executor(None, _close_quietly, engine)
            return False
        progress.report(f"first request on {info.architecture} ({info.template})", 80)
        await self._first_request(engine, info)
        if generation != self._generation:
            await loop.run_in_executor(None, _close_quietly, engine)
            return False
        old = self.engine if keep_old else None
        self.info, self.state, self.error, self.spec = info, "ready", None, spec
        self._set_engine(engine)
        self.load_seconds = time.monotonic() - started
        self._ready.set()
        if old is not None and old is not engine:
            await loop.run_in_executor(None, _close_quietly, old)
        log.info(
            "model ready in %.1f s: %s (%s, template %s, context %d)",
            self.load_seconds, info.model, info.architecture, info.template, info.context_length,
        )
        progress.end(f"ready: {info.architecture}, {info.template}")
        return True

    async def _first_request(self, engine: Engine, info: EngineInfo) -> None:
        """One tiny request, so the first keystroke does not pay for lazy initialisation
        (not a warm-up: it prefills no window anyone will ask for)."""
        handle = None
        try:
            request = InfillRequest(
                key="efim-lsp/first-request", prefix="def f(", suffix="\n", max_tokens=1, cache=False,
                format="efim" if info.supports_fim else "prefix",
            )
            handle = engine.submit(request)
            await asyncio.wait_for(handle.wait(), timeout=120)
        except Exception as exc:  # a failed first request is not a failed load
            log.warning("first request failed: %s", exc)
            if handle is not None:
                handle.cancel()

    def _engine_fault(self, kind: str, message: str) -> None:
        callback = self.on_engine_fault
        if callback is not None:
            callback(kind, message)

    def health(self) -> dict:
        """`efim/stats` "engine": the engine's state (`LocalEngine.health`: its thread;
        `RemoteEngine.health`: the backend's connection, endpoint, last error, server-reported
        reuse and TTFT), or `{"state": "none"}` while no engine is loaded."""
        engine = self.engine
        return engine.health() if engine is not None else {"state": "none"}

    def close(self) -> None:
        self._generation += 1
        engine, self.info = self.engine, None
        self.state = "empty"
        self._set_engine(None)
        if engine is not None:
            _close_quietly(engine)


def _close_quietly(engine: Engine) -> None:
    try:
        engine.close()
    except Exception as exc:
        log.warning("closing the engine failed: %s", exc)


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
