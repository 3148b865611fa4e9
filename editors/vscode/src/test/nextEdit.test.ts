/**
 * Next edits (core/nextEdit.ts): unit tests of the decisions, then the flow the extension
 * runs against efim's real server code (tests/lsp/lsp_fake_server.py: next edits need no
 * model) — a rename typed key by key, the edit asked for with the document's version, shown,
 * jumped to, applied and accepted; an answer for an old version and a stale edit dropped.
 *
 * Environment:
 *   EFIM_PYTHON          a Python that can import efim_lsp (default: <repo>/.venv/bin/python)
 *   EFIM_REQUIRE_SERVER  "1": a missing Python fails the test instead of skipping it
 */
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import * as path from 'node:path';
import { describe, test } from 'node:test';
import {
    CancellationToken,
    createProtocolConnection,
    InitializeRequest,
    ProtocolConnection,
    Range,
    StreamMessageReader,
    StreamMessageWriter,
} from 'vscode-languageserver-protocol/node';
import type { Sender } from '../core/completions';
import { spawnServer } from '../core/launch';
import { NextEditReporter, nextEditAction, requestNextEdit, ShownNextEdit, supportsNextEdits } from '../core/nextEdit';
import { InlineEdit, StatsRequest } from '../core/protocol';

const REPO = path.resolve(__dirname, '..', '..', '..', '..');
const FAKE_SERVER = path.join(REPO, 'tests', 'lsp', 'lsp_fake_server.py');
const URI = 'file:///work/totals.py';

/** Answers requests from a table and records what was sent. */
class TableSender implements Sender {
    readonly sent: { method: string; params: unknown }[] = [];
    constructor(private readonly answers: Record<string, unknown>) {}
    async sendRequest(method: string, ...args: unknown[]): Promise<unknown> {
        if (args.length > 1 && CancellationToken.is(args[args.length - 1])) args = args.slice(0, -1);
        this.sent.push({ method, params: args.length === 1 ? args[0] : args });
        return this.answers[method] ?? null;
    }
    async sendNotification(method: string, params: unknown): Promise<void> {
        this.sent.push({ method, params });
    }
}

/** A document as the editor holds it: text, version, LSP positions (UTF-16 as VS Code's). */
class Doc {
    version = 1;
    constructor(readonly uri: string, public text: string) {}

    offset(pos: { line: number; character: number }): number {
        const lines = this.text.split('\n');
        let offset = 0;
        for (let i = 0; i < pos.line; i++) offset += lines[i].length + 1;
        return offset + pos.character;
    }

    position(offset: number): { line: number; character: number } {
        const before = this.text.slice(0, offset).split('\n');
        return { line: before.length - 1, character: before[before.length - 1].length };
    }

    getText(range: Range): string {
        return this.text.slice(this.offset(range.start), this.offset(range.end));
    }

    /** Replaces [start, end); returns the didChange params. */
    replace(start: number, end: number, text: string) {
        const range = { start: this.position(start), end: this.position(end) };
        this.text = this.text.slice(0, start) + text + this.text.slice(end);
        this.version += 1;
        return { textDocument: { uri: this.uri, version: this.version }, contentChanges: [{ range, text }] };
    }
}

const EDIT: InlineEdit = {
    text: 'count',
    textDocument: { uri: URI, version: 7 },
    range: { start: { line: 3, character: 8 }, end: { line: 3, character: 9 } },
    command: { title: 'accept', command: 'efim.acceptInlineEdit', arguments: [4] },
};

describe('next edits', () => {
    test('the server must list the accept command', () => {
        assert.equal(supportsNextEdits({ executeCommandProvider: { commands: ['efim.acceptInlineEdit'] } }), true);
        assert.equal(supportsNextEdits({ executeCommandProvider: { commands: ['other'] } }), false);
        assert.equal(supportsNextEdits({}), false);
        assert.equal(supportsNextEdits(undefined), false);
    });

    test('an answer for another document or version, or a malformed one, gives no edit', async () => {
        const params = { textDocument: { uri: URI, version: 7 }, position: { line: 1, character: 9 } };
        const ask = (answer: unknown) => requestNextEdit(new TableSender({ 'textDocument/copilotInlineEdit': answer }), params);
        assert.deepEqual(await ask({ edits: [EDIT] }), EDIT);
        assert.equal(await ask({ edits: [] }), undefined);
        assert.equal(await ask(null), undefined);
        assert.equal(await ask({ edits: [{ ...EDIT, textDocument: { uri: URI, version: 6 } }] }), undefined);
        assert.equal(await ask({ edits: [{ ...EDIT, textDocument: { uri: 'file:///other.py', version: 7 } }] }), undefined);
        assert.equal(await ask({ edits: [{ ...EDIT, range: { start: { line: 3, character: 9 }, end: { line: 3, character: 8 } } }] }), undefined);
        assert.equal(await ask({ edits: [{ ...EDIT, text: undefined }] }), undefined);
    });

    test('the key jumps, then applies on the edit; a changed document makes it stale', () => {
        const doc = new Doc(URI, 'def total(values):\n    count = 0\n    for v in values:\n        n += v\n    return n\n');
        doc.version = 7;
        const shown: ShownNextEdit = { uri: URI, version: 7, edit: EDIT, rangeText: 'n' };
        const state = () => ({ uri: doc.uri, version: doc.version, getText: (r: Range) => doc.getText(r) });
        assert.equal(nextEditAction(shown, state(), { line: 1, character: 9 }), 'jump');
        assert.equal(nextEditAction(shown, state(), { line: 3, character: 8 }), 'apply');
        assert.equal(nextEditAction(shown, state(), { line: 3, character: 9 }), 'apply');
        assert.equal(nextEditAction(shown, state(), { line: 3, character: 10 }), 'jump');
        assert.equal(nextEditAction({ ...shown, rangeText: 'm' }, state(), { line: 3, character: 8 }), 'stale');
        doc.replace(0, 0, '# header\n');
        assert.equal(nextEditAction(shown, { ...state(), version: 7 }, { line: 3, character: 8 }), 'stale'); // same version, other text
        assert.equal(nextEditAction(shown, state(), { line: 3, character: 8 }), 'stale');
    });

    test('a show is reported once per edit; an apply runs the edit command', async () => {
        const sender = new TableSender({});
        const reporter = new NextEditReporter(sender);
        await reporter.shown(EDIT);
        await reporter.shown(EDIT);
        await reporter.accepted(EDIT);
        await reporter.accepted({ ...EDIT, command: undefined });
        assert.deepEqual(sender.sent, [
            { method: 'textDocument/didShowInlineEdit', params: { item: EDIT } },
            { method: 'workspace/executeCommand', params: { command: 'efim.acceptInlineEdit', arguments: [4] } },
        ]);
    });
});

function withTimeout<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
    let timer: NodeJS.Timeout;
    return Promise.race([
        promise,
        new Promise<T>((_, reject) => {
            timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms);
        }),
    ]).finally(() => clearTimeout(timer));
}

test('a rename typed key by key: the next use proposed, shown, jumped to, applied and accepted', { timeout: 60_000 }, async (t) => {
    const python = process.env.EFIM_PYTHON ?? path.join(REPO, '.venv', 'bin', 'python');
    if (!existsSync(python) || !existsSync(FAKE_SERVER)) {
        const reason = `needs ${python} and ${FAKE_SERVER}`;
        if (process.env.EFIM_REQUIRE_SERVER === '1') assert.fail(reason);
        t.skip(reason);
        return;
    }
    const log: string[] = [];
    const env = { ...process.env, PYTHONPATH: [REPO, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter) };
    const child = await spawnServer({ command: python, args: [FAKE_SERVER] }, { cwd: REPO, env, onStderr: (line) => log.push(line) });
    const connection: ProtocolConnection = createProtocolConnection(new StreamMessageReader(child.stdout!), new StreamMessageWriter(child.stdin!));
    t.after(() => {
        connection.dispose();
        if (child.exitCode === null) child.kill('SIGKILL');
    });
    const call = <T>(promise: Promise<T>, what: string) =>
        withTimeout(promise, 10_000, what).catch((err: Error) => {
            err.message += `\n--- server stderr ---\n${log.slice(-30).join('\n')}`;
            throw err;
        });
    connection.onRequest('workspace/configuration', (params: { items: unknown[] }) => params.items.map(() => null));
    connection.onRequest('client/registerCapability', () => null);
    connection.onRequest('window/workDoneProgress/create', () => null);
    connection.listen();

    const init = await call(
        connection.sendRequest(InitializeRequest.type, {
            processId: process.pid,
            rootUri: null,
            workspaceFolders: null,
            initializationOptions: { model: 'fake' },
            capabilities: { general: { positionEncodings: ['utf-16'] } },
        }),
        'initialize',
    );
    assert.ok(supportsNextEdits(init.capabilities as { executeCommandProvider?: { commands?: string[] } }), JSON.stringify(init.capabilities));
    await connection.sendNotification('initialized', {});

    const doc = new Doc(URI, 'def total(values):\n    n = 0\n    for v in values:\n        n += v\n    return n\n');
    await connection.sendNotification('textDocument/didOpen', { textDocument: { uri: doc.uri, languageId: 'python', version: doc.version, text: doc.text } });

    // `n` -> `count` at its first use, one key at a time (Backspace, then the new name).
    let at = doc.offset({ line: 1, character: 4 });
    await connection.sendNotification('textDocument/didChange', doc.replace(at, at + 1, ''));
    for (const ch of 'count') {
        await connection.sendNotification('textDocument/didChange', doc.replace(at, at, ch));
        at += 1;
    }
    const ask = () => requestNextEdit(connection, { textDocument: { uri: doc.uri, version: doc.version }, position: doc.position(at) });
    const edit = await call(ask(), 'copilotInlineEdit');
    assert.ok(edit, 'no next edit after the rename');
    assert.deepEqual(edit.range, { start: { line: 3, character: 8 }, end: { line: 3, character: 9 } });
    assert.equal(edit.text, 'count');
    const reporter = new NextEditReporter(connection);
    await reporter.shown(edit);
    const shown: ShownNextEdit = { uri: doc.uri, version: doc.version, edit, rangeText: doc.getText(edit.range) };
    const state = () => ({ uri: doc.uri, version: doc.version, getText: (r: Range) => doc.getText(r) });

    // The key: from the cursor after `count`, a jump; on the edit, an apply and its command.
    assert.equal(nextEditAction(shown, state(), doc.position(at)), 'jump');
    assert.equal(nextEditAction(shown, state(), edit.range.start), 'apply');
    const from = doc.offset(edit.range.start);
    await connection.sendNotification('textDocument/didChange', doc.replace(from, doc.offset(edit.range.end), edit.text));
    await call(reporter.accepted(edit), 'executeCommand');
    assert.equal(doc.text, 'def total(values):\n    count = 0\n    for v in values:\n        count += v\n    return n\n');

    // The next one (the third use); an answer asked for an older version is none, and once the
    // document changes elsewhere the one on screen is stale.
    const third = await call(ask(), 'copilotInlineEdit after the apply');
    assert.deepEqual(third?.range.start, { line: 4, character: 11 });
    const old = await call(requestNextEdit(connection, { textDocument: { uri: doc.uri, version: doc.version - 1 }, position: { line: 0, character: 0 } }), 'an old version');
    assert.equal(old, undefined);
    const shownThird: ShownNextEdit = { uri: doc.uri, version: doc.version, edit: third!, rangeText: doc.getText(third!.range) };
    await connection.sendNotification('textDocument/didChange', doc.replace(doc.text.length, doc.text.length, '# done\n'));
    assert.equal(nextEditAction(shownThird, state(), third!.range.start), 'stale');

    const counts = (await call(connection.sendRequest(StatsRequest, {}), 'efim/stats')).nextEdit as Record<string, number>;
    assert.equal(counts.shown, 1);
    assert.equal(counts.accepted, 1);
    assert.equal(counts.offered, 2);
    await call(connection.sendRequest('shutdown'), 'shutdown');
    await connection.sendNotification('exit');
});
