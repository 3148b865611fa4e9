"""Reading the params of custom methods, which pygls does not type."""

from __future__ import annotations

from typing import Any

from efim_lsp.documents import DocumentStore
from efim_lsp.positions import PositionError


def mapping(value: Any) -> dict[str, Any]:
    """Params of custom methods arrive as dicts or (pygls) namedtuples; anything else is
    read as empty."""
    if isinstance(value, dict):
        return value
    if hasattr(value, "_asdict"):
        return value._asdict()
    return {}


def cursor_of(documents: DocumentStore, params: Any) -> tuple[str, int] | None:
    """(uri, offset) of a `{textDocument: {uri}, position: {line, character}}` payload
    that names an open document and a position inside it; None otherwise."""
    try:
        info = mapping(params)
        uri = mapping(info.get("textDocument")).get("uri")
        pos = mapping(info.get("position"))
        line, character = pos.get("line"), pos.get("character")
        if not isinstance(uri, str) or not isinstance(line, int) or not isinstance(character, int):
            return None
        doc = documents.get(uri)
        if doc is None:
            return None
        return uri, doc.offset_at(line, character, documents.encoding)
    except (PositionError, TypeError, ValueError, AttributeError):
        return None
