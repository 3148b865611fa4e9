"""Lifecycle handlers: initialize, initialized, shutdown, and settings changes.

`initialize` answers at once: it picks the position encoding, applies the client's
`initializationOptions` (problems are shown after `initialized`, when the client can
show them) and hands the workspace folders to the context source; the model loads after
`initialized`, off the event loop (`efim_lsp.engine_holder`). Settings arrive pushed in
`workspace/didChangeConfiguration` or, when a client sends `settings: null` (VS Code), are
pulled with `workspace/configuration`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from lsprotocol import types

from efim_lsp.handlers import documents
from efim_lsp.positions import ENCODINGS

if TYPE_CHECKING:
    from efim_lsp.server import EfimServer

log = logging.getLogger(__name__)


def register(server: EfimServer) -> None:
    server.feature(types.INITIALIZE)(initialize)
    server.feature(types.INITIALIZED)(initialized)
    server.feature(types.SHUTDOWN)(shutdown)
    server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)(did_change_configuration)


def initialize(ls: EfimServer, params: types.InitializeParams) -> None:
    ls.loop = asyncio.get_running_loop()
    encoding = _encoding_name(ls.workspace.position_encoding)
    ls.documents.encoding = encoding if encoding in ENCODINGS else "utf-16"
    ls.client_is_neovim = bool(params.client_info and params.client_info.name.lower().startswith("neovim"))
    ls.apply_settings(params.initialization_options, announce=False)
    documents.tell_folders(ls)
    log.info("initialize: client %s, positions in %s", params.client_info.name if params.client_info else "?", ls.documents.encoding)


def initialized(ls: EfimServer, params: types.InitializedParams) -> None:
    ls.show_pending_problems()
    ls.start_engine_load()
    if ls.context is not None:
        ls.context.settings_changed(ls.settings)  # with context on, index now (not at the first request)


def shutdown(ls: EfimServer, params: None) -> None:
    ls.close()


async def did_change_configuration(ls: EfimServer, params: types.DidChangeConfigurationParams) -> None:
    raw = params.settings
    if not raw:
        caps = ls.client_capabilities
        if caps and caps.workspace and caps.workspace.configuration:
            # Pull model (VS Code sends `settings: null`): ask for our section.
            result = await ls.workspace_configuration_async(
                types.ConfigurationParams(items=[types.ConfigurationItem(section="efim")])
            )
            raw = result[0] if result else None
    if raw:
        ls.apply_settings(raw)


def _encoding_name(encoding: types.PositionEncodingKind | str | None) -> str:
    """The position encoding pygls chose, as a plain name ("utf-16", ...)."""
    return encoding.value if isinstance(encoding, types.PositionEncodingKind) else str(encoding)
