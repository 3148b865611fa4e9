"""The per-user engine daemon: one model, one radix cache and one KV budget for every
editor window (`efim serve --daemon`; docs/daemon.md).

`wire` (length-prefixed msgpack frames of `engine.api` structs), `config` (what a daemon
hosts, and the digest that names its socket), `place` (the 0700 runtime directory, socket
ownership and peer checks), `launcher` (connect, or start one under the spawn lock),
`server` (the daemon: a `LocalEngine` served to many fronts; `python -m engine.daemon`),
`client` (`DaemonEngine`: the Engine protocol over the socket, what a front runs).

Importing this package (and `client`) loads no torch: a front stays small.
"""

from engine.daemon.client import DaemonEngine, check_daemon_model, open_daemon_engine
from engine.daemon.place import supported

__all__ = ["DaemonEngine", "open_daemon_engine", "check_daemon_model", "supported"]
