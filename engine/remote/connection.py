"""The link to a remote inference server: its address, credentials, state and reconnection.

`Endpoint` parses and checks the base URL once (http/https only; credentials in the URL are
refused, the key comes from an environment variable and is sent as `Authorization: Bearer`;
`display` is what logs and `efim/stats` show — scheme, host, port, path, never a secret).

`Link` is the backend's state machine, owned by the remote engine's loop thread:

    connecting ──ok──▶ connected ──connect refused / dropped mid-stream──▶ unreachable
        │                  ▲  │                                               │
        │                  │  └──4xx/5xx, garbage, no answer in time──▶ error  │
        └──────────────────┴───────────── a probe or a request succeeds ◀─────┘

- While `unreachable`, requests fail at once (no keystroke waits on a connect timeout); a
  probe runs with exponential backoff (`BACKOFF_FIRST_S` doubling to `BACKOFF_MAX_S`) until
  the server answers, then the state is `connected` again.
- `error` does not stop requests: the server is there, the next request may succeed.
- Faults are told once per outage: `Link.fault(kind, ...)` reports a kind at most once
  between two `connected` states, under the name `backend-<kind>-<outage number>` so that a
  listener that shows each kind once (the server) shows the next outage too; answer-level
  kinds (HTTP errors, garbage, timeouts) at most once a minute whatever happens between.

Never raises into callers; never logs the key.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import time
from typing import Callable, Literal, NamedTuple
from urllib.parse import urlsplit

from engine.api import EngineError

log = logging.getLogger(__name__)

BackendState = Literal["connecting", "connected", "unreachable", "error", "closed"]

BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 5.0
REPEAT_AFTER_S = 60.0


class Endpoint(NamedTuple):
    base: str  # the URL without a trailing slash
    display: str  # scheme://host:port/path, nothing else (no user info, no query)
    host: str
    secure: bool
    loopback: bool


def parse_endpoint(url: str) -> Endpoint:
    """Check a base URL; EngineError saying what is wrong (never echoing credentials)."""
    if not isinstance(url, str) or not url.strip():
        raise EngineError("the remote backend needs an `endpoint` (a base URL such as http://127.0.0.1:8080)")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise EngineError(f"endpoint must start with http:// or https://, not {parts.scheme or 'nothing'}://")
    if not parts.hostname:
        raise EngineError("endpoint has no host name")
    if parts.username or parts.password:
        raise EngineError("endpoint must not hold credentials; name an environment variable in `apiKeyEnv` instead")
    if parts.query or parts.fragment:
        raise EngineError("endpoint must be a base URL without a query or fragment")
    try:
        port = parts.port
    except ValueError:
        raise EngineError("endpoint has an invalid port") from None
    host = parts.hostname
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    path = parts.path.rstrip("/")
    display = f"{parts.scheme}://{netloc}{path}"
    return Endpoint(display, display, host, parts.scheme == "https", _is_loopback(host))


def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key_from_env(name: str | None) -> str | None:
    """The key held by environment variable `name` (None: no key). EngineError when the
    variable is named but unset or empty: a missing key should not look like a server's 401."""
    if not name:
        return None
    if not isinstance(name, str) or not name.replace("_", "").isalnum():
        raise EngineError(f"apiKeyEnv must be the name of an environment variable, not {name!r}")
    key = os.environ.get(name, "")
    if not key.strip():
        raise EngineError(f"apiKeyEnv names the environment variable {name}, which is not set in the server's environment")
    return key.strip()


class Link:
    """The backend's state and fault reports (see the module docstring). Loop thread only,
    except `snapshot`, which any thread may read."""

    def __init__(self, report: Callable[[str, str], None]) -> None:
        self._report = report
        self.state: BackendState = "connecting"
        self.last_error: str | None = None
        self.outages = 0  # times the backend went from usable to faulty
        self.reconnects = 0
        self._told: set[str] = set()  # kinds reported during this outage
        self._last_told: dict[str, float] = {}
        self._backoff = BACKOFF_FIRST_S
        self.next_probe_at = 0.0  # time.monotonic() of the next probe while unreachable

    @property
    def usable(self) -> bool:
        """Whether requests go to the server (all but `unreachable` and `closed`)."""
        return self.state in ("connecting", "connected", "error")

    def ok(self) -> None:
        """The server answered as it should."""
        if self.state in ("unreachable", "error"):
            log.info("the backend answers again (after: %s)", self.last_error)
            self.reconnects += 1
        self.state = "connected" if self.state != "closed" else "closed"
        self._told.clear()
        self._backoff = BACKOFF_FIRST_S

    def unreachable(self, why: str, message: str) -> None:
        """No connection (refused, reset, dropped mid-stream): requests stop until a probe succeeds."""
        self._enter("unreachable", why)
        self.next_probe_at = time.monotonic() + self._backoff
        self.fault("unreachable", message)

    def failed_probe(self, why: str) -> float:
        """A probe failed: the next one waits longer. Returns the wait in seconds."""
        self.last_error = why
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        wait = self._backoff * (0.75 + random.random() / 2)  # jitter: editors restarted together spread out
        self.next_probe_at = time.monotonic() + wait
        return wait

    def error(self, kind: str, why: str, message: str) -> None:
        """The server answered wrongly (`kind`: "http", "garbage", "timeout", "model"...)."""
        if self.state != "unreachable":
            self._enter("error", why)
        else:
            self.last_error = why
        self.fault(kind, message)

    def fault(self, kind: str, message: str) -> None:
        """Tell the listener about `kind`, once per outage; an answer-level fault (HTTP
        error, garbage, timeout) at most once per `REPEAT_AFTER_S` even when successes
        come between (a server that fails every other request must not flood the editor)."""
        now = time.monotonic()
        if kind in self._told or (kind != "unreachable" and now - self._last_told.get(kind, -REPEAT_AFTER_S) < REPEAT_AFTER_S):
            return
        self._told.add(kind)
        self._last_told[kind] = now
        log.warning("backend: %s", message)
        self._report(f"backend-{kind}-{self.outages}", message)

    def close(self) -> None:
        self.state = "closed"

    def _enter(self, state: BackendState, why: str) -> None:
        if self.state in ("connected", "connecting"):  # a new outage (error -> unreachable is the same one)
            self.outages += 1
            self._told.clear()
        self.state = state
        self.last_error = why

    def snapshot(self) -> dict:
        return {"state": self.state, "lastError": self.last_error, "outages": self.outages, "reconnects": self.reconnects}


__all__ = ["BackendState", "Endpoint", "Link", "api_key_from_env", "parse_endpoint", "BACKOFF_FIRST_S", "BACKOFF_MAX_S"]
