"""Typing traces: the file format, synthesis from real source, recording from a live
server, and replay through a real `efim serve` subprocess with a comparison report.

    format.py    header + events, JSON Lines via msgspec, versioned
    document.py  the client's copy of a document (LSP positions, incremental edits)
    blocks.py    function bodies / blocks worth retyping
    typist.py    a person typing a block back (delays, bursts, typos, jumps)
    synth.py     sessions → traces
    record.py    `efim serve --record DIR`
    client.py    a small asyncio JSON-RPC/LSP client over a subprocess's stdio
    person.py    one simulated person replaying a trace (timing, cancelling, accepting)
    replay.py    configurations on fresh servers, users in parallel, readiness, stats
    report.py    percentiles, the comparison table, JSON and plot
"""
