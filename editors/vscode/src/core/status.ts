/**
 * What the status bar says: server state from `$/progress`, the last round
 * trip, and the cache reuse ratio from `efim/stats`.
 */
import type { WorkDoneProgressBegin, WorkDoneProgressEnd, WorkDoneProgressReport } from 'vscode-languageserver-protocol';
import type { EfimStats } from './protocol';

export type ServerState = 'stopped' | 'starting' | 'loading' | 'ready' | 'error';

/**
 * Follows the server's work-done progress (the model loads in the background).
 * The server is `loading` while any progress is open and `ready` once all have
 * ended, or as soon as it has answered a completion with a suggestion.
 */
export class ServerProgress {
    state: ServerState = 'stopped';
    /** Latest title/message/percentage of an open progress, for the tooltip. */
    detail = '';
    private readonly open = new Map<string, string>();

    starting(): void {
        this.state = 'starting';
        this.detail = '';
        this.open.clear();
    }

    stopped(state: 'stopped' | 'error' = 'stopped', detail = ''): void {
        this.state = state;
        this.detail = detail;
        this.open.clear();
    }

    progress(token: string | number, value: WorkDoneProgressBegin | WorkDoneProgressReport | WorkDoneProgressEnd): void {
        const key = String(token);
        if (value.kind === 'end') {
            this.open.delete(key);
            if (this.open.size === 0 && (this.state === 'loading' || this.state === 'starting')) {
                this.state = 'ready';
                this.detail = value.message ?? '';
            }
            return;
        }
        const title = value.kind === 'begin' ? value.title : (this.open.get(key) ?? '');
        this.open.set(key, title);
        const pct = value.percentage !== undefined ? ` ${Math.round(value.percentage)}%` : '';
        this.detail = [title, value.message].filter(Boolean).join(': ') + pct;
        this.state = 'loading';
    }

    /** A real suggestion arrived, so the model is up whatever progress said. */
    served(): void {
        if (this.state === 'starting' || this.state === 'loading') {
            this.state = 'ready';
            this.open.clear();
        }
    }
}

export interface StatusLine {
    text: string;
    tooltip: string;
}

function ms(value: number | undefined): string {
    return value === undefined || !Number.isFinite(value) ? '–' : `${Math.round(value)} ms`;
}

/** The status bar item's text (codicons allowed) and tooltip. */
export function statusLine(progress: ServerProgress, enabled: boolean, lastLatencyMs?: number, stats?: EfimStats): StatusLine {
    const reuse = stats && Number.isFinite(stats.reuseRatio) ? ` · reuse ${Math.round(stats.reuseRatio * 100)}%` : '';
    if (!enabled) return { text: '$(circle-slash) efim', tooltip: 'efim completions are off (efim: Toggle Completions)' };
    switch (progress.state) {
        case 'stopped':
            return { text: '$(debug-stop) efim', tooltip: 'efim server not running' };
        case 'error':
            return { text: '$(error) efim', tooltip: progress.detail || 'efim server failed' };
        case 'starting':
            return { text: '$(loading~spin) efim', tooltip: 'efim server starting' };
        case 'loading':
            return { text: '$(loading~spin) efim', tooltip: `efim: ${progress.detail || 'loading model'}` };
        case 'ready':
            return {
                text: `$(check) efim ${lastLatencyMs !== undefined ? ms(lastLatencyMs) : ''}${reuse}`.trimEnd(),
                tooltip: stats ? formatStats(stats) : 'efim ready',
            };
    }
}

/** Human-readable `efim/stats`, one counter per line (for the output channel, tooltip and `:EfimStats`-style views). */
export function formatStats(stats: EfimStats): string {
    const pct = (p: { p50: number; p95: number; p99: number } | undefined) =>
        p ? `p50 ${ms(p.p50)}, p95 ${ms(p.p95)}, p99 ${ms(p.p99)}` : '–';
    const lines = [
        `requests ${stats.requests}, served ${stats.served}, typing-through ${stats.typingThroughHits}, cancelled ${stats.cancelled}`,
        `prompt tokens ${stats.promptTokens}: reused ${stats.reusedTokens}, prefilled ${stats.prefilledTokens} ` +
            `(reuse ${Number.isFinite(stats.reuseRatio) ? (stats.reuseRatio * 100).toFixed(1) : '–'}%)`,
        `time to first token: ${pct(stats.ttftMs)}`,
        `latency: ${pct(stats.latencyMs)}`,
        `KV cache ${(stats.cacheBytes / 2 ** 20).toFixed(1)} MiB; sessions ${stats.sessions?.active ?? '–'} active, ${stats.sessions?.rebases ?? '–'} rebases`,
    ];
    const known = new Set([
        'requests', 'served', 'typingThroughHits', 'cancelled', 'promptTokens', 'reusedTokens', 'prefilledTokens',
        'reuseRatio', 'ttftMs', 'latencyMs', 'cacheBytes', 'sessions',
    ]);
    for (const [key, value] of Object.entries(stats)) {
        if (!known.has(key)) lines.push(`${key}: ${JSON.stringify(value)}`);
    }
    return lines.join('\n');
}
