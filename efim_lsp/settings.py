"""The server's settings: one typed struct, read from `initializationOptions` and
`workspace/didChangeConfiguration` (flat camelCase keys, optionally under an
`"efim"` section).

Validation happens here, at the edge, key by key: an unknown key is logged and
ignored; a bad value is reported (the caller shows it with `window/showMessage`)
and that key falls back to its default. Nothing else is lost because one key is
wrong.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from engine.api import DEFAULT_SPECULATE

# Keys whose change needs a new engine (everything else applies to the next request).
ENGINE_KEYS = frozenset({
    "model", "fim_tokens", "adapter", "kv_disk", "kv_disk_budget", "backend", "endpoint", "remote_model", "api_key_env",
})


class Settings(msgspec.Struct, frozen=True, rename="camel", kw_only=True):
    model: str = "default"
    """"default" (the embedded SmolLM2-135M) or a path to a Hugging Face folder / GGUF file. With a remote backend: the model the server serves (its tokenizer renders the prompts; no weights are loaded)."""

    backend: Literal["local", "openai", "llama.cpp"] = "local"
    """Where completions are computed: local (the in-process engine), llama.cpp (llama.cpp's llama-server: /completion, cache_prompt, a server slot per document) or openai (an OpenAI-compatible /v1/completions server: vLLM, SGLang). docs/deploy.md."""

    endpoint: str = ""
    """Base URL of the remote server (http://127.0.0.1:8080, https://gpu-box:8000/v1). Plain HTTP to another machine is warned about."""

    remote_model: str = ""
    """The model name sent to an openai backend ("" = the first one its /v1/models lists)."""

    api_key_env: str = ""
    """The NAME of an environment variable of the server process holding the API key (sent as `Authorization: Bearer`); never the key itself, which is never logged."""

    prompt_format: Literal["efim", "fim"] = "efim"
    """Prompt layout. efim: `PRE P SUF S MID inc` (the previous keystroke's KV stays valid); fim: `PRE P+inc SUF S MID`."""

    cache: bool = True
    """False recomputes the whole prompt every time (the no-cache baseline)."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 64
    """Most tokens generated per suggestion."""

    prefix_tokens: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 1536
    """Token budget of the text before the cursor (the prefix window)."""

    suffix_tokens: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 512
    """Token budget of the text after the cursor (the suffix window)."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.0
    """Sampling temperature; 0 is greedy."""

    speculate: Annotated[int, msgspec.Meta(ge=0, le=16)] = DEFAULT_SPECULATE
    """Prompt-lookup speculation (local engine, greedy suggestions): most tokens guessed from earlier text (the window, context chunks, the last suggestion) and checked in one model step; 0 turns it off. The suggestion is the same either way, it arrives sooner (docs/design.md, "Prompt-lookup speculation")."""

    alternatives: Annotated[int, msgspec.Meta(ge=1, le=4)] = 1
    """Suggestions per inline completion (1-4). The first is the usual one (`temperature`, greedy by default); the others are sampled from the same prompt (temperature 0.8, top-p 0.95, fixed seeds), which is prefilled once; empty and repeated ones are dropped, so an answer may hold fewer. The editor cycles through them. The answer waits for all of them."""

    multiline: Literal["auto", "never", "always"] = "auto"
    """auto: a block after a line that opens one or on an empty line inside one, else one line."""

    debounce_ms: Annotated[int, msgspec.Meta(ge=0, le=5000)] = 0
    """Wait before starting the engine. 0: start at once; a newer keystroke cancels instead."""

    timeout_ms: Annotated[int, msgspec.Meta(ge=0, le=600000)] = 1500
    """Most time a completion takes from its arrival: then it is answered with what it has (nothing, if its prompt is still prefilling) and the rows it computed stay cached, so the next keystroke continues from them. 0: no limit."""

    fim_tokens: Literal["auto", "add"] = "auto"
    """auto: use the model's own FIM sentinels (prefix-only if none); add: add StarCoder sentinels (speed tests; quality needs training)."""

    adapter: str = "auto"
    """LoRA merged at load: auto (the shipped FIM adapter for the default model, when its card marks it ready), none, or a path."""

    context: Literal["off", "prefix", "blend"] = "off"
    """Cross-file context: off, plain prefix caching of chunks, or CacheBlend."""

    context_selection: Literal["imports", "bm25"] = "imports"
    """How context chunks are chosen: imports (the definitions — signatures, class heads with their methods, docstring first lines — of the workspace modules the file imports, then recently edited open files, then BM25) or bm25 (64-line pieces of any file whose identifiers best match the text around the cursor). docs/crossfile.md."""

    import_names: bool = True
    """At a name's place in a `from X import` list (X a module of a workspace folder or an open document), answer with the names of X that the code below uses and the file does not bind yet, in the list's sort order, without asking the model; independent of `context` (docs/crossfile.md, "Import names")."""

    context_chunks: Annotated[int, msgspec.Meta(ge=0, le=64)] = 4
    """Most context chunks per request."""

    context_tokens: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 1024
    """Token budget of all context chunks together."""

    blend_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.15
    """CacheBlend: fraction of chunk tokens recomputed (highest KV deviation)."""

    warm_ahead: bool = True
    """Navigation: on `efim/didMoveCursor` (and an edit away from the session), prefill in the background the window a request there would need (docs/design.md, "After a jump")."""

    answer_ahead: bool = True
    """Navigation: where the cursor settles (a cursor signal, after its warm-up), compute the suggestion a request there would get; a request at that place then answers at once, and typing its first characters shows the rest (docs/navigation.md, "Answers ahead"). Needs `warmAhead` and `cache`."""

    first_window_tokens: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 256
    """Navigation: while a new edit session's full window is not computed yet (a jump, a file just opened), its requests are answered from this many tokens around the cursor (3/4 before it) and the full window is prefilled in the background; later requests use it once it is (docs/navigation.md, "The first answer at a new place"). Needs `warmAhead` and `cache`; 0 turns it off."""

    document_kv: bool = False
    """Navigation: keep each open document's KV in stable pieces (computed in the background, nearest the cursor first) and assemble a new window after a jump from them with CacheBlend (`blendRatio`). Off by default: 3.3x faster than a prefill after a jump, but with the embedded 135M model the assembled window changes the suggested line in 2 of 3 held-out lines (docs/navigation.md)."""

    next_edit: Literal["off", "baseline", "model"] = "baseline"
    """Next edits (`textDocument/copilotInlineEdit`): "baseline" proposes without a model (a rename's next occurrence in the enclosing function, the next call site after a signature change, the next parallel line; docs/design.md, "Next edits"); "model" also asks the model about the places a renamed name, a changed number or word occurs, where those are silent (needs an adapter trained on next-edit probes: `efim train --next-edit`); "off" answers every request with no edit."""

    kv_disk: bool = True
    """Disk tier: keep each document's last KV in the user cache directory (efim-lsp/kv), so a restarted server starts with it; `efim cache ls|clear` shows and removes it."""

    kv_disk_budget: Annotated[str, msgspec.Meta(pattern=r"^\s*[0-9]*\.?[0-9]+\s*[kKmMgGtT]?(i?[bB])?\s*$")] = "2G"
    """Most disk the KV files take (e.g. "2G", "500MB"); the least recently used go first."""

    strict_versions: bool | None = None
    """A didChange whose version skips marks the document out of sync. None: on, except for Neovim (its versions jump by design)."""


class SettingsUpdate(NamedTuple):
    settings: Settings
    changed: frozenset[str]  # attribute names whose value changed
    problems: tuple[str, ...]  # bad values (each fell back to its default)
    unknown: tuple[str, ...]  # keys that are not settings


_FIELDS = {f.encode_name: f for f in msgspec.structs.fields(Settings)}


def section(raw: Any) -> dict[str, Any]:
    """The settings dict inside a client payload: flat, or under "efim"."""
    if not isinstance(raw, dict):
        return {}
    inner = raw.get("efim")
    if isinstance(inner, dict):
        return inner
    return raw


def apply(current: Settings, raw: Any) -> SettingsUpdate:
    """`current` with the valid keys of `raw` applied."""
    values = section(raw)
    problems: list[str] = []
    unknown: list[str] = []
    if raw is not None and not isinstance(raw, dict):
        problems.append(f"settings must be an object, got {type(raw).__name__}")
    updates: dict[str, Any] = {}
    for key, value in values.items():
        field = _FIELDS.get(key)
        if field is None:
            unknown.append(key)
            continue
        try:
            updates[field.name] = msgspec.convert(value, field.type)
        except msgspec.ValidationError as exc:
            updates[field.name] = field.default
            problems.append(f"setting {key}={value!r} is invalid ({exc}); using the default {field.default!r}")
    new = msgspec.structs.replace(current, **updates) if updates else current
    changed = frozenset(name for name in updates if getattr(new, name) != getattr(current, name))
    return SettingsUpdate(new, changed, tuple(problems), tuple(unknown))
