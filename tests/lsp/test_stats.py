"""efim/stats: nearest-rank percentiles and the camelCase payload."""

from engine.api import EngineStats, RequestStats

from efim_lsp.stats import LatencySeries, ServerStats


def test_percentiles_are_nearest_rank():
    series = LatencySeries()
    assert series.summary() == {"p50": 0.0, "p95": 0.0, "p99": 0.0, "mean": 0.0}
    for ms in range(1, 101):
        series.add(float(ms))
    assert series.summary() == {"p50": 50.0, "p95": 95.0, "p99": 99.0, "mean": 50.5}


def test_wire_payload_and_reset():
    stats = ServerStats()
    stats.requests = 3
    stats.add_engine_request(RequestStats(prompt_tokens=100, reused_tokens=96, prefilled_tokens=4))
    stats.ttft.add(12.0)
    wire = stats.to_wire(EngineStats(cache_bytes_used=4096, working_kv_bytes=512), sessions_active=2, rebases=1)
    assert wire["reuseRatio"] == 0.96 and wire["promptTokens"] == 100 and wire["prefilledTokens"] == 4
    assert wire["cacheBytes"] == 4096 and wire["sessions"] == {"active": 2, "rebases": 1}
    assert wire["workingKvBytes"] == 512
    assert wire["ttftMs"]["p50"] == 12.0 and wire["requests"] == 3
    stats.reset()
    assert stats.to_wire(None, 0, 0)["promptTokens"] == 0 and len(stats.ttft) == 0
