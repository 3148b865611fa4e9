/**
 * VS Code glue: settings, commands, the status bar, and vscode-languageclient
 * wired to the VS Code-free logic in `core/` (launch, requests, reports).
 * Inline completion itself is vscode-languageclient's built-in feature; the
 * middleware only adds the on/off switch, timing, and show/accept reports.
 */
import * as vscode from 'vscode';
import {
    ClientCapabilities,
    FeatureState,
    InlineCompletionItem as LspInlineCompletionItem,
    LanguageClient,
    LanguageClientOptions,
    State,
    StaticFeature,
    WorkDoneProgress,
    WorkDoneProgressCreateRequest,
} from 'vscode-languageclient/node';
import { CompletionReporter, PartialAcceptTracker, requestInlineCompletion } from './core/completions';
import { CursorReporter, Debouncer } from './core/cursor';
import { serverLaunch, spawnServer } from './core/launch';
import { NEXT_EDIT_DEBOUNCE_MS, NextEditReporter, nextEditAction, requestNextEdit, ShownNextEdit, supportsNextEdits } from './core/nextEdit';
import { EfimStats, InlineEdit, StatsRequest } from './core/protocol';
import { ClientSettings, readSettings, sendSettings, serverOptions, settingsAction } from './core/settings';
import { formatStats, ServerProgress, statusLine } from './core/status';

const ACCEPTED_COMMAND = 'efim._accepted';
const NEXT_EDIT_APPLY_COMMAND = 'efim.nextEdit.apply';
const NEXT_EDIT_DISMISS_COMMAND = 'efim.nextEdit.dismiss';
/** Context key for the keybindings: a next edit is drawn in the active editor. */
const NEXT_EDIT_CONTEXT = 'efim.nextEditVisible';
/** The documents the client syncs with the server (and so the only ones it reports a cursor for). */
const DOCUMENT_SELECTOR: vscode.DocumentFilter[] = [{ scheme: 'file' }, { scheme: 'untitled' }];

function currentSettings(): ClientSettings {
    const config = vscode.workspace.getConfiguration('efim');
    return readSettings((key) => config.get(key));
}

/**
 * Routes the server's work-done progress (model loading) to the status bar.
 * Registered after vscode-languageclient's own progress feature, so its
 * `window/workDoneProgress/create` handler replaces the default notification.
 */
class ProgressToStatus implements StaticFeature {
    constructor(
        private readonly client: LanguageClient,
        private readonly onProgress: (token: string | number, value: Parameters<ServerProgress['progress']>[1]) => void,
    ) {}

    fillClientCapabilities(capabilities: ClientCapabilities): void {
        capabilities.window = { ...capabilities.window, workDoneProgress: true };
    }

    initialize(): void {
        this.client.onRequest(WorkDoneProgressCreateRequest.type, ({ token }) => {
            const subscription = this.client.onProgress(WorkDoneProgress.type, token, (value) => {
                this.onProgress(token, value);
                if (value.kind === 'end') subscription.dispose();
            });
        });
    }

    getState(): FeatureState {
        return { kind: 'static' };
    }

    clear(): void {}
}

/**
 * Next edits in the editor (the logic is core/nextEdit.ts): asked for after a change to the
 * active editor's document (debounced), drawn with a decoration (the range struck through,
 * the new text after it), reported shown once; `efim.nextEdit.apply` jumps to the edit, and
 * run again with the cursor on it applies it and runs its command. A change to the
 * document, another active editor or `efim.nextEdit.dismiss` clears it.
 */
class NextEdits implements vscode.Disposable {
    private readonly decoration = vscode.window.createTextEditorDecorationType({
        backgroundColor: new vscode.ThemeColor('diffEditor.removedTextBackground'),
        textDecoration: 'line-through',
        rangeBehavior: vscode.DecorationRangeBehavior.ClosedClosed,
    });
    private readonly debouncer = new Debouncer<string>(NEXT_EDIT_DEBOUNCE_MS, (uri) => void this.request(uri));
    private client?: LanguageClient;
    private reporter?: NextEditReporter;
    private inflight?: vscode.CancellationTokenSource;
    private current?: { editor: vscode.TextEditor; shown: ShownNextEdit; range: vscode.Range };

    constructor(
        private readonly enabled: () => boolean,
        private readonly output: vscode.LogOutputChannel,
    ) {}

    /** The running client to ask (undefined: none). */
    attach(client: LanguageClient | undefined): void {
        this.clear();
        this.client = client;
        this.reporter = client ? new NextEditReporter(client) : undefined;
    }

    documentChanged(document: vscode.TextDocument): void {
        if (this.current?.shown.uri === document.uri.toString()) this.clear(); // stale now
        this.cancel();
        if (vscode.window.activeTextEditor?.document === document) this.debouncer.schedule(document.uri.toString());
    }

    activeEditorChanged(): void {
        this.debouncer.cancel();
        this.clear();
    }

    private cancel(): void {
        this.inflight?.cancel();
        this.inflight = undefined;
    }

    private async request(uri: string): Promise<void> {
        const client = this.client;
        const editor = vscode.window.activeTextEditor;
        if (!client || client.state !== State.Running || !this.enabled() || editor?.document.uri.toString() !== uri) return;
        if (!supportsNextEdits(client.initializeResult?.capabilities)) return;
        const document = editor.document;
        const version = document.version;
        const active = editor.selection.active;
        this.cancel();
        const source = new vscode.CancellationTokenSource();
        this.inflight = source;
        let edit: InlineEdit | undefined;
        let cancelled = false;
        try {
            edit = await requestNextEdit(client, { textDocument: { uri, version }, position: { line: active.line, character: active.character } }, source.token);
        } catch (err) {
            if (!source.token.isCancellationRequested) this.output.warn(`next edit failed: ${err instanceof Error ? err.message : err}`);
            return;
        } finally {
            cancelled = source.token.isCancellationRequested;
            if (this.inflight === source) this.inflight = undefined;
            source.dispose();
        }
        // Only an edit for the document state it was asked about may be drawn.
        if (!edit || cancelled || document.version !== version || vscode.window.activeTextEditor !== editor) return;
        this.show(editor, edit, version);
    }

    private show(editor: vscode.TextEditor, edit: InlineEdit, version: number): void {
        const { start, end } = edit.range;
        const range = new vscode.Range(start.line, start.character, end.line, end.character);
        const document = editor.document;
        if (!document.validateRange(range).isEqual(range)) return; // not a range of this text
        const rangeText = document.getText(range);
        if (rangeText === edit.text) return;
        this.clear();
        this.current = { editor, range, shown: { uri: document.uri.toString(), version, edit, rangeText } };
        editor.setDecorations(this.decoration, [{
            range,
            hoverMessage: 'efim: next edit — Alt+N (efim: Jump to / Apply Next Edit) jumps here, then applies it; Escape dismisses it',
            renderOptions: {
                after: {
                    contentText: edit.text.replace(/\n/g, '⏎'),
                    backgroundColor: new vscode.ThemeColor('diffEditor.insertedTextBackground'),
                    margin: '0 0 0 0.2em',
                },
            },
        }]);
        void vscode.commands.executeCommand('setContext', NEXT_EDIT_CONTEXT, true);
        void this.reporter?.shown(edit).catch((err) => this.output.warn(`didShowInlineEdit: ${err}`));
    }

    /** The next-edit key: jump to the edit, or apply it when the cursor is on it; a stale one is dropped. */
    async applyOrJump(): Promise<void> {
        const cur = this.current;
        const editor = vscode.window.activeTextEditor;
        if (!cur || !editor || editor.document !== cur.editor.document) return;
        const document = editor.document;
        const state = {
            uri: document.uri.toString(),
            version: document.version,
            getText: (r: { start: { line: number; character: number }; end: { line: number; character: number } }) =>
                document.getText(new vscode.Range(r.start.line, r.start.character, r.end.line, r.end.character)),
        };
        const action = nextEditAction(cur.shown, state, editor.selection.active);
        if (action === 'stale') {
            this.clear();
            return;
        }
        if (action === 'jump') {
            editor.selection = new vscode.Selection(cur.range.start, cur.range.start);
            editor.revealRange(cur.range, vscode.TextEditorRevealType.InCenterIfOutsideViewport);
            return;
        }
        this.clear();
        const startOffset = document.offsetAt(cur.range.start);
        const text = cur.shown.edit.text;
        if (!(await editor.edit((builder) => builder.replace(cur.range, text)))) return;
        const after = document.positionAt(startOffset + text.length);
        editor.selection = new vscode.Selection(after, after);
        await this.reporter?.accepted(cur.shown.edit).catch((err) => this.output.warn(`accepting a next edit: ${err}`));
    }

    clear(): void {
        if (!this.current) return;
        const { editor } = this.current;
        this.current = undefined;
        editor.setDecorations(this.decoration, []);
        void vscode.commands.executeCommand('setContext', NEXT_EDIT_CONTEXT, false);
    }

    dispose(): void {
        this.debouncer.cancel();
        this.cancel();
        this.clear();
        this.decoration.dispose();
    }
}

class EfimExtension implements vscode.Disposable {
    private settings = currentSettings();
    private client?: LanguageClient;
    private reporter?: CompletionReporter;
    private cursor?: CursorReporter;
    private readonly tracker = new PartialAcceptTracker();
    private readonly progress = new ServerProgress();
    private readonly output = vscode.window.createOutputChannel('efim', { log: true });
    private readonly status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
    private readonly nextEdits = new NextEdits(() => this.settings.enable, this.output);
    private readonly disposables: vscode.Disposable[] = [];
    private lastLatencyMs?: number;
    private lastStats?: EfimStats;
    private statsTimer?: NodeJS.Timeout;

    constructor() {
        this.status.command = 'efim.showStats';
        this.status.show();
        this.disposables.push(
            this.output,
            this.status,
            this.nextEdits,
            vscode.commands.registerCommand(NEXT_EDIT_APPLY_COMMAND, () => this.nextEdits.applyOrJump()),
            vscode.commands.registerCommand(NEXT_EDIT_DISMISS_COMMAND, () => this.nextEdits.clear()),
            vscode.commands.registerCommand('efim.toggle', () => this.toggle()),
            vscode.commands.registerCommand('efim.showStats', () => this.showStats()),
            vscode.commands.registerCommand('efim.restartServer', () => this.restart()),
            vscode.commands.registerCommand(ACCEPTED_COMMAND, (item: LspInlineCompletionItem) => this.accepted(item)),
            vscode.workspace.onDidChangeConfiguration((e) => {
                if (e.affectsConfiguration('efim')) void this.settingsChanged();
            }),
            vscode.workspace.onDidChangeTextDocument((e) => this.documentChanged(e)),
            vscode.window.onDidChangeTextEditorSelection((e) => this.selectionChanged(e)),
            vscode.window.onDidChangeActiveTextEditor((editor) => this.activeEditorChanged(editor)),
        );
        this.refreshStatus();
    }

    async start(): Promise<void> {
        if (this.client || !this.settings.enable) return;
        const client = this.createClient();
        this.client = client;
        this.reporter = new CompletionReporter(client);
        this.cursor = new CursorReporter(client, { onError: (err) => this.output.debug(`efim/didMoveCursor: ${err}`) });
        this.progress.starting();
        this.refreshStatus();
        try {
            await client.start();
            this.nextEdits.attach(client);
            this.activeEditorChanged(vscode.window.activeTextEditor); // where the user is when the server comes up
        } catch (err) {
            const message = err instanceof Error ? err.message : String(err);
            this.progress.stopped('error', message);
            this.refreshStatus();
            this.client = undefined;
            const choice = await vscode.window.showErrorMessage(message, 'Open Settings');
            if (choice) void vscode.commands.executeCommand('workbench.action.openSettings', 'efim.serverPath');
        }
    }

    async stop(): Promise<void> {
        const client = this.client;
        this.client = undefined;
        this.reporter = undefined;
        this.cursor?.dispose();
        this.cursor = undefined;
        this.tracker.clear();
        this.nextEdits.attach(undefined);
        if (client) await client.stop().catch((err) => this.output.warn(`stopping the server: ${err}`));
        this.progress.stopped();
        this.refreshStatus();
    }

    private createClient(): LanguageClient {
        const folder = vscode.workspace.workspaceFolders?.[0]?.uri.fsPath;
        const clientOptions: LanguageClientOptions = {
            documentSelector: [{ scheme: 'file' }, { scheme: 'untitled' }],
            outputChannel: this.output,
            initializationOptions: () => serverOptions(this.settings),
            middleware: {
                provideInlineCompletionItems: (document, position, context, token) =>
                    this.provideInlineCompletionItems(document, position, context, token),
            },
        };
        // A function server option: vscode-languageclient runs the same launch code the Node tests run.
        const client = new LanguageClient(
            'efim',
            'efim',
            // async: a missing executable becomes a rejected start with serverLaunch's fix-it message.
            async () => spawnServer(serverLaunch(this.settings, process.env, folder), { cwd: folder }),
            clientOptions,
        );
        client.registerFeature(new ProgressToStatus(client, (token, value) => {
            this.progress.progress(token, value);
            this.refreshStatus();
        }));
        client.onDidChangeState((e) => {
            if (e.newState === State.Stopped) this.progress.stopped();
            this.refreshStatus();
        });
        return client;
    }

    private async provideInlineCompletionItems(
        document: vscode.TextDocument,
        position: vscode.Position,
        context: vscode.InlineCompletionContext,
        token: vscode.CancellationToken,
    ): Promise<vscode.InlineCompletionList | null> {
        const client = this.client;
        const reporter = this.reporter;
        if (!client || !reporter || !this.settings.enable) return null;
        const params = client.code2ProtocolConverter.asInlineCompletionParams(document, position, context);
        let result;
        try {
            result = await requestInlineCompletion(client, params, token);
        } catch (err) {
            if (!token.isCancellationRequested) this.output.warn(`inline completion failed: ${err instanceof Error ? err.message : err}`);
            return null;
        }
        if (token.isCancellationRequested) return null;
        this.lastLatencyMs = result.latencyMs;
        if (result.items.length === 0) {
            this.scheduleStatsRefresh();
            return null;
        }
        this.progress.served();
        const items = result.items.map((raw) => {
            const item = client.protocol2CodeConverter.asInlineCompletionItem(raw);
            // VS Code runs an item's command after a full accept; ours reports it and then runs the server's.
            item.command = { title: 'efim: accepted', command: ACCEPTED_COMMAND, arguments: [raw] };
            return item;
        });
        // VS Code draws the first item that fits; that is the one reported as shown.
        void reporter.shown(result.items[0]).catch((err) => this.output.warn(`didShowCompletion: ${err}`));
        this.tracker.shown(document.uri.toString(), result.items[0], params.position);
        this.scheduleStatsRefresh();
        return new vscode.InlineCompletionList(items);
    }

    private async accepted(item: LspInlineCompletionItem): Promise<void> {
        this.tracker.clear();
        await this.reporter?.accepted(item).catch((err) => this.output.warn(`reporting an accept: ${err}`));
    }

    /** Whether the cursor notification applies: a running server, completions on, a document the client syncs. */
    private tracksCursor(document: vscode.TextDocument): boolean {
        return this.client?.state === State.Running && this.settings.enable && vscode.languages.match(DOCUMENT_SELECTOR, document) > 0;
    }

    private selectionChanged(e: vscode.TextEditorSelectionChangeEvent): void {
        const document = e.textEditor.document;
        if (!this.cursor || e.textEditor !== vscode.window.activeTextEditor || !this.tracksCursor(document)) return;
        this.cursor.selectionChanged(document.uri.toString(), document.version, e.selections[0].active);
    }

    private activeEditorChanged(editor: vscode.TextEditor | undefined): void {
        this.nextEdits.activeEditorChanged();
        if (!this.cursor || !editor || !this.tracksCursor(editor.document)) return;
        this.cursor.activated(editor.document.uri.toString(), editor.document.version, editor.selection.active);
    }

    private documentChanged(e: vscode.TextDocumentChangeEvent): void {
        if (e.contentChanges.length === 0) return;
        if (this.tracksCursor(e.document)) this.nextEdits.documentChanged(e.document);
        this.cursor?.edited(e.document.uri.toString(), e.document.version, e.contentChanges);
        const partial = this.tracker.changed(e.document.uri.toString(), e.contentChanges);
        if (partial && this.reporter) {
            void this.reporter.partiallyAccepted(partial.item, partial.acceptedLength).catch((err) => this.output.warn(`didPartiallyAcceptCompletion: ${err}`));
        }
    }

    private async settingsChanged(): Promise<void> {
        const before = this.settings;
        this.settings = currentSettings();
        if (!this.settings.enable) this.nextEdits.clear();
        switch (settingsAction(before, this.settings, this.client !== undefined)) {
            case 'start':
                await this.start();
                break;
            case 'restart':
                await this.restart();
                break;
            case 'notify':
                // Applied by the running server: no restart, documents and caches stay.
                if (this.client) await sendSettings(this.client, this.settings).catch((err) => this.output.warn(`didChangeConfiguration: ${err}`));
                break;
            case 'none':
                break;
        }
        this.refreshStatus();
    }

    private async toggle(): Promise<void> {
        // A setting rather than in-memory state, so the choice survives a reload and shows in the settings UI.
        await vscode.workspace.getConfiguration('efim').update('enable', !this.settings.enable, vscode.ConfigurationTarget.Global);
    }

    private async restart(): Promise<void> {
        await this.stop();
        await this.start();
    }

    private async fetchStats(): Promise<EfimStats | undefined> {
        if (!this.client || this.client.state !== State.Running) return undefined;
        try {
            this.lastStats = await this.client.sendRequest(StatsRequest, {});
        } catch (err) {
            this.output.warn(`efim/stats: ${err instanceof Error ? err.message : err}`);
        }
        return this.lastStats;
    }

    private scheduleStatsRefresh(): void {
        if (this.statsTimer) return;
        this.statsTimer = setTimeout(async () => {
            this.statsTimer = undefined;
            await this.fetchStats();
            this.refreshStatus();
        }, 1000);
    }

    private async showStats(): Promise<void> {
        const stats = await this.fetchStats();
        if (!stats) {
            void vscode.window.showWarningMessage('efim: the server is not running.');
            return;
        }
        this.output.info(`efim/stats\n${formatStats(stats)}`);
        this.output.show(true);
        this.refreshStatus();
    }

    private refreshStatus(): void {
        const line = statusLine(this.progress, this.settings.enable, this.lastLatencyMs, this.lastStats);
        this.status.text = line.text;
        this.status.tooltip = line.tooltip;
    }

    dispose(): void {
        if (this.statsTimer) clearTimeout(this.statsTimer);
        for (const d of this.disposables) d.dispose();
    }
}

let extension: EfimExtension | undefined;

export async function activate(context: vscode.ExtensionContext): Promise<void> {
    extension = new EfimExtension();
    context.subscriptions.push(extension);
    await extension.start();
}

export async function deactivate(): Promise<void> {
    await extension?.stop();
    extension = undefined;
}
