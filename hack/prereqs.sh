#!/usr/bin/env bash
# Checks the prerequisites that `make` cannot install by itself; one line per missing tool.
set -u
missing=0
need() { echo "error: $1" >&2; missing=1; }

if ! command -v python3 >/dev/null 2>&1; then
  need "Python 3.11 or newer is required: install python3 (and python3-venv) from your OS packages or python.org"
elif ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  need "Python 3.11 or newer is required, found $(python3 --version 2>&1)"
elif ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  need "the Python venv module is missing: install python3-venv"
fi

if ! command -v go >/dev/null 2>&1; then
  need "Go 1.26 or newer is required to build the test binaries: install it from go.dev/dl"
else
  gov=$(go env GOVERSION 2>/dev/null | sed 's/^go//')
  if ! printf '%s\n' "1.26" "${gov%%-*}" | sort -V -C; then
    need "Go 1.26 or newer is required, found go${gov}"
  fi
fi

if [ -f native/Cargo.toml ]; then
  if ! command -v cargo >/dev/null 2>&1; then
    need "Rust (cargo) is required to build the agent's native core: install it with rustup"
  elif ! cargo clippy --version >/dev/null 2>&1 || ! cargo fmt --version >/dev/null 2>&1; then
    need "the Rust components clippy and rustfmt are required: rustup component add clippy rustfmt"
  fi
fi

exit $missing
