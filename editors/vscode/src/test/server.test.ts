/**
 * Integration test: the client's launch and request code against the real
 * `efim serve` (a tiny random model), over stdio, the way the extension runs it.
 *
 * Environment:
 *   EFIM_SERVER          the efim executable (default: <repo>/.venv/bin/efim, else `efim` on PATH)
 *   EFIM_TEST_MODEL      a model folder (default: a tiny model built with <repo>/.venv/bin/python)
 *   EFIM_REQUIRE_SERVER  "1": a missing server or model fails the test instead of skipping it
 */
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import * as path from 'node:path';
import { test } from 'node:test';
import {
    CancellationTokenSource,
    createProtocolConnection,
    InitializeRequest,
    InlineCompletionItem,
    InlineCompletionTriggerKind,
    ProtocolConnection,
    StreamMessageReader,
    StreamMessageWriter,
    TextDocumentSyncKind,
    WorkDoneProgress,
    WorkDoneProgressCreateRequest,
} from 'vscode-languageserver-protocol/node';
import { CompletionReporter, requestInlineCompletion } from '../core/completions';
import { CursorReporter } from '../core/cursor';
import { serverLaunch, spawnServer } from '../core/launch';
import { StatsRequest } from '../core/protocol';
import { readSettings, serverOptions } from '../core/settings';
import { ServerProgress } from '../core/status';

const REPO = path.resolve(__dirname, '..', '..', '..', '..');
const REQUIRED = process.env.EFIM_REQUIRE_SERVER === '1';
const DEADLINE_MS = 45_000;

function findServer(): string | undefined {
    if (process.env.EFIM_SERVER) return process.env.EFIM_SERVER;
    const venv = path.join(REPO, '.venv', 'bin', 'efim');
    return existsSync(venv) ? venv : 'efim';
}

/** A model folder: EFIM_TEST_MODEL, or a tiny one built by the repo's own helper (removed afterwards). */
function findModel(): { dir?: string; cleanup: () => void; reason?: string } {
    if (process.env.EFIM_TEST_MODEL) return { dir: process.env.EFIM_TEST_MODEL, cleanup: () => {} };
    const python = path.join(REPO, '.venv', 'bin', 'python');
    if (!existsSync(python)) return { cleanup: () => {}, reason: `no EFIM_TEST_MODEL and no ${python} to build a tiny model` };
    const tmp = mkdtempSync(path.join(tmpdir(), 'efim-vscode-model-'));
    const cleanup = () => rmSync(tmp, { recursive: true, force: true });
    try {
        const out = execFileSync(
            python,
            ['-c', 'import sys; from pathlib import Path; from tiny_models import make_tiny_model; print(make_tiny_model(Path(sys.argv[1]), "llama"))', tmp],
            { cwd: REPO, encoding: 'utf8', timeout: 120_000, stdio: ['ignore', 'pipe', 'pipe'] },
        );
        return { dir: out.trim().split('\n').pop(), cleanup };
    } catch (err) {
        cleanup();
        return { cleanup: () => {}, reason: `building a tiny model failed: ${err instanceof Error ? err.message : err}` };
    }
}

/** The editor's copy of one document, edited the way a user types (one incremental change per key). */
class EditorDocument {
    version = 1;
    constructor(readonly uri: string, public text: string) {}

    position(offset: number): { line: number; character: number } {
        const before = this.text.slice(0, offset).split('\n');
        return { line: before.length - 1, character: before[before.length - 1].length };
    }

    offset(pos: { line: number; character: number }): number {
        const lines = this.text.split('\n');
        let offset = 0;
        for (let i = 0; i < pos.line; i++) offset += lines[i].length + 1;
        return offset + pos.character;
    }

    /** Replaces [start, end) with `text`; returns the didChange params. */
    replace(start: number, end: number, text: string) {
        const range = { start: this.position(start), end: this.position(end) };
        this.text = this.text.slice(0, start) + text + this.text.slice(end);
        this.version += 1;
        return { textDocument: { uri: this.uri, version: this.version }, contentChanges: [{ range, text }] };
    }

    insert(offset: number, text: string) {
        return this.replace(offset, offset, text);
    }
}

function withTimeout<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
    let timer: NodeJS.Timeout;
    return Promise.race([
        promise,
        new Promise<T>((_, reject) => {
            timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms);
        }),
    ]).finally(() => clearTimeout(timer));
}

test('open, type, request, receive a suggestion, report show and accept against efim serve', { timeout: DEADLINE_MS + 15_000 }, async (t) => {
    const serverPath = findServer();
    const model = findModel();
    t.after(model.cleanup);
    if (!model.dir) {
        if (REQUIRED) assert.fail(model.reason);
        t.skip(model.reason);
        return;
    }
    const settings = readSettings(
        (key) => ({ serverPath, model: model.dir, maxTokens: 12, temperature: 0, multiline: 'never' } as Record<string, unknown>)[key],
    );
    let launch;
    try {
        launch = serverLaunch(settings);
    } catch (err) {
        if (REQUIRED) throw err;
        t.skip(`efim server unavailable: ${err instanceof Error ? err.message : err}`);
        return;
    }

    const log: string[] = [];
    const child = await spawnServer(launch, { cwd: REPO, onStderr: (line) => log.push(line) });
    const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
    const connection: ProtocolConnection = createProtocolConnection(new StreamMessageReader(child.stdout!), new StreamMessageWriter(child.stdin!));
    t.after(() => {
        connection.dispose();
        if (child.exitCode === null) child.kill('SIGKILL');
    });
    // Every wait below also ends if the server dies, with its log in the message.
    let shuttingDown = false;
    const died = exited.then((code) => {
        if (!shuttingDown) throw new Error(`efim serve exited early (code ${code})\n--- server stderr ---\n${log.slice(-40).join('\n')}`);
        return undefined as never;
    });
    died.catch(() => {});
    const call = <T>(promise: Promise<T>, ms: number, what: string) =>
        withTimeout(Promise.race([promise, died]), ms, what).catch((err: Error & { code?: number }) => {
            err.message = `${what}: ${err.message}\n--- server stderr (last 40 lines) ---\n${log.slice(-40).join('\n')}`;
            throw err;
        });
    const failWith = (message: string) => assert.fail(`${message}\n--- server stderr (last 40 lines) ---\n${log.slice(-40).join('\n')}`);

    const progress = new ServerProgress();
    const progressKinds: string[] = [];
    const messages: { type: number; message: string }[] = [];
    connection.onRequest(WorkDoneProgressCreateRequest.type, ({ token }) => {
        connection.onProgress(WorkDoneProgress.type, token, (value) => {
            progressKinds.push(value.kind);
            progress.progress(token, value);
        });
    });
    connection.onRequest('workspace/configuration', (params: { items: unknown[] }) => params.items.map(() => serverOptions(settings)));
    connection.onRequest('client/registerCapability', () => null);
    connection.onNotification('window/showMessage', (m: { type: number; message: string }) => {
        messages.push(m);
    });
    connection.onNotification('window/logMessage', (m: { message: string }) => {
        log.push(`[logMessage] ${m.message}`);
    });
    connection.listen();

    progress.starting();
    const init = await call(
        connection.sendRequest(InitializeRequest.type, {
            processId: process.pid,
            rootUri: null,
            workspaceFolders: null,
            initializationOptions: serverOptions(settings),
            capabilities: {
                general: { positionEncodings: ['utf-16'] },
                window: { workDoneProgress: true },
                textDocument: {
                    synchronization: { dynamicRegistration: false },
                    inlineCompletion: { dynamicRegistration: false },
                },
            },
        }),
        10_000,
        'initialize',
    );
    assert.ok(init.capabilities.inlineCompletionProvider, 'server does not advertise inlineCompletionProvider');
    const sync = init.capabilities.textDocumentSync;
    assert.equal(typeof sync === 'object' ? sync.change : sync, TextDocumentSyncKind.Incremental);
    await connection.sendNotification('initialized', {});

    const doc = new EditorDocument('file:///work/example.py', 'import os\n\n\n\nif __name__ == "__main__":\n    main()\n');
    await connection.sendNotification('textDocument/didOpen', {
        textDocument: { uri: doc.uri, languageId: 'python', version: doc.version, text: doc.text },
    });

    // Where the cursor is before typing, as the extension reports it (debounced), and one for a
    // document the server does not know: the server takes both without an error and keeps serving.
    const cursorErrors: unknown[] = [];
    const moves = new CursorReporter(connection, { onError: (err) => cursorErrors.push(err) });
    moves.activated(doc.uri, doc.version, { line: 2, character: 0 });
    await new Promise((resolve) => setTimeout(resolve, 150));
    moves.activated('file:///work/not-open.py', 1, { line: 40, character: 3 });
    await new Promise((resolve) => setTimeout(resolve, 150));
    assert.equal(moves.sent, 2);
    assert.deepEqual(cursorErrors, []);

    // Type a function one key at a time, asking after every key as VS Code does, until a suggestion comes back.
    const body = 'def total_size(paths):\n    size = 0\n    for path in paths:\n        size += os.path.getsize(path)\n    return size\n';
    const start = Date.now();
    let cursor = doc.offset({ line: 2, character: 0 });
    let typed = 0;
    let requests = 0;
    let suggestion: { item: InlineCompletionItem; cursor: number } | undefined;
    while (!suggestion && Date.now() - start < DEADLINE_MS) {
        if (typed < body.length) {
            await connection.sendNotification('textDocument/didChange', doc.insert(cursor, body[typed]));
            cursor += 1;
            typed += 1;
        } else {
            await new Promise((resolve) => setTimeout(resolve, 200)); // all typed: wait for the model, asking again
        }
        const params = {
            textDocument: { uri: doc.uri },
            position: doc.position(cursor),
            context: { triggerKind: InlineCompletionTriggerKind.Automatic },
        };
        const result = await call(requestInlineCompletion(connection, params), 15_000, `inlineCompletion ${JSON.stringify(params)}`);
        requests += 1;
        if (result.items.length > 0) {
            progress.served();
            suggestion = { item: result.items[0], cursor };
        }
    }
    if (!suggestion) failWith(`no suggestion after ${requests} requests in ${DEADLINE_MS} ms (progress: ${progress.state} ${progress.detail})`);
    const { item } = suggestion!;
    assert.equal(progress.state, 'ready');

    // The item replaces exactly its range: it must touch the cursor and stay on the cursor's line.
    const at = doc.position(suggestion!.cursor);
    const text = typeof item.insertText === 'string' ? item.insertText : item.insertText.value;
    const range = item.range ?? { start: at, end: at };
    assert.equal(range.start.line, at.line);
    assert.equal(range.end.line, at.line);
    assert.ok(range.start.character <= at.character && at.character <= range.end.character, JSON.stringify({ range, at }));
    assert.ok(text.trim().length > 0, 'empty suggestion');

    // Report the show, a one-character partial accept, then the full accept, as the editor would.
    const reporter = new CompletionReporter(connection);
    await reporter.shown(item);
    await reporter.partiallyAccepted(item, 1);
    await call(reporter.accepted(item), 5_000, 'accept report');

    // The editor applies the accepted item; the server's copy follows and it keeps answering.
    const before = doc.text;
    const [from, to] = [doc.offset(range.start), doc.offset(range.end)];
    await connection.sendNotification('textDocument/didChange', doc.replace(from, to, text));
    cursor = from + text.length;
    assert.equal(doc.text, before.slice(0, from) + text + before.slice(to));
    const next = await call(
        requestInlineCompletion(connection, {
            textDocument: { uri: doc.uri },
            position: doc.position(cursor),
            context: { triggerKind: InlineCompletionTriggerKind.Automatic },
        }),
        15_000,
        'inlineCompletion after accept',
    );
    requests += 1;
    for (const again of next.items) assert.equal(again.range?.start.line ?? doc.position(cursor).line, doc.position(cursor).line);

    // A request cancelled at once gets an answer or a cancellation error, never a hang.
    const source = new CancellationTokenSource();
    const cancelled = requestInlineCompletion(
        connection,
        { textDocument: { uri: doc.uri }, position: doc.position(cursor), context: { triggerKind: InlineCompletionTriggerKind.Invoked } },
        source.token,
    ).then(
        () => 'answered',
        (err: { code?: number }) => `error ${err.code}`,
    );
    source.cancel();
    assert.match(await call(cancelled, 10_000, 'cancelled request'), /^(answered|error -32800)$/);

    const stats = await call(connection.sendRequest(StatsRequest, {}), 5_000, 'efim/stats');
    assert.ok(stats.requests >= requests, `stats.requests ${stats.requests} < ${requests} sent`);
    assert.ok(stats.served >= 1, `stats.served ${stats.served}`);
    assert.ok(stats.reuseRatio >= 0 && stats.reuseRatio <= 1, `reuseRatio ${stats.reuseRatio}`);
    for (const key of ['ttftMs', 'latencyMs'] as const) {
        for (const p of ['p50', 'p95', 'p99'] as const) assert.equal(typeof stats[key][p], 'number', `${key}.${p}`);
    }
    // The reports above reached the server's counters.
    assert.equal(stats.shown, 1, 'didShowCompletion not counted');
    assert.equal(stats.partiallyAccepted, 1, 'didPartiallyAcceptCompletion not counted');
    assert.equal(stats.accepted, 1, 'the accept command was not counted');
    assert.deepEqual(messages.filter((m) => m.type === 1), [], 'server showed an error message');
    // The model loaded in the background with work-done progress that began and ended.
    assert.equal(progressKinds[0], 'begin', `progress: ${progressKinds}`);
    assert.equal(progressKinds[progressKinds.length - 1], 'end', `progress: ${progressKinds}`);

    // Settings changes go out in the same flat camelCase shape; the server reads them (a bad value is reported).
    const warned = new Promise<string>((resolve) => {
        connection.onNotification('window/showMessage', (m: { type: number; message: string }) => {
            if (m.message.includes('maxTokens')) resolve(m.message);
        });
    });
    await connection.sendNotification('workspace/didChangeConfiguration', { settings: { ...serverOptions(settings), maxTokens: 0 } });
    assert.match(await call(warned, 5_000, 'a warning about maxTokens=0'), /maxTokens/);

    await call(connection.sendRequest('shutdown'), 5_000, 'shutdown');
    shuttingDown = true;
    await connection.sendNotification('exit');
    assert.equal(await withTimeout(exited, 5_000, 'server exit after shutdown/exit'), 0);
    t.diagnostic(`suggestion after ${requests} requests: ${JSON.stringify(text)}`);
});
