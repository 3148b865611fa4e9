#!/usr/bin/env bash
# Installs what the editor-client tests need, idempotently: Debian's neovim and
# Node.js/npm when missing (as root, from apt), then the VS Code client's npm
# packages from its lock file, and its build (out/).
# Without root or apt the missing tool is reported, and its tests skip saying why.
set -uo pipefail
cd "$(dirname "$0")"

apt_updated=
apt_install() {  # apt_install PACKAGE... — quiet, and `apt-get update` at most once
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
    if [ -z "$apt_updated" ]; then
        apt-get update -qq >/dev/null 2>&1 || return 1
        apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1
}

if ! command -v nvim >/dev/null 2>&1; then
    apt_install neovim || echo "editors/setup.sh: nvim missing and not installable here (needs root + apt); Neovim tests will be skipped" >&2
fi
if ! command -v npm >/dev/null 2>&1; then
    apt_install nodejs npm || echo "editors/setup.sh: npm missing and not installable here (needs root + apt); VS Code client tests will be skipped" >&2
fi

if command -v npm >/dev/null 2>&1; then
    cd vscode
    # npm ci wipes node_modules and installs exactly the lock file; only when the lock file is newer than the install.
    if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
        npm ci --no-audit --no-fund --loglevel=error || { echo "editors/setup.sh: npm ci failed in editors/vscode" >&2; exit 1; }
    fi
    npm run --silent compile || { echo "editors/setup.sh: the VS Code client does not compile" >&2; exit 1; }
fi
