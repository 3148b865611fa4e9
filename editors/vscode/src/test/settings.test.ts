/**
 * Integration test: a settings change reaches the running server and takes
 * effect without a restart, through the extension's own decision
 * (`settingsAction`) and message (`sendSettings`).
 *
 * The server is efim's real server code with the in-test fake engine
 * (tests/lsp/lsp_fake_server.py), whose every suggestion is the same text cut at
 * `maxTokens` tokens of 4 characters, so the effect of `maxTokens` is exact.
 *
 * Environment:
 *   EFIM_PYTHON          a Python that can import efim_lsp (default: <repo>/.venv/bin/python;
 *                        the repository is put first on PYTHONPATH)
 *   EFIM_REQUIRE_SERVER  "1": a missing Python fails the test instead of skipping it
 */
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import * as path from 'node:path';
import { test } from 'node:test';
import {
    createProtocolConnection,
    InitializeRequest,
    InlineCompletionTriggerKind,
    ProtocolConnection,
    StreamMessageReader,
    StreamMessageWriter,
} from 'vscode-languageserver-protocol/node';
import { requestInlineCompletion } from '../core/completions';
import { spawnServer } from '../core/launch';
import { readSettings, sendSettings, serverOptions, settingsAction } from '../core/settings';

const REPO = path.resolve(__dirname, '..', '..', '..', '..');
const FAKE_SERVER = path.join(REPO, 'tests', 'lsp', 'lsp_fake_server.py');
const SUGGESTION = 'value = compute(x)';

function withTimeout<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
    let timer: NodeJS.Timeout;
    return Promise.race([
        promise,
        new Promise<T>((_, reject) => {
            timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms);
        }),
    ]).finally(() => clearTimeout(timer));
}

test('a changed maxTokens applies to the running server without a restart', { timeout: 60_000 }, async (t) => {
    const python = process.env.EFIM_PYTHON ?? path.join(REPO, '.venv', 'bin', 'python');
    if (!existsSync(python) || !existsSync(FAKE_SERVER)) {
        const reason = `needs ${python} and ${FAKE_SERVER}`;
        if (process.env.EFIM_REQUIRE_SERVER === '1') assert.fail(reason);
        t.skip(reason);
        return;
    }
    const log: string[] = [];
    const env = { ...process.env, PYTHONPATH: [REPO, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter), EFIM_FAKE_TEXT: `${SUGGESTION}\n` };
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

    const before = readSettings((key) => ({ model: 'fake', maxTokens: 12, multiline: 'never' } as Record<string, unknown>)[key]);
    await call(
        connection.sendRequest(InitializeRequest.type, {
            processId: process.pid,
            rootUri: null,
            workspaceFolders: null,
            initializationOptions: serverOptions(before),
            capabilities: { textDocument: { inlineCompletion: { dynamicRegistration: false } } },
        }),
        'initialize',
    );
    await connection.sendNotification('initialized', {});

    /** Opens a fresh document (no earlier suggestion to type through) and asks at its end until the model answers. */
    let docs = 0;
    const suggestionInNewDocument = async (): Promise<string> => {
        const uri = `file:///work/doc${++docs}.py`;
        await connection.sendNotification('textDocument/didOpen', { textDocument: { uri, languageId: 'python', version: 1, text: 'x = 1\n' } });
        const deadline = Date.now() + 20_000;
        for (;;) {
            const params = { textDocument: { uri }, position: { line: 1, character: 0 }, context: { triggerKind: InlineCompletionTriggerKind.Invoked } };
            const result = await call(requestInlineCompletion(connection, params), 'inlineCompletion');
            if (result.items.length > 0) {
                const item = result.items[0];
                return typeof item.insertText === 'string' ? item.insertText : item.insertText.value;
            }
            assert.ok(Date.now() < deadline, 'no suggestion: the fake model never came up');
            await new Promise((resolve) => setTimeout(resolve, 100));
        }
    };

    assert.equal(await suggestionInNewDocument(), SUGGESTION);
    const pid = child.pid;

    // The user sets efim.maxTokens to 2: the extension decides on a notification, not a restart.
    const after = { ...before, maxTokens: 2 };
    assert.equal(settingsAction(before, after, true), 'notify');
    await sendSettings(connection, after);
    // two 4-character tokens of the fake model ("value = "), a line cut short: shown up to its last whole word
    assert.equal(await suggestionInNewDocument(), 'value =', 'maxTokens 2 = two tokens of the fake model');

    // Back to 12, same process all along.
    await sendSettings(connection, before);
    assert.equal(await suggestionInNewDocument(), SUGGESTION);
    assert.equal(child.pid, pid);
    assert.equal(child.exitCode, null);
});
