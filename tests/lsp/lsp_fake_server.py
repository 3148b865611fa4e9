"""`efim serve`'s real server code over stdio with the in-test FakeEngine (server-logic tests only).

Environment: EFIM_FAKE_TEXT (what every request generates, default "value = compute(x)\\n"),
EFIM_FAKE_TOKEN_MS (delay per 4-character token), EFIM_FAKE_LOAD_MS (model load time),
EFIM_FAKE_FAULT=post (building the answer raises for documents whose URI contains "fault").
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lsp_fakes import FakeEngine  # noqa: E402

from efim_lsp.server import build_server  # noqa: E402


def main() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    text = os.environ.get("EFIM_FAKE_TEXT", "value = compute(x)\n")
    token_s = float(os.environ.get("EFIM_FAKE_TOKEN_MS", "0")) / 1000
    load_s = float(os.environ.get("EFIM_FAKE_LOAD_MS", "0")) / 1000
    loads = []

    def factory(model: str, *, fim_tokens: str = "auto", adapter: str = "auto", **_engine_options) -> FakeEngine:
        time.sleep(load_s)
        if model.startswith("/missing"):
            raise FileNotFoundError(f"no model at {model}")
        if adapter.startswith("/missing"):
            raise FileNotFoundError(f"no adapter at {adapter}")
        loads.append(model)
        return FakeEngine(lambda req: text, token_delay=token_s)

    server = build_server(factory)
    if os.environ.get("EFIM_FAKE_FAULT") == "post":
        lsp_range = server.lsp_range

        def broken(uri, answer):
            if "fault" in uri:
                raise ZeroDivisionError("injected fault in post-processing")
            return lsp_range(uri, answer)

        server.lsp_range = broken
    sys.exit(server.start_io())


if __name__ == "__main__":
    main()
