"""A remote engine: the `engine.api.Engine` protocol over an inference server's HTTP API
(llama.cpp's `llama-server`, or any OpenAI-compatible completions server such as vLLM or
SGLang). `engine` (RemoteEngine), `dialects` (what each server is sent and answers),
`stream` (server-sent events), `connection` (endpoint, credentials, backend state and
reconnection), `vocabulary` (the served model's tokenizer, without its weights).
docs/deploy.md says how to run it."""

from engine.remote.engine import RemoteEngine, open_remote_engine

BACKENDS = ("llama.cpp", "openai")

__all__ = ["RemoteEngine", "open_remote_engine", "BACKENDS"]
