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
import { CursorReporter } from './core/cursor';
import { serverLaunch, spawnServer } from './core/launch';
import { EfimStats, StatsRequest } from './core/protocol';
import { ClientSettings, readSettings, sendSettings, serverOptions, settingsAction } from './core/settings';
import { formatStats, ServerProgress, statusLine } from './core/status';

const ACCEPTED_COMMAND = 'efim._accepted';
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

class EfimExtension implements vscode.Disposable {
    private settings = currentSettings();
    private client?: LanguageClient;
    private reporter?: CompletionReporter;
    private cursor?: CursorReporter;
    private readonly tracker = new PartialAcceptTracker();
    private readonly progress = new ServerProgress();
    private readonly output = vscode.window.createOutputChannel('efim', { log: true });
    private readonly status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
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
        if (!this.cursor || !editor || !this.tracksCursor(editor.document)) return;
        this.cursor.activated(editor.document.uri.toString(), editor.document.version, editor.selection.active);
    }

    private documentChanged(e: vscode.TextDocumentChangeEvent): void {
        if (e.contentChanges.length === 0) return;
        this.cursor?.edited(e.document.uri.toString(), e.document.version, e.contentChanges);
        const partial = this.tracker.changed(e.document.uri.toString(), e.contentChanges);
        if (partial && this.reporter) {
            void this.reporter.partiallyAccepted(partial.item, partial.acceptedLength).catch((err) => this.output.warn(`didPartiallyAcceptCompletion: ${err}`));
        }
    }

    private async settingsChanged(): Promise<void> {
        const before = this.settings;
        this.settings = currentSettings();
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
