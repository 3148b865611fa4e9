"""What the server's log may quote of a client's bytes.

Documents travel inside messages, so a message the server rejects may carry someone's
code. Below DEBUG the log names what was wrong and how long the message was, never its
content; at DEBUG (`--log-level debug`, asked for by the user) it quotes the start of it.
"""

from __future__ import annotations

import logging
from typing import Any


def excerpt(log: logging.Logger, data: Any, limit: int = 120) -> str:
    """`data`'s repr cut to `limit` characters when `log` logs DEBUG, else only its size."""
    if log.isEnabledFor(logging.DEBUG):
        return repr(data)[:limit]
    size = len(data) if isinstance(data, (bytes, bytearray, str, list, dict)) else None
    kind = type(data).__name__
    return f"<{kind}{f' of {size}' if size is not None else ''}; quoted at --log-level debug>"
