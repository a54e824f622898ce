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

# The local node (root only; without root its tests are skipped): packet filtering for kube-proxy
# and the guard, conntrack, and an OCI builder with a Debian rootfs for the images.
if [ "$(id -u)" = 0 ]; then
  node_missing=()
  for tool in ip:iproute2 nft:nftables iptables:iptables conntrack:conntrack buildah:buildah \
              debootstrap:debootstrap gcc:gcc mount:mount; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || node_missing+=("${tool#*:}")
  done
  if [ ${#node_missing[@]} -gt 0 ]; then
    need "the local node needs these packages: apt-get install ${node_missing[*]}"
  fi
  if [ ! -f /usr/include/seccomp.h ]; then
    need "runc is built with seccomp (Pod Security's RuntimeDefault profile): apt-get install libseccomp-dev"
  fi
  # Only `make e2e` needs it (python -m hack.kind stops there with the same message), so no failure here.
  [ -x /usr/sbin/dockerd ] || echo "note: make e2e runs kind on its own dockerd: apt-get install docker.io" >&2
fi

exit $missing
