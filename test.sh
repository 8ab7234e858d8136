#!/usr/bin/env bash
# The project's test command (the README's second command). Installs the
# system tools some tests drive when they are missing (systemd-analyze and
# systemd-socket-activate from `systemd`, setpriv and prlimit from `util-linux`, tmux, strace,
# redis-server and redis-cli for the backing tier's clusters, numpy,
# pytest and torch for the Python client), checks formatting and clippy's lints, then
# runs every Rust test of the workspace and the Python client's tests.
set -euo pipefail
cd "$(dirname "$0")"

need=()
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v systemd-socket-activate >/dev/null 2>&1 || need+=(systemd)
command -v setpriv >/dev/null 2>&1 || need+=(util-linux)
command -v prlimit >/dev/null 2>&1 || need+=(util-linux)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
command -v strace >/dev/null 2>&1 || need+=(strace)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
if [ ${#need[@]} -gt 0 ]; then
    echo "test.sh: installing ${need[*]}" >&2
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# Formatting and lints first: they fail in seconds, the tests take minutes.
for c in rustfmt clippy; do
    cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1 || rustup component add "$c"
done
cargo fmt --all -- --check
# No import circles among the modules of these crates (ARCHITECTURE.md).
for c in daemon proto shard; do python3 daemon/bench/import_cycles.py "$c/src"; done
cargo clippy --workspace --all-targets --release -- -D warnings
cargo test --workspace --release

# The Python client's tests run against the hkvd binary the step above built.
python3 -c "import numpy, pytest, farmhash" 2>/dev/null || python3 -m pip install -q numpy pytest pyfarmhash
# torch for hkvd.torch's tests: the CPU build from PyTorch's own index where
# it is reachable, else PyPI's (which also runs on hosts without a GPU).
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q --timeout 20 --retries 1 torch \
    --index-url https://download.pytorch.org/whl/cpu 2>/dev/null || python3 -m pip install -q torch
HKVD_BIN="$PWD/target/release/hkvd" python3 -m pytest -q python/tests
