/** Unit tests of the VS Code-free client logic (no server, no VS Code). */
import assert from 'node:assert/strict';
import { chmodSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { describe, test } from 'node:test';
import { CancellationToken, InlineCompletionItem, InlineCompletionParams, InlineCompletionTriggerKind } from 'vscode-languageserver-protocol';
import { CompletionReporter, PartialAcceptTracker, requestInlineCompletion, Sender } from '../core/completions';
import { CursorReporter, Debouncer, Timers } from '../core/cursor';
import { resolveExecutable, serverLaunch, ServerNotFoundError } from '../core/launch';
import type { EfimStats } from '../core/protocol';
import { needsRestart, readSettings, sendSettings, serverOptions, settingsAction } from '../core/settings';
import { formatStats, ServerProgress, statusLine } from '../core/status';

/** Records every message and answers requests from a table. */
class RecordingSender implements Sender {
    readonly sent: { kind: 'request' | 'notification'; method: string; params: unknown }[] = [];
    constructor(private readonly answers: Record<string, unknown> = {}) {}
    /** Like vscode-jsonrpc, two or more arguments that are not a trailing token go out as a by-position array. */
    async sendRequest(method: string, ...args: unknown[]): Promise<unknown> {
        if (args.length > 1 && CancellationToken.is(args[args.length - 1])) args = args.slice(0, -1);
        this.sent.push({ kind: 'request', method, params: args.length === 1 ? args[0] : args });
        return this.answers[method] ?? null;
    }
    async sendNotification(method: string, params: unknown): Promise<void> {
        this.sent.push({ kind: 'notification', method, params });
    }
}

const position: InlineCompletionParams = {
    textDocument: { uri: 'file:///a.py' },
    position: { line: 0, character: 3 },
    context: { triggerKind: InlineCompletionTriggerKind.Automatic },
};

describe('settings', () => {
    test('unset options stay out so server defaults apply; named options win over raw ones', () => {
        const values: Record<string, unknown> = {
            serverPath: ' /opt/efim ',
            model: '/models/qwen',
            maxTokens: 32,
            promptFormat: null,
            multiline: '',
            serverSettings: { maxTokens: 8, blendRatio: 0.2, nothing: null },
        };
        const settings = readSettings((key) => values[key]);
        assert.equal(settings.serverPath, '/opt/efim');
        assert.deepEqual(serverOptions(settings), { model: '/models/qwen', maxTokens: 32, blendRatio: 0.2 });
    });

    test('mistyped client settings fall back to defaults', () => {
        const settings = readSettings((key) => ({ serverPath: 3, serverArgs: 'x', enable: 'yes' })[key]);
        assert.equal(settings.serverPath, 'efim');
        assert.deepEqual(settings.serverArgs, []);
        assert.equal(settings.enable, true);
        assert.deepEqual(serverOptions(settings), { model: 'default' });
    });

    test('only the launch command needs a restart', () => {
        const a = readSettings(() => undefined);
        assert.equal(needsRestart(a, { ...a, maxTokens: 5, model: 'x' }), false);
        assert.equal(needsRestart(a, { ...a, serverPath: '/other/efim' }), true);
        assert.equal(needsRestart(a, { ...a, serverArgs: ['--log-file', 'x'] }), true);
    });
});

describe('settings changes', () => {
    test('server options go to the running server; only the launch command restarts it', async () => {
        const a = readSettings((key) => ({ maxTokens: 12 } as Record<string, unknown>)[key]);
        assert.equal(settingsAction(a, { ...a, maxTokens: 1 }, true), 'notify');
        assert.equal(settingsAction(a, { ...a, model: '/models/other' }, true), 'notify');
        assert.equal(settingsAction(a, { ...a, serverSettings: { blendRatio: 0.3 } }, true), 'notify');
        assert.equal(settingsAction(a, { ...a }, true), 'none');
        assert.equal(settingsAction(a, { ...a, serverArgs: ['--log-file', 'x'] }, true), 'restart');
        assert.equal(settingsAction(a, { ...a, maxTokens: 1 }, false), 'start');
        assert.equal(settingsAction(a, { ...a, enable: false }, true), 'none', 'off keeps the server');
        assert.equal(settingsAction({ ...a, enable: false }, a, true), 'none', 'on again: nothing changed for the server');
        const sender = new RecordingSender();
        await sendSettings(sender, { ...a, maxTokens: 1 });
        assert.deepEqual(sender.sent, [
            { kind: 'notification', method: 'workspace/didChangeConfiguration', params: { settings: { model: 'default', maxTokens: 1 } } },
        ]);
    });
});

describe('launch', () => {
    test('finds executables on PATH and by path, and explains a missing one', () => {
        const dir = mkdtempSync(path.join(tmpdir(), 'efim-launch-'));
        try {
            const exe = path.join(dir, 'efim');
            writeFileSync(exe, '#!/bin/sh\n');
            chmodSync(exe, 0o755);
            writeFileSync(path.join(dir, 'notexec'), '');
            assert.equal(resolveExecutable('efim', { PATH: `/nonexistent${path.delimiter}${dir}` }), exe);
            assert.equal(resolveExecutable(exe, { PATH: '' }), exe);
            assert.equal(resolveExecutable(path.join(dir, 'notexec'), { PATH: '' }), undefined);
            const settings = readSettings((key) => (key === 'serverArgs' ? ['--log-file', 'l'] : undefined));
            assert.deepEqual(serverLaunch(settings, { PATH: dir }), { command: exe, args: ['serve', '--log-file', 'l'] });
            assert.throws(() => serverLaunch(settings, { PATH: '/nonexistent' }), (err: Error) => {
                assert.ok(err instanceof ServerNotFoundError);
                assert.match(err.message, /not found on PATH.*efim\.serverPath/s);
                return true;
            });
        } finally {
            rmSync(dir, { recursive: true, force: true });
        }
    });
});

describe('requests and reports', () => {
    test('both result shapes are accepted, empty items dropped, null is no items', async () => {
        const item = { insertText: 'rn x', range: { start: { line: 0, character: 0 }, end: { line: 0, character: 3 } } };
        const list = new RecordingSender({ 'textDocument/inlineCompletion': { items: [item, { insertText: '' }] } });
        assert.deepEqual((await requestInlineCompletion(list, position)).items, [item]);
        const array = new RecordingSender({ 'textDocument/inlineCompletion': [{ insertText: { kind: 'snippet', value: 'y' } }] });
        assert.equal((await requestInlineCompletion(array, position)).items.length, 1);
        const none = new RecordingSender();
        const result = await requestInlineCompletion(none, position);
        assert.deepEqual(result.items, []);
        assert.ok(result.latencyMs >= 0);
        assert.deepEqual(none.sent[0], { kind: 'request', method: 'textDocument/inlineCompletion', params: position });
    });

    test('every item of a multi-item answer (setting alternatives) is kept, in order', async () => {
        const at = { start: { line: 0, character: 3 }, end: { line: 0, character: 3 } };
        const answer = ['x = 1', 'x = 2', 'y = 0'].map((text, i) => ({ insertText: text, range: at, command: { title: 't', command: 'efim.accepted', arguments: [{ id: i, length: text.length }] } }));
        const sender = new RecordingSender({ 'textDocument/inlineCompletion': { items: answer } });
        assert.deepEqual((await requestInlineCompletion(sender, position)).items, answer);
        const settings = readSettings((key) => ({ alternatives: 3 } as Record<string, unknown>)[key]);
        assert.deepEqual(serverOptions(settings), { model: 'default', alternatives: 3 });
    });

    test('a show is reported once per item; accepts run the item command or report the full length', async () => {
        const sender = new RecordingSender();
        const reporter = new CompletionReporter(sender);
        const withCommand: InlineCompletionItem = { insertText: 'abc', command: { title: 't', command: 'efim.accept', arguments: [7] } };
        const without: InlineCompletionItem = { insertText: 'héllo' };
        await reporter.shown(withCommand);
        await reporter.shown(withCommand);
        await reporter.accepted(withCommand);
        await reporter.accepted(without);
        await reporter.partiallyAccepted(withCommand, 2);
        assert.deepEqual(sender.sent, [
            { kind: 'notification', method: 'textDocument/didShowCompletion', params: { item: withCommand } },
            { kind: 'request', method: 'workspace/executeCommand', params: { command: 'efim.accept', arguments: [7] } },
            { kind: 'notification', method: 'textDocument/didPartiallyAcceptCompletion', params: { item: without, acceptedLength: 5 } },
            { kind: 'notification', method: 'textDocument/didPartiallyAcceptCompletion', params: { item: withCommand, acceptedLength: 2 } },
        ]);
    });
});

describe('partial accepts from document changes', () => {
    const at = (line: number, character: number) => ({ line, character });
    const insert = (line: number, character: number, text: string) => [{ range: { start: at(line, character), end: at(line, character) }, text }];
    // Suggestion "return total\n" drawn with "re" already typed: range starts 2 before the cursor.
    const item: InlineCompletionItem = { insertText: 'return total', range: { start: at(3, 4), end: at(3, 6) } };

    test('word-by-word accepts count from the start of the item', () => {
        const tracker = new PartialAcceptTracker();
        tracker.shown('u', item, at(3, 6));
        assert.deepEqual(tracker.changed('u', insert(3, 6, 'turn')), { item, acceptedLength: 6 });
        assert.deepEqual(tracker.changed('u', insert(3, 10, ' to')), { item, acceptedLength: 9 });
    });

    test('typing one character, the whole remainder, a mismatch or another file is not a partial accept', () => {
        const tracker = new PartialAcceptTracker();
        for (const [uri, changes] of [
            ['u', insert(3, 6, 't')],
            ['u', insert(3, 6, 'turn total')],
            ['u', insert(3, 6, 'tx')],
            ['u', insert(3, 7, 'turn')],
            ['other', insert(3, 6, 'turn')],
        ] as const) {
            tracker.shown('u', item, at(3, 6));
            assert.equal(tracker.changed(uri, changes), undefined, JSON.stringify(changes));
        }
        // A change elsewhere in the same file forgets the suggestion; one in another file does not.
        tracker.shown('u', item, at(3, 6));
        tracker.changed('u', insert(0, 0, 'import os\n'));
        assert.equal(tracker.changed('u', insert(3, 6, 'turn')), undefined);
        tracker.shown('u', item, at(3, 6));
        tracker.changed('other', insert(0, 0, 'x'));
        assert.deepEqual(tracker.changed('u', insert(3, 6, 'turn')), { item, acceptedLength: 6 });
    });

    test('multi-line accepts move the cursor to the next line', () => {
        const tracker = new PartialAcceptTracker();
        const block: InlineCompletionItem = { insertText: 'if x:\n    y = 1\n    z = 2' };
        tracker.shown('u', block, at(0, 4));
        assert.deepEqual(tracker.changed('u', insert(0, 4, 'if x:\n')), { item: block, acceptedLength: 6 });
        assert.deepEqual(tracker.changed('u', insert(1, 0, '    y = 1\n')), { item: block, acceptedLength: 16 });
    });
});

describe('status', () => {
    const stats: EfimStats = {
        requests: 10, served: 8, typingThroughHits: 3, cancelled: 1, promptTokens: 1000, reusedTokens: 970,
        prefilledTokens: 30, reuseRatio: 0.97, ttftMs: { p50: 12.4, p95: 30, p99: 41 }, latencyMs: { p50: 80, p95: 120, p99: 150 },
        cacheBytes: 3 * 2 ** 20, sessions: { active: 1, rebases: 2 }, accepted: 4,
    };

    test('progress moves starting -> loading -> ready, and a served suggestion means ready', () => {
        const progress = new ServerProgress();
        progress.starting();
        assert.equal(progress.state, 'starting');
        progress.progress('load', { kind: 'begin', title: 'Loading model', percentage: 0 });
        progress.progress('load', { kind: 'report', message: 'weights', percentage: 40 });
        assert.equal(progress.state, 'loading');
        assert.equal(progress.detail, 'Loading model: weights 40%');
        progress.progress('load', { kind: 'end' });
        assert.equal(progress.state, 'ready');
        const other = new ServerProgress();
        other.starting();
        other.served();
        assert.equal(other.state, 'ready');
    });

    test('status line shows latency and reuse when ready, and off when disabled', () => {
        const progress = new ServerProgress();
        progress.starting();
        progress.served();
        assert.equal(statusLine(progress, true, 42.4, stats).text, '$(check) efim 42 ms · reuse 97%');
        assert.match(statusLine(progress, false, 42, stats).text, /circle-slash/);
        progress.stopped('error', 'boom');
        assert.equal(statusLine(progress, true).tooltip, 'boom');
    });

    test('formatted stats show every counter, unknown ones included', () => {
        const text = formatStats(stats);
        for (const piece of ['requests 10', 'served 8', 'typing-through 3', 'reuse 97.0%', 'p50 12 ms', 'p99 150 ms', '3.0 MiB', '2 rebases', 'accepted: 4']) {
            assert.ok(text.includes(piece), `${piece} missing from:\n${text}`);
        }
    });
});

/** A hand-driven clock: `advance(ms)` runs the timers that come due, in order. */
class FakeTimers implements Timers {
    now = 0;
    private next = 1;
    private readonly timers = new Map<number, { at: number; callback: () => void }>();
    setTimeout(callback: () => void, ms: number): unknown {
        const id = this.next++;
        this.timers.set(id, { at: this.now + ms, callback });
        return id;
    }
    clearTimeout(handle: unknown): void {
        this.timers.delete(handle as number);
    }
    get active(): number {
        return this.timers.size;
    }
    advance(ms: number): void {
        const end = this.now + ms;
        for (;;) {
            const due = [...this.timers.entries()].filter(([, t]) => t.at <= end).sort((a, b) => a[1].at - b[1].at)[0];
            if (!due) break;
            this.timers.delete(due[0]);
            this.now = due[1].at;
            due[1].callback();
        }
        this.now = end;
    }
}

describe('cursor notification', () => {
    const at = (line: number, character: number) => ({ line, character });
    const note = (uri: string, version: number, line: number, character: number) => ({
        kind: 'notification',
        method: 'efim/didMoveCursor',
        params: { textDocument: { uri, version }, position: at(line, character) },
    });
    const setup = () => {
        const timers = new FakeTimers();
        const sender = new RecordingSender();
        return { timers, sender, cursor: new CursorReporter(sender, { delayMs: 80, timers }) };
    };

    test('the debouncer fires the latest value once, delay after the last schedule', () => {
        const timers = new FakeTimers();
        const fired: number[] = [];
        const debouncer = new Debouncer<number>(80, (v) => fired.push(v), timers);
        debouncer.schedule(1);
        timers.advance(50);
        debouncer.schedule(2);
        timers.advance(79);
        assert.deepEqual(fired, []);
        assert.equal(debouncer.pending, 2);
        timers.advance(1);
        assert.deepEqual(fired, [2]);
        assert.equal(debouncer.pending, undefined);
        assert.equal(timers.active, 0);
        debouncer.schedule(3);
        debouncer.cancel();
        timers.advance(1000);
        assert.deepEqual(fired, [2]);
        debouncer.schedule(4);
        debouncer.flush();
        assert.deepEqual(fired, [2, 4]);
        assert.equal(timers.active, 0);
    });

    test('a burst of moves sends one notification with the last position and the version', () => {
        const { timers, sender, cursor } = setup();
        for (let c = 0; c < 10; c++) {
            cursor.selectionChanged('file:///a.py', 3, at(4, c));
            timers.advance(10);
        }
        assert.deepEqual(sender.sent, []);
        timers.advance(80);
        assert.deepEqual(sender.sent, [note('file:///a.py', 3, 4, 9)]);
        assert.equal(cursor.sent, 1);
    });

    test('the same document version and position is not sent twice; switching documents is', () => {
        const { timers, sender, cursor } = setup();
        cursor.selectionChanged('file:///a.py', 1, at(2, 5));
        timers.advance(100);
        cursor.activated('file:///a.py', 1, at(2, 5));
        timers.advance(100);
        cursor.activated('file:///b.py', 7, at(0, 0));
        timers.advance(100);
        cursor.activated('file:///a.py', 1, at(2, 5));
        timers.advance(100);
        assert.deepEqual(sender.sent, [note('file:///a.py', 1, 2, 5), note('file:///b.py', 7, 0, 0), note('file:///a.py', 1, 2, 5)]);
        cursor.reset(); // a new server: the same place is news to it
        cursor.activated('file:///a.py', 1, at(2, 5));
        timers.advance(100);
        assert.equal(sender.sent.length, 4);
    });

    test('the move an edit causes is not sent; a move after the edit is, at the new version', () => {
        const { timers, sender, cursor } = setup();
        const insert = (line: number, character: number, text: string) => [{ range: { start: at(line, character), end: at(line, character) }, text }];
        cursor.selectionChanged('file:///a.py', 1, at(3, 0)); // a move, then typing before it fires
        timers.advance(40);
        cursor.edited('file:///a.py', 2, insert(3, 0, 'x'));
        cursor.selectionChanged('file:///a.py', 2, at(3, 1));
        cursor.edited('file:///a.py', 3, insert(3, 1, 'y'));
        cursor.selectionChanged('file:///a.py', 3, at(3, 2));
        timers.advance(500);
        assert.deepEqual(sender.sent, [], 'the edit superseded the pending move and caused the others');
        cursor.selectionChanged('file:///a.py', 3, at(3, 1)); // arrow left
        timers.advance(100);
        assert.deepEqual(sender.sent, [note('file:///a.py', 3, 3, 1)]);
        // An edit that leaves the cursor where it was (delete forward): the next move still counts.
        cursor.edited('file:///a.py', 4, [{ range: { start: at(3, 1), end: at(3, 2) }, text: '' }]);
        cursor.selectionChanged('file:///a.py', 4, at(3, 0));
        timers.advance(100);
        assert.deepEqual(sender.sent.at(-1), note('file:///a.py', 4, 3, 0));
        // A multi-line paste ends on a later line: the cursor there is the edit's.
        cursor.edited('file:///a.py', 5, insert(3, 0, 'a\nbc'));
        cursor.selectionChanged('file:///a.py', 5, at(4, 2));
        timers.advance(100);
        assert.equal(sender.sent.length, 2);
    });

    test('a failed send is reported and the reporter goes on', async () => {
        const timers = new FakeTimers();
        const errors: unknown[] = [];
        let calls = 0;
        const failing: Sender = {
            sendRequest: async () => null,
            sendNotification: async () => {
                calls += 1;
                throw new Error('connection closed');
            },
        };
        const cursor = new CursorReporter(failing, { delayMs: 80, timers, onError: (e) => errors.push(e) });
        cursor.activated('file:///a.py', 1, at(0, 0));
        timers.advance(80);
        cursor.activated('file:///a.py', 1, at(1, 0));
        timers.advance(80);
        await new Promise((resolve) => setImmediate(resolve));
        assert.equal(calls, 2);
        assert.equal(errors.length, 2);
    });
});
