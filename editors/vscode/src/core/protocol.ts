/**
 * The server's messages beyond LSP 3.18: show/accept reports (the names
 * Copilot's language server uses, so existing telemetry works), `efim/stats`,
 * the cursor notification `efim/didMoveCursor`, and next edits (`textDocument/copilotInlineEdit`).
 */
import { Command, InlineCompletionItem, NotificationType, Position, Range, RequestType } from 'vscode-languageserver-protocol';

export interface Percentiles {
    p50: number;
    p95: number;
    p99: number;
}

/** Counters returned by `efim/stats` (all since the server started). */
export interface EfimStats {
    requests: number;
    served: number;
    typingThroughHits: number;
    cancelled: number;
    promptTokens: number;
    reusedTokens: number;
    prefilledTokens: number;
    /** reusedTokens / promptTokens, in [0, 1]. */
    reuseRatio: number;
    ttftMs: Percentiles;
    latencyMs: Percentiles;
    cacheBytes: number;
    sessions: { active: number; rebases: number };
    /** Fields a newer server adds are kept and shown as they are. */
    [extra: string]: unknown;
}

export interface DidShowCompletionParams {
    item: InlineCompletionItem;
}

export interface DidPartiallyAcceptCompletionParams {
    item: InlineCompletionItem;
    /** UTF-16 code units of `item.insertText` accepted so far, counted from its start. */
    acceptedLength: number;
}

/** Sent with `{}` as params: JSON-RPC lets a request omit them, but pygls rejects a custom request without any. */
export const StatsRequest = new RequestType<Record<string, never>, EfimStats, void>('efim/stats');
export const DidShowCompletionNotification = new NotificationType<DidShowCompletionParams>('textDocument/didShowCompletion');
export const DidPartiallyAcceptCompletionNotification = new NotificationType<DidPartiallyAcceptCompletionParams>(
    'textDocument/didPartiallyAcceptCompletion',
);

/**
 * Where the user's cursor is, sent without an edit (debounced) so the server can
 * prefill the window a request there would need before the first keystroke.
 * `position` counts in the negotiated encoding (UTF-16 for this client).
 */
export interface DidMoveCursorParams {
    textDocument: { uri: string; version?: number };
    position: Position;
}

export const DidMoveCursorNotification = new NotificationType<DidMoveCursorParams>('efim/didMoveCursor');

/**
 * Next edits, in the messages Copilot's language server uses (so clients that already speak
 * them work unchanged): `textDocument/copilotInlineEdit` asks for the next edit after the
 * document's latest changes, `textDocument/didShowInlineEdit` reports one drawn, and its
 * `command` (efim.acceptInlineEdit, listed in `executeCommandProvider`) reports it applied.
 * Ranges count in the negotiated encoding (UTF-16 for this client).
 */
export interface InlineEditParams {
    textDocument: { uri: string; version: number };
    position: Position;
}

export interface InlineEdit {
    /** Replaces `range`. */
    text: string;
    /** The document and version the edit is for (the request's version, copied). */
    textDocument: { uri: string; version: number };
    range: Range;
    command?: Command;
}

export interface InlineEditResult {
    /** One edit or none. */
    edits: InlineEdit[];
}

export const ACCEPT_INLINE_EDIT_COMMAND = 'efim.acceptInlineEdit';
export const InlineEditRequest = new RequestType<InlineEditParams, InlineEditResult, void>('textDocument/copilotInlineEdit');
export const DidShowInlineEditNotification = new NotificationType<{ item: InlineEdit }>('textDocument/didShowInlineEdit');
