/**
 * Client settings and the flat camelCase options the server reads.
 *
 * This module (like everything under `core/`) never imports `vscode`, so the
 * Node tests can run it against the real `efim serve`.
 */

/** Server options the client knows by name; `null`/absent means "the server's default". */
export interface ServerOptions {
    model?: string | null;
    promptFormat?: 'efim' | 'fim' | null;
    maxTokens?: number | null;
    multiline?: 'auto' | 'never' | 'always' | null;
    fimTokens?: 'auto' | 'add' | null;
    adapter?: string | null;
    temperature?: number | null;
    prefixTokens?: number | null;
    suffixTokens?: number | null;
    cache?: boolean | null;
    debounceMs?: number | null;
    context?: 'off' | 'prefix' | 'blend' | null;
    /** Items per inline completion (1-4): VS Code cycles them with Alt+] / Alt+[. */
    alternatives?: number | null;
}

/** Everything the client reads from `efim.*`. */
export interface ClientSettings extends ServerOptions {
    /** Executable of the server; a bare name is looked up on PATH. */
    serverPath: string;
    /** Extra arguments after `serve` (e.g. `--log-file`). */
    serverArgs: string[];
    /** Whether completions are requested at all (`efim.toggle`). */
    enable: boolean;
    /** Raw key/value pairs passed through to the server unchanged, for options this client does not list. */
    serverSettings: Record<string, unknown>;
}

export const SERVER_OPTION_KEYS = [
    'model',
    'promptFormat',
    'maxTokens',
    'multiline',
    'fimTokens',
    'adapter',
    'temperature',
    'prefixTokens',
    'suffixTokens',
    'cache',
    'debounceMs',
    'context',
    'alternatives',
] as const satisfies readonly (keyof ServerOptions)[];

export const DEFAULT_SETTINGS: ClientSettings = {
    serverPath: 'efim',
    serverArgs: [],
    enable: true,
    serverSettings: {},
    model: 'default',
};

/** Reads one `efim.<key>` value; the VS Code side passes `workspace.getConfiguration('efim').get`. */
export type SettingReader = (key: string) => unknown;

/** Client settings from a reader, falling back to defaults for absent or mistyped values. */
export function readSettings(get: SettingReader): ClientSettings {
    const settings: ClientSettings = { ...DEFAULT_SETTINGS, serverArgs: [], serverSettings: {} };
    const path = get('serverPath');
    if (typeof path === 'string' && path.trim() !== '') settings.serverPath = path.trim();
    const args = get('serverArgs');
    if (Array.isArray(args)) settings.serverArgs = args.filter((a): a is string => typeof a === 'string');
    const enable = get('enable');
    if (typeof enable === 'boolean') settings.enable = enable;
    const raw = get('serverSettings');
    if (raw !== null && typeof raw === 'object' && !Array.isArray(raw)) settings.serverSettings = { ...(raw as Record<string, unknown>) };
    for (const key of SERVER_OPTION_KEYS) {
        const value = get(key);
        if (value !== undefined) (settings as unknown as Record<string, unknown>)[key] = value;
    }
    return settings;
}

/**
 * The flat camelCase object sent as `initializationOptions` and as
 * `workspace/didChangeConfiguration` `settings`. Unset options are left out so
 * the server's own defaults apply; `serverSettings` entries come first so a
 * named option wins over a raw one with the same key.
 */
export function serverOptions(settings: ClientSettings): Record<string, unknown> {
    const options: Record<string, unknown> = {};
    for (const [key, value] of Object.entries(settings.serverSettings)) {
        if (value !== null && value !== undefined) options[key] = value;
    }
    for (const key of SERVER_OPTION_KEYS) {
        const value = settings[key];
        if (value === null || value === undefined || value === '') continue;
        options[key] = value;
    }
    return options;
}

/** True when a change between two settings needs a new server process rather than a configuration update. */
export function needsRestart(before: ClientSettings, after: ClientSettings): boolean {
    return before.serverPath !== after.serverPath || before.serverArgs.join('\0') !== after.serverArgs.join('\0');
}

/** What a change of `efim.*` settings needs from the extension. */
export type SettingsAction = 'none' | 'start' | 'restart' | 'notify';

/**
 * `restart` only when the launch command changed (`serverPath`, `serverArgs`);
 * every server option goes to the running server as
 * `workspace/didChangeConfiguration` (`notify`), which applies it at once — a
 * new `model` included (the server reloads its engine itself). Turning
 * completions off keeps the server; turning them on starts one if none runs.
 */
export function settingsAction(before: ClientSettings, after: ClientSettings, running: boolean): SettingsAction {
    if (!after.enable) return 'none';
    if (!running) return 'start';
    if (needsRestart(before, after)) return 'restart';
    return JSON.stringify(serverOptions(before)) === JSON.stringify(serverOptions(after)) ? 'none' : 'notify';
}

/** The part of a connection `sendSettings` needs (vscode-languageclient's client, or a test's connection). */
export interface NotificationSender {
    sendNotification(method: string, params: unknown): Promise<void>;
}

/** Sends the server its new options (flat camelCase, the same shape as `initializationOptions`). */
export function sendSettings(sender: NotificationSender, settings: ClientSettings): Promise<void> {
    return sender.sendNotification('workspace/didChangeConfiguration', { settings: serverOptions(settings) });
}
