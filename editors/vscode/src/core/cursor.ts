/**
 * The cursor notification `efim/didMoveCursor`: tells the server where the
 * user is before the first keystroke, so it can prefill the window a request
 * there would need (docs/editors.md, "The cursor notification").
 *
 * What is sent, debounced (one trailing timer for all documents, the latest
 * position wins): a cursor move without an edit, and the cursor of a document
 * that becomes the active editor's. What is not: the cursor move an edit causes
 * (the selection change VS Code reports right after typing, at the end of the
 * inserted text) — `didChange` already says where the edit is, and VS Code asks
 * for an inline completion there anyway; nor the same document version and
 * position twice in a row.
 */
import type { Position } from 'vscode-languageserver-protocol';
import { advance, samePosition, type Sender, type TextChange } from './completions';
import { DidMoveCursorNotification, type DidMoveCursorParams } from './protocol';

/** The timer functions a `Debouncer` uses (injected by tests). */
export interface Timers {
    setTimeout(callback: () => void, ms: number): unknown;
    clearTimeout(handle: unknown): void;
}

const realTimers: Timers = {
    setTimeout: (callback, ms) => setTimeout(callback, ms),
    clearTimeout: (handle) => clearTimeout(handle as NodeJS.Timeout),
};

/** Trailing-edge debounce of one value: `fire(latest)` runs `delayMs` after the last `schedule`. */
export class Debouncer<T> {
    private handle: unknown;
    private value?: { latest: T };

    constructor(
        private readonly delayMs: number,
        private readonly fire: (value: T) => void,
        private readonly timers: Timers = realTimers,
    ) {}

    /** The value waiting to fire, if any. */
    get pending(): T | undefined {
        return this.value?.latest;
    }

    schedule(value: T): void {
        this.value = { latest: value };
        if (this.handle !== undefined) this.timers.clearTimeout(this.handle);
        this.handle = this.timers.setTimeout(() => this.flush(), this.delayMs);
    }

    /** Fires now if something is pending. */
    flush(): void {
        const value = this.value;
        this.cancel();
        if (value) this.fire(value.latest);
    }

    cancel(): void {
        if (this.handle !== undefined) this.timers.clearTimeout(this.handle);
        this.handle = undefined;
        this.value = undefined;
    }
}

export const CURSOR_DEBOUNCE_MS = 80;

export interface CursorReporterOptions {
    delayMs?: number;
    timers?: Timers;
    /** A failed send (e.g. the server just stopped); the reporter goes on. */
    onError?: (err: unknown) => void;
}

/**
 * Turns editor events into debounced `efim/didMoveCursor` notifications.
 * The caller filters documents (only those the client syncs) and positions are
 * LSP positions (UTF-16, as VS Code's own).
 */
export class CursorReporter {
    private readonly debouncer: Debouncer<DidMoveCursorParams>;
    /** Per document: the last edit not yet followed by a selection change (its version and where its text ends). */
    private readonly lastEdit = new Map<string, { version: number; ends: Position[] }>();
    private lastSent?: string;
    /** Notifications sent so far. */
    sent = 0;

    constructor(
        private readonly sender: Sender,
        private readonly options: CursorReporterOptions = {},
    ) {
        this.debouncer = new Debouncer(options.delayMs ?? CURSOR_DEBOUNCE_MS, (p) => this.send(p), options.timers);
    }

    /** A document changed (before VS Code reports the selection change the edit caused). */
    edited(uri: string, version: number, changes: readonly TextChange[]): void {
        if (changes.length === 0) return;
        this.lastEdit.set(uri, { version, ends: changes.map((c) => advance(c.range.start, c.text)) });
        if (this.debouncer.pending?.textDocument.uri === uri) this.debouncer.cancel(); // the edit supersedes a move just before it
    }

    /** The primary cursor of a document's editor moved to `position`. */
    selectionChanged(uri: string, version: number, position: Position): void {
        const edit = this.lastEdit.get(uri);
        this.lastEdit.delete(uri);
        if (edit && edit.version === version && edit.ends.some((end) => samePosition(end, position))) return; // caused by the edit
        this.debouncer.schedule(params(uri, version, position));
    }

    /** A document became the active editor's, its cursor at `position`. */
    activated(uri: string, version: number, position: Position): void {
        this.lastEdit.delete(uri);
        this.debouncer.schedule(params(uri, version, position));
    }

    /** Drops what is pending and forgets what was sent (a new server has not heard it). */
    reset(): void {
        this.debouncer.cancel();
        this.lastEdit.clear();
        this.lastSent = undefined;
    }

    dispose(): void {
        this.reset();
    }

    private send(params: DidMoveCursorParams): void {
        const key = JSON.stringify([params.textDocument.uri, params.textDocument.version, params.position.line, params.position.character]);
        if (key === this.lastSent) return;
        this.lastSent = key;
        this.sent += 1;
        const onError = (err: unknown) => this.options.onError?.(err);
        try {
            this.sender.sendNotification(DidMoveCursorNotification.method, params).catch(onError);
        } catch (err) {
            onError(err); // a connection already disposed throws rather than rejects
        }
    }
}

function params(uri: string, version: number, position: Position): DidMoveCursorParams {
    return { textDocument: { uri, version }, position: { line: position.line, character: position.character } };
}
