#!/usr/bin/env bash
# Runs Tether's whole test suite: installs what the tests need, builds the binaries once, then
# runs unit, integration and end-to-end tests (with cargo-nextest when available).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-test-deps.sh

# The end-to-end tests start the real binaries from the same target directory.
cargo build --workspace --bins --locked

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --profile "${NEXTEST_PROFILE:-default}" "$@"
else
  cargo test --workspace --locked "$@"
fi
