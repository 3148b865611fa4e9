"""Typing traces: synthesis from real source and replay through a real `efim serve` subprocess with a comparison report.
The file format (`efim_lsp.trace_format`) and the recorder (`efim_lsp.recording`)
live with the server, which writes traces when `efim serve --record DIR` asks it to.

    document.py  the client's copy of a document (LSP positions, incremental edits)
    blocks.py    function bodies / blocks worth retyping
    typist.py    a person typing a block back (delays, bursts, typos, jumps)
    synth.py     sessions → traces
    client.py    a small asyncio JSON-RPC/LSP client over a subprocess's stdio
    person.py    one simulated person replaying a trace (timing, cancelling, accepting)
    replay.py    configurations on fresh servers, users in parallel, readiness, stats
    report.py    percentiles, the comparison table, JSON and plot
"""
