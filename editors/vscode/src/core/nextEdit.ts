/**
 * Next edits: after a change the server may propose the next edit elsewhere in the document
 * (a rename repeated at the name's next use). The editor asks for one (debounced), draws it
 * where it applies, reports the show once, and on the user's key jumps to it, then applies
 * it and runs its command. Nothing here knows VS Code: `extension.ts` draws and edits.
 *
 * An edit is only for the document version it was asked about: an answer for another
 * version is dropped, and so is an edit on screen whose document changed since (another
 * version, or its range no longer holding the text it held when drawn) — never applied.
 */
import { CancellationToken, ExecuteCommandRequest, Position, Range } from 'vscode-languageserver-protocol';
import type { Sender } from './completions';
import {
    ACCEPT_INLINE_EDIT_COMMAND,
    DidShowInlineEditNotification,
    InlineEdit,
    InlineEditParams,
    InlineEditRequest,
    InlineEditResult,
} from './protocol';

/** Trailing debounce between the last change and the request. */
export const NEXT_EDIT_DEBOUNCE_MS = 150;

/** Whether a server answers next-edit requests: it lists their accept command. */
export function supportsNextEdits(capabilities: { executeCommandProvider?: { commands?: string[] } } | undefined): boolean {
    return capabilities?.executeCommandProvider?.commands?.includes(ACCEPT_INLINE_EDIT_COMMAND) ?? false;
}

function isPosition(p: unknown): p is Position {
    const q = p as Position | undefined;
    return typeof q?.line === 'number' && typeof q?.character === 'number' && q.line >= 0 && q.character >= 0;
}

function comparePositions(a: Position, b: Position): number {
    return a.line !== b.line ? a.line - b.line : a.character - b.character;
}

/**
 * Sends `textDocument/copilotInlineEdit`; returns its first edit when it is well formed and
 * for the document and version asked about, else undefined.
 */
export async function requestNextEdit(sender: Sender, params: InlineEditParams, token?: CancellationToken): Promise<InlineEdit | undefined> {
    // No token argument rather than `undefined` (vscode-jsonrpc would send a by-position array).
    const pending = token ? sender.sendRequest(InlineEditRequest.method, params, token) : sender.sendRequest(InlineEditRequest.method, params);
    const result = (await pending) as InlineEditResult | null | undefined;
    const edit = Array.isArray(result?.edits) ? result!.edits[0] : undefined;
    if (!edit || typeof edit.text !== 'string' || !isPosition(edit.range?.start) || !isPosition(edit.range?.end)) return undefined;
    if (comparePositions(edit.range.start, edit.range.end) > 0) return undefined;
    const doc = edit.textDocument;
    if (doc && (doc.uri !== params.textDocument.uri || (doc.version !== undefined && doc.version !== params.textDocument.version))) return undefined;
    return edit;
}

/** A next edit on screen: the document version it is for, and the text its range held when drawn. */
export interface ShownNextEdit {
    uri: string;
    version: number;
    edit: InlineEdit;
    rangeText: string;
}

/** The document as the next-edit key sees it. */
export interface DocumentState {
    uri: string;
    version: number;
    getText(range: Range): string;
}

export type NextEditAction = 'jump' | 'apply' | 'stale';

/** Whether `pos` lies in `range` (its ends included). */
export function inRange(range: Range, pos: Position): boolean {
    return comparePositions(range.start, pos) <= 0 && comparePositions(pos, range.end) <= 0;
}

/**
 * What the next-edit key does: `stale` (drop it) when the document moved on since it was
 * drawn, `apply` when the cursor is on it, else `jump` there.
 */
export function nextEditAction(shown: ShownNextEdit, doc: DocumentState, cursor: Position): NextEditAction {
    if (doc.uri !== shown.uri || doc.version !== shown.version || doc.getText(shown.edit.range) !== shown.rangeText) return 'stale';
    return inRange(shown.edit.range, cursor) ? 'apply' : 'jump';
}

/** Reports next edits to the server: a show once per edit, an apply as the edit's command. */
export class NextEditReporter {
    private readonly shownEdits = new WeakSet<InlineEdit>();

    constructor(private readonly sender: Sender) {}

    async shown(edit: InlineEdit): Promise<void> {
        if (this.shownEdits.has(edit)) return;
        this.shownEdits.add(edit);
        await this.sender.sendNotification(DidShowInlineEditNotification.method, { item: edit });
    }

    async accepted(edit: InlineEdit): Promise<unknown> {
        if (!edit.command) return undefined;
        return this.sender.sendRequest(ExecuteCommandRequest.method, { command: edit.command.command, arguments: edit.command.arguments ?? [] });
    }
}
