#!/usr/bin/env bash
# Installs what the editor-client tests need: Debian's neovim and the VS Code client's npm packages.
set -uo pipefail
cd "$(dirname "$0")"
if ! command -v nvim >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq neovim) >/dev/null 2>&1 \
            || echo "editors/setup.sh: could not install neovim; its tests will be skipped" >&2
    else
        echo "editors/setup.sh: nvim missing and not root; Neovim tests will be skipped" >&2
    fi
fi
if [ -f vscode/package.json ]; then
    if command -v npm >/dev/null 2>&1; then
        (cd vscode && { [ -d node_modules ] || npm ci --no-audit --no-fund --loglevel=error; } && npm run --silent compile) \
            || { echo "editors/setup.sh: VS Code client build failed" >&2; exit 1; }
    else
        echo "editors/setup.sh: npm missing; VS Code client tests will be skipped" >&2
    fi
fi
