/**
 * Starting `efim serve` as a child process speaking LSP over stdio.
 *
 * The extension hands `spawnServer` to vscode-languageclient as its server
 * factory, and the Node integration test calls the same function, so what the
 * test exercises is what the editor runs.
 */
import { ChildProcess, spawn } from 'node:child_process';
import { accessSync, constants, statSync } from 'node:fs';
import * as path from 'node:path';
import type { ClientSettings } from './settings';

export interface ServerLaunch {
    /** Absolute path of the executable. */
    command: string;
    args: string[];
}

export class ServerNotFoundError extends Error {
    constructor(serverPath: string, detail: string) {
        super(
            `efim: cannot start the completion server '${serverPath}' (${detail}). ` +
                `Install efim-lsp (pip install efim-lsp, or 'make setup' in a checkout) ` +
                `or point the setting efim.serverPath at the 'efim' executable, e.g. <checkout>/.venv/bin/efim.`,
        );
        this.name = 'ServerNotFoundError';
    }
}

function isExecutableFile(file: string): boolean {
    try {
        if (!statSync(file).isFile()) return false;
        accessSync(file, process.platform === 'win32' ? constants.F_OK : constants.X_OK);
        return true;
    } catch {
        return false;
    }
}

/** Finds an executable: a path is checked as given, a bare name is looked up on PATH (with PATHEXT on Windows). */
export function resolveExecutable(name: string, env: NodeJS.ProcessEnv = process.env, cwd = process.cwd()): string | undefined {
    if (name.includes('/') || name.includes(path.sep)) {
        const file = path.resolve(cwd, name);
        return isExecutableFile(file) ? file : undefined;
    }
    const exts = process.platform === 'win32' ? (env.PATHEXT ?? '.EXE;.CMD;.BAT').split(';') : [''];
    for (const dir of (env.PATH ?? '').split(path.delimiter)) {
        if (!dir) continue;
        for (const ext of exts) {
            const file = path.join(dir, name + ext);
            if (isExecutableFile(file)) return file;
        }
    }
    return undefined;
}

/** The command line for `efim serve`; throws `ServerNotFoundError` with a fix-it message when the executable is missing. */
export function serverLaunch(settings: ClientSettings, env: NodeJS.ProcessEnv = process.env, cwd = process.cwd()): ServerLaunch {
    const command = resolveExecutable(settings.serverPath, env, cwd);
    if (!command) {
        const where = settings.serverPath.includes('/') ? 'no executable file there' : 'not found on PATH';
        throw new ServerNotFoundError(settings.serverPath, where);
    }
    return { command, args: ['serve', ...settings.serverArgs] };
}

export interface SpawnOptions {
    cwd?: string;
    env?: NodeJS.ProcessEnv;
    /**
     * Receives the server's stderr (its log) line by line. Without it the
     * caller must drain `child.stderr` itself (vscode-languageclient does),
     * or a chatty server blocks on a full pipe.
     */
    onStderr?: (line: string) => void;
}

/**
 * Spawns the server and resolves once the process exists (rejects if it cannot
 * be started). stdin/stdout carry the protocol; stderr is the server's log.
 */
export async function spawnServer(launch: ServerLaunch, options: SpawnOptions = {}): Promise<ChildProcess> {
    const child = spawn(launch.command, launch.args, {
        cwd: options.cwd,
        env: options.env ?? process.env,
        stdio: ['pipe', 'pipe', 'pipe'],
        windowsHide: true,
    });
    await new Promise<void>((resolve, reject) => {
        child.once('spawn', resolve);
        child.once('error', (err) => reject(new Error(`efim: failed to start ${launch.command}: ${err.message}`)));
    });
    const onStderr = options.onStderr;
    if (onStderr) {
        let pending = '';
        child.stderr?.setEncoding('utf8');
        child.stderr?.on('data', (chunk: string) => {
            pending += chunk;
            const lines = pending.split('\n');
            pending = lines.pop() ?? '';
            for (const line of lines) onStderr(line);
        });
    }
    return child;
}
