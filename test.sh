#!/usr/bin/env bash
# The project's test command (the README's second command). Installs what the
# tests need when it is missing, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")"
cargo test --workspace --release
