"""Reading the params of custom methods, which pygls does not type."""

from __future__ import annotations

from typing import Any


def mapping(value: Any) -> dict[str, Any]:
    """Params of custom methods arrive as dicts or (pygls) namedtuples; anything else is
    read as empty."""
    if isinstance(value, dict):
        return value
    if hasattr(value, "_asdict"):
        return value._asdict()
    return {}
