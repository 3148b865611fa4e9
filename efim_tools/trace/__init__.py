"""Typing traces: synthesis from real source and replay through a real `efim serve` subprocess with a comparison report.
The file format (`efim_lsp.trace_format`) and the recorder (`efim_lsp.recording`)
live with the server, which writes traces when `efim serve --record DIR` asks it to.

    document.py  the client's copy of a document (LSP positions, incremental edits)
    blocks.py    function bodies / blocks worth retyping
    typist.py    a person typing a block back (delays, bursts, typos, jumps)
    keys.py      what each key press inserts (a character; Enter with the auto-indent)
    synth.py     sessions → traces
    edits.py     small edits at one spot (retype a line's tail, new line, paste, undo)
    tour.py      navigation tours: jumps between functions and files → traces, one per client style
    jumps.py     which requests are the first after a jump, and the pause before them
    client.py    a small asyncio JSON-RPC/LSP client over a subprocess's stdio
    person.py    one simulated person replaying a trace (timing, cancelling, accepting)
    replay.py    configurations on fresh servers, users in parallel, readiness, stats
    probe.py     per-request server numbers from efim/stats segments (serial replays)
    report.py    percentiles, the comparison table, JSON and plot
    navigation.py  the navigation comparison: TTFT after jumps, prefill per jump, warm-up
    clients.py   the client comparison: the first answer after a jump per client style and jump pattern
"""
