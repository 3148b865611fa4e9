"""The short soak (`bench/soak.py`) through the real `efim serve` on a tiny random model:
4 documents typed into at 10 keys/s each for 8 s, a request per key, the superseded one
cancelled, full-text changes and reopens now and then. Nothing may hang, every request is
answered (a result or -32800), the KV integrity check passes and the server is alive.
The numbers (and the RSS curve) are printed with `-s`; RSS is bounded loosely."""

from __future__ import annotations

import asyncio

from bench.soak import SoakOptions, run_soak, table
from stdio_client import serve_env


def test_short_soak_answers_everything_and_keeps_integrity(tiny_model_dir):
    options = SoakOptions(
        docs=4, rate=10, seconds=8, model=str(tiny_model_dir), warmup_s=3, hang_s=2.0, seed=1,
        # frequent enough that 80 keys per document see both kinds of event
        full_change_every=20, reopen_every=40,
        settings={"maxTokens": 8}, server_args=("--kv-budget", "64MB"), env=serve_env(), ready_timeout_s=180,
    )
    result = asyncio.run(run_soak(options))
    print("\n" + table(result))
    print("RSS curve (s, MB):", result.rss_mb)
    assert result.crashed is None, result.crashed
    assert result.sent >= 4 * 10 * 8 * 0.5, result.sent  # the typists kept (roughly) their pace
    assert result.full_changes > 0 and result.reopens > 0
    # How many requests are superseded while still running depends on the machine's speed
    # (a tiny model often answers within a key's 100 ms); each one cancelled is answered -32800.
    assert result.cancelled <= result.cancels_sent
    assert result.errors == {}
    assert result.unanswered == 0 and result.hangs == 0, (result.unanswered, result.hangs, result.max_wait_ms)
    assert result.answered + result.cancelled == result.sent
    assert result.integrity.get("ok") is True, result.integrity
    assert result.integrity.get("engine") == "ok", result.integrity
    assert result.alive and result.exit_code == 0
    # Loose: the server must not balloon while typing (tiny model, 64 MB KV budget).
    assert result.rss_end_mb < 1.5 * result.rss_after_warmup_mb + 100, result.rss_mb
    assert result.ok
