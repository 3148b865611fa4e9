/**
 * Asking for inline completions and reporting what the user saw and took.
 *
 * Everything here talks to a `Sender`: vscode-languageclient's `LanguageClient`
 * in the editor, a plain `ProtocolConnection` in the Node tests.
 */
import {
    CancellationToken,
    ExecuteCommandRequest,
    InlineCompletionItem,
    InlineCompletionList,
    InlineCompletionParams,
    InlineCompletionRequest,
    Position,
    Range,
} from 'vscode-languageserver-protocol';
import { DidPartiallyAcceptCompletionNotification, DidShowCompletionNotification } from './protocol';

/** The part of a JSON-RPC connection the completion logic needs. */
export interface Sender {
    sendRequest(method: string, params: unknown, token?: CancellationToken): Promise<unknown>;
    sendNotification(method: string, params: unknown): Promise<void>;
}

export interface CompletionResult {
    items: InlineCompletionItem[];
    /** Round trip as the client saw it, keystroke (request sent) to answer. */
    latencyMs: number;
}

function itemText(item: InlineCompletionItem): string {
    return typeof item.insertText === 'string' ? item.insertText : item.insertText.value;
}

/**
 * Sends `textDocument/inlineCompletion`. Accepts both result shapes the spec
 * allows (a list or a bare array) and drops items without text, so callers
 * only ever see suggestions worth drawing. Null (model still loading) gives no items.
 */
export async function requestInlineCompletion(
    sender: Sender,
    params: InlineCompletionParams,
    token?: CancellationToken,
): Promise<CompletionResult> {
    const started = performance.now();
    // Pass no token argument rather than `undefined`: vscode-jsonrpc counts arguments, and
    // (params, undefined) goes out as a by-position array the server cannot read.
    const pending = token
        ? sender.sendRequest(InlineCompletionRequest.method, params, token)
        : sender.sendRequest(InlineCompletionRequest.method, params);
    const result = (await pending) as
        | InlineCompletionList
        | InlineCompletionItem[]
        | null;
    const latencyMs = performance.now() - started;
    const raw = result === null || result === undefined ? [] : Array.isArray(result) ? result : result.items ?? [];
    return { items: raw.filter((item) => itemText(item).length > 0), latencyMs };
}

/**
 * Reports shows and accepts to the server. A show is reported once per item
 * (editors ask again for the same suggestion while it stays on screen).
 */
export class CompletionReporter {
    private readonly shownItems = new WeakSet<InlineCompletionItem>();

    constructor(private readonly sender: Sender) {}

    async shown(item: InlineCompletionItem): Promise<void> {
        if (this.shownItems.has(item)) return;
        this.shownItems.add(item);
        await this.sender.sendNotification(DidShowCompletionNotification.method, { item });
    }

    /**
     * A full accept runs the item's own command on the server (that is how the
     * server counts it). An item without a command is reported as a partial
     * accept of its whole text, so the accept is not lost.
     */
    async accepted(item: InlineCompletionItem): Promise<unknown> {
        if (item.command) {
            return this.sender.sendRequest(ExecuteCommandRequest.method, {
                command: item.command.command,
                arguments: item.command.arguments ?? [],
            });
        }
        return this.partiallyAccepted(item, itemText(item).length);
    }

    async partiallyAccepted(item: InlineCompletionItem, acceptedLength: number): Promise<void> {
        await this.sender.sendNotification(DidPartiallyAcceptCompletionNotification.method, { item, acceptedLength });
    }
}

/** One content change as both VS Code and LSP describe it (UTF-16 positions). */
export interface TextChange {
    range: Range;
    text: string;
}

export function samePosition(a: Position, b: Position): boolean {
    return a.line === b.line && a.character === b.character;
}

/** Where the cursor ends up after typing `text` at `pos` (UTF-16 columns). */
export function advance(pos: Position, text: string): Position {
    const lines = text.split('\n');
    if (lines.length === 1) return { line: pos.line, character: pos.character + text.length };
    return { line: pos.line + lines.length - 1, character: lines[lines.length - 1].length };
}

/**
 * Recognises partial accepts from document changes, for editors whose API does
 * not report them (VS Code's stable API runs an item's command on a full
 * accept but says nothing when the user takes the next word or line).
 *
 * A partial accept is one change that inserts two or more characters at the
 * cursor, equal to the next part of the suggestion on screen but shorter than
 * all of it. One typed character is typing-through (the server answers it),
 * not an accept; the whole remainder at once is the full accept, counted by
 * the item's command. Any other change forgets the suggestion.
 */
export class PartialAcceptTracker {
    private current?: { uri: string; item: InlineCompletionItem; cursor: Position; accepted: number; text: string };

    /** A suggestion was drawn at `cursor`; `item.range` may start before it (text typed since). */
    shown(uri: string, item: InlineCompletionItem, cursor: Position): void {
        const text = itemText(item);
        const start = item.range?.start ?? cursor;
        const typed = start.line === cursor.line ? Math.max(0, cursor.character - start.character) : 0;
        this.current = { uri, item, cursor, accepted: typed, text };
    }

    clear(): void {
        this.current = undefined;
    }

    /** Feeds a document change; returns the partial accept to report, if this change was one. */
    changed(uri: string, changes: readonly TextChange[]): { item: InlineCompletionItem; acceptedLength: number } | undefined {
        const cur = this.current;
        if (!cur || cur.uri !== uri) return undefined;
        const change = changes.length === 1 ? changes[0] : undefined;
        const remainder = cur.text.slice(cur.accepted);
        const isInsertAtCursor =
            change !== undefined && samePosition(change.range.start, cur.cursor) && samePosition(change.range.end, cur.cursor);
        if (!change || !isInsertAtCursor || change.text.length < 2 || change.text.length >= remainder.length || !remainder.startsWith(change.text)) {
            this.clear();
            return undefined;
        }
        cur.accepted += change.text.length;
        cur.cursor = advance(cur.cursor, change.text);
        return { item: cur.item, acceptedLength: cur.accepted };
    }
}
