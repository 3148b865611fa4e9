"""What an engine daemon hosts: the model and engine settings, and their digest (the socket's name).

Every setting that changes the model or the engine's shape is in `DaemonConfig` and so in
its digest: fronts asking for another model, weight format, adapter, KV format, thread
count or disk tier reach (or start) another daemon. So is the front's *engine environment*
(`engine_environment`: the variables the engine process reads — the KV and cache
directories, kernel switches, the fault hook, OpenMP/oneDNN/malloc tuning): the daemon runs
with exactly those, so a front started with other values gets a daemon that has them
instead of one that silently does not. The KV budget is not in the digest: it is the
largest any front asked for (the daemon's pool grows when a front asks for more).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from engine.daemon.wire import PROTOCOL_VERSION


# The variables of a front's environment that change what a daemon's engine does.
ENGINE_ENV_NAMES = frozenset({
    "EFIM_KV_DIR", "EFIM_CACHE_DIR",  # where KV files and built kernels live (engine.kv.disk_format, engine.paths)
    "EFIM_KERNELS", "EFIM_C_KERNELS", "EFIM_KERNEL_CHECKS",  # kernel switches (kernels/)
    "EFIM_PIN_THREADS",  # the engine's threads pinned one per CPU, or not (engine.runtime.cpu_threads)
    "EFIM_FAULT",  # the fault-injection test hook (engine.runtime.faults)
    "EFIM_DAEMON_STANDBY", "EFIM_DAEMON_FORKED_STANDBY",  # the daemon's standby (engine.daemon.standby)
    "LRU_CACHE_CAPACITY",  # ATen's oneDNN operation cache (engine.runtime.native_caches)
})
ENGINE_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "ONEDNN_", "DNNL_", "MALLOC_", "TORCH_", "TRITON_")


def is_engine_variable(name: str) -> bool:
    return name in ENGINE_ENV_NAMES or name.startswith(ENGINE_ENV_PREFIXES)


def engine_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The engine variables of `environ` (default: this process's), sorted by name."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in sorted(environ) if is_engine_variable(name)}


class DaemonConfig(msgspec.Struct, frozen=True, kw_only=True):
    """`engine.local.load_engine`'s arguments, as the daemon is started with them."""

    model: str = "default"
    dtype: str | None = None
    quant: str | None = None
    kv_dtype: str | None = None
    threads: int | None = None
    fim_tokens: str = "auto"
    adapter: str | None = "auto"
    kv_disk: bool = True
    kv_disk_budget: str = "2G"
    # Other `LocalEngine` keywords (tests: check_integrity, step_tokens, ...).
    engine_options: dict[str, Any] = {}
    # The engine variables of the front's environment (`engine_environment`); the daemon runs with these.
    environment: dict[str, str] = {}

    @classmethod
    def of(cls, model: str, *, environment: Mapping[str, str] | None = None, **settings: Any) -> DaemonConfig:
        """The config for `load_engine(model, **settings)` in `environment` (default: this
        process's engine variables): a model or adapter given as a path is made absolute
        (fronts started in other directories name the same files), and keywords that are
        not fields go to `engine_options`."""
        fields = set(cls.__struct_fields__) - {"engine_options", "environment"}
        known = {k: v for k, v in settings.items() if k in fields}
        extra = {k: v for k, v in settings.items() if k not in fields and k != "kv_budget"}
        if "adapter" in known:
            known["adapter"] = _absolute(known["adapter"]) if known["adapter"] is not None else None
        if "kv_disk" in known and not isinstance(known["kv_disk"], bool):
            known["kv_disk"] = bool(known["kv_disk"])
        env = engine_environment(os.environ if environment is None else environment)
        return cls(model=_absolute(str(model)), engine_options=extra, environment=env, **known)

    def digest(self) -> str:
        """16 hex digits naming this configuration (and the protocol version)."""
        blob = msgspec.json.encode([PROTOCOL_VERSION, self])
        return hashlib.sha256(blob).hexdigest()[:16]

    def load_arguments(self) -> dict[str, Any]:
        """Keywords for `engine.local.load_engine` (without `model` and `kv_budget`)."""
        args: dict[str, Any] = dict(fim_tokens=self.fim_tokens, adapter=self.adapter, kv_disk=self.kv_disk,
                                    kv_disk_budget=self.kv_disk_budget)
        for name in ("dtype", "quant", "kv_dtype", "threads"):
            value = getattr(self, name)
            if value is not None:
                args[name] = value
        args.update(self.engine_options)
        return args


def _absolute(value: str | Path) -> str:
    text = str(value)
    if text in ("default", "auto", "none", ""):
        return text
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() else text


__all__ = ["DaemonConfig", "engine_environment", "is_engine_variable"]
