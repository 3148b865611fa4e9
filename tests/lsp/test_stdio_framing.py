"""The stdio loop's framing, in-process: what a buggy client's bytes turn into.

The rule: every well-framed message after the damage is read, whatever the damage was."""

from __future__ import annotations

import asyncio
import json

import pytest

from efim_lsp import stdio


class Collect:
    def __init__(self):
        self.messages = []
        self.parse_errors = []

    def structure_message(self, data):
        return data

    def handle_message(self, message):
        self.messages.append(message)

    def answer_parse_error(self, reason):
        self.parse_errors.append(reason)


def msg(n: int) -> bytes:
    body = json.dumps({"jsonrpc": "2.0", "id": n, "method": "efim/stats"}).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


async def read_all(*chunks: bytes, pause: float = 0.0) -> list:
    """Feed `chunks` (pausing between them, as a client would between writes), then EOF."""
    reader = asyncio.StreamReader()
    sink = Collect()

    async def feed():
        for chunk in chunks:
            reader.feed_data(chunk)
            await asyncio.sleep(pause)
        reader.feed_eof()

    feeder = asyncio.ensure_future(feed())
    await asyncio.wait_for(stdio.serve(stdio._PipeReader(reader), sink, exit_code=lambda: None), 10)
    await feeder
    return [m.get("id") if isinstance(m, dict) else m for m in sink.messages]


BODY = b'{"jsonrpc": "2.0", "method": "x"}'
DAMAGE = {
    "too short": b"Content-Length: 10\r\n\r\n" + BODY,
    "too long, followed at once": b"Content-Length: 90\r\n\r\n" + BODY,
    "non-numeric": b"Content-Length: abc\r\n\r\n" + BODY,
    "negative": b"Content-Length: -5\r\n\r\n" + BODY,
    "huge": b"Content-Length: 99999999999\r\n\r\n" + BODY,
    "zero": b"Content-Length: 0\r\n\r\n",
    "non-JSON": b"Content-Length: 5\r\n\r\nhello",
    "invalid UTF-8": b"Content-Length: 4\r\n\r\n\"\xff\xfe\"",
    "no header": BODY + b"\r\n",
    "garbage without a newline": b"\x00\x01garbage",
    "truncated (header promises more than comes)": b"Content-Length: 5\r\n\r\n",
    "lone CR and LF lines": b"\r\n\n\r\n",
    "a 2 MB line without a newline": b"x" * (2 << 20),
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
async def test_messages_after_damage_are_read(damage):
    ids = await read_all(msg(1), damage, msg(2), msg(3))
    assert ids[0] == 1 and ids[-2:] == [2, 3], ids


async def test_a_body_longer_than_what_comes_is_cut_when_it_stalls_on_the_next_header():
    # The client writes a message whose length is 200 bytes too long, then (later) a valid one:
    # nothing more arrives, so the server must not wait for the missing bytes forever.
    ids = await read_all(b"Content-Length: 300\r\n\r\n" + BODY, msg(7), pause=stdio.STALL_SECONDS * 2)
    assert ids == [7], ids


async def test_header_names_are_case_insensitive_and_other_headers_ignored():
    body = json.dumps({"jsonrpc": "2.0", "id": 5, "method": "m"}).encode()
    raw = b"content-type: application/vscode-jsonrpc; charset=utf-8\r\ncontent-length: %d\n\n" % len(body) + body
    assert await read_all(raw, msg(6)) == [5, 6]


async def test_json_that_is_not_an_object_reaches_the_protocol_which_decides():
    assert await read_all(b"Content-Length: 2\r\n\r\n[]", msg(1)) == [[], 1]


async def test_a_body_that_is_not_json_is_answered_a_parse_error_once_and_reading_goes_on():
    reader = asyncio.StreamReader()
    sink = Collect()
    reader.feed_data(b"Content-Length: 5\r\n\r\nhello" + b"Content-Length: 4\r\n\r\n\"\xff\xfe\"" + msg(4))
    reader.feed_eof()
    await asyncio.wait_for(stdio.serve(stdio._PipeReader(reader), sink, exit_code=lambda: None), 10)
    assert [m.get("id") for m in sink.messages] == [4]
    assert len(sink.parse_errors) == 2 and all("not JSON" in r for r in sink.parse_errors), sink.parse_errors
