"""The opt-in recorder under faults: a trace that stops being writable is reported once
(`on_problem`, which the server turns into a window/showMessage) and never raises into the server."""

from __future__ import annotations

from efim_lsp.recording import Recorder


class _BrokenFile:
    def write(self, data):
        raise OSError(28, "No space left on device")

    def flush(self):
        raise OSError(28, "No space left on device")

    def close(self):
        pass


def test_a_write_failure_mid_session_is_reported_once_and_recording_stops(tmp_path):
    recorder = Recorder(tmp_path / "traces")
    problems: list[str] = []
    recorder.on_problem = problems.append
    recorder("in", {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"capabilities": {}}}, 0.0)
    recorder("out", {"jsonrpc": "2.0", "id": 1, "result": {"capabilities": {}}}, 0.01)
    assert recorder.path is not None and problems == []
    open_doc = {"jsonrpc": "2.0", "method": "textDocument/didOpen",
                "params": {"textDocument": {"uri": "file:///a.py", "languageId": "python", "version": 0, "text": "x"}}}
    recorder("in", open_doc, 0.02)
    written = recorder.events_written
    recorder._file = _BrokenFile()  # the disk fills up
    for i in range(5):
        recorder("in", {**open_doc, "method": "textDocument/didChange"}, 0.03 + i)
    assert len(problems) == 1 and "recording stops" in problems[0] and "No space left" in problems[0], problems
    assert recorder.events_written == written
    recorder.close()


def test_the_cursor_notification_is_recorded_as_a_cursor_event(tmp_path):
    from efim_lsp.trace_format import read_trace  # noqa: PLC0415

    recorder = Recorder(tmp_path / "traces")
    recorder("in", {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"capabilities": {}}}, 0.0)
    recorder("out", {"jsonrpc": "2.0", "id": 1, "result": {"capabilities": {}}}, 0.01)
    move = {"textDocument": {"uri": "file:///a.py"}, "position": {"line": 3, "character": 4}}
    recorder("in", {"jsonrpc": "2.0", "method": "efim/didMoveCursor", "params": move}, 0.5)
    recorder.close()
    events = read_trace(recorder.path).events
    assert [(e.kind, e.params) for e in events] == [("cursor", move)]
    assert events[0].method in (None, "efim/didMoveCursor")  # None: the kind's default method
