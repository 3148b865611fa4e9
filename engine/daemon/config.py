"""What an engine daemon hosts: the model and engine settings, and their digest (the socket's name).

Every setting that changes the model or the engine's shape is in `DaemonConfig` and so in
its digest: fronts asking for another model, weight format, adapter, KV format, thread
count or disk tier reach (or start) another daemon. The KV budget is not: it is the
first front's (the radix pool is preallocated when the engine starts and cannot grow),
and a later front asking for more is told so in its log.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec

from engine.daemon.wire import PROTOCOL_VERSION


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

    @classmethod
    def of(cls, model: str, **settings: Any) -> DaemonConfig:
        """The config for `load_engine(model, **settings)`: a model or adapter given as a
        path is made absolute (fronts started in other directories name the same files),
        and keywords that are not fields go to `engine_options`."""
        fields = set(cls.__struct_fields__) - {"engine_options"}
        known = {k: v for k, v in settings.items() if k in fields}
        extra = {k: v for k, v in settings.items() if k not in fields and k != "kv_budget"}
        if "adapter" in known:
            known["adapter"] = _absolute(known["adapter"]) if known["adapter"] is not None else None
        if "kv_disk" in known and not isinstance(known["kv_disk"], bool):
            known["kv_disk"] = bool(known["kv_disk"])
        return cls(model=_absolute(str(model)), engine_options=extra, **known)

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


__all__ = ["DaemonConfig"]
