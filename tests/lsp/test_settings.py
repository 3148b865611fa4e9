"""Settings: camelCase keys, unknown keys reported, a bad value falls back to the default."""

from efim_lsp.settings import Settings, apply


def test_defaults():
    s = Settings()
    assert (s.model, s.prompt_format, s.cache, s.prefix_tokens, s.suffix_tokens, s.debounce_ms) == ("default", "efim", True, 1536, 512, 0)
    assert (s.multiline, s.fim_tokens, s.context_chunks, s.context_tokens, s.blend_ratio) == ("auto", "auto", 4, 1024, 0.15)


def test_flat_camel_case_keys_apply():
    up = apply(Settings(), {"promptFormat": "fim", "maxTokens": 32, "fimTokens": "add", "temperature": 0.2})
    assert up.settings.prompt_format == "fim" and up.settings.max_tokens == 32 and up.settings.temperature == 0.2
    assert up.changed == {"prompt_format", "max_tokens", "fim_tokens", "temperature"}
    assert not up.problems and not up.unknown


def test_section_under_efim_key():
    up = apply(Settings(), {"efim": {"multiline": "never"}, "other": 1})
    assert up.settings.multiline == "never" and not up.unknown


def test_unknown_keys_and_bad_values():
    base = apply(Settings(), {"maxTokens": 16, "promptFormat": "fim"}).settings
    up = apply(base, {"maxTokens": 0, "promptFormat": "xfim", "cache": "yes", "bogus": 1, "suffixTokens": 100})
    assert up.settings.max_tokens == 64 and up.settings.prompt_format == "efim"  # back to the defaults
    assert up.settings.cache is True
    assert up.settings.suffix_tokens == 100
    assert up.unknown == ("bogus",)
    assert len(up.problems) == 3 and any("maxTokens" in p for p in up.problems)


def test_not_an_object():
    up = apply(Settings(), ["model"])
    assert up.settings == Settings() and up.problems
    assert apply(Settings(), None).settings == Settings()


def test_alternatives_range_and_bad_values():
    assert Settings().alternatives == 1
    assert apply(Settings(), {"alternatives": 3}).settings.alternatives == 3
    base = apply(Settings(), {"alternatives": 4}).settings
    for bad in (0, 5, "two", 2.5):
        up = apply(base, {"alternatives": bad})
        assert up.settings.alternatives == 1 and len(up.problems) == 1 and "alternatives" in up.problems[0], bad
