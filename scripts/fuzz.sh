#!/usr/bin/env bash
# Builds every fuzz target (fuzz/, cargo-fuzz + libFuzzer, nightly) and runs each for SECONDS
# (default 30). A crash fails the script and leaves the input in fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Environment: FUZZ_SANITIZER (none | address; default none: the project's crates forbid unsafe
# code, and debug assertions and overflow checks stay on), FUZZ_CORPUS (where the growing corpora
# live; default fuzz/corpus, not committed), FUZZ_MAX_LEN (default 4096).
# Reproduce a crash:  cargo +nightly fuzz run --sanitizer none TARGET fuzz/artifacts/TARGET/crash-...
# Minimise it:        cargo +nightly fuzz tmin --sanitizer none TARGET fuzz/artifacts/TARGET/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-30}"
shift || true
sanitizer="${FUZZ_SANITIZER:-none}"
corpus_root="${FUZZ_CORPUS:-fuzz/corpus}"
max_len="${FUZZ_MAX_LEN:-4096}"

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "installing the nightly toolchain (cargo-fuzz needs it)"
  rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install cargo-fuzz --locked --version 0.13.2
fi

echo "== building the fuzz targets (sanitizer: $sanitizer)"
cargo +nightly fuzz build --sanitizer "$sanitizer"

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

summary=()
failed=()
for target in "${targets[@]}"; do
  corpus="$corpus_root/$target"
  seeds="fuzz/seeds/$target"
  mkdir -p "$corpus" "fuzz/artifacts/$target"
  [ -d "$seeds" ] || seeds=""
  log="$(mktemp)"
  echo "== $target: ${seconds}s"
  if cargo +nightly fuzz run --sanitizer "$sanitizer" "$target" "$corpus" $seeds -- \
      -max_total_time="$seconds" -max_len="$max_len" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 >"$log" 2>&1; then
    status=ok
  else
    status=CRASH
    failed+=("$target")
    tail -n 60 "$log"
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  speed=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -oE '#[0-9]+.*cov: [0-9]+ ft: [0-9]+' "$log" | tail -n 1 | grep -oE 'cov: [0-9]+ ft: [0-9]+' || echo "cov: ? ft: ?")
  units=$(find "$corpus" -type f | wc -l)
  summary+=("$(printf '%-18s %-6s %12s execs %8s/s  %s  corpus %s' "$target" "$status" "$execs" "$speed" "$cov" "$units")")
  rm -f "$log"
done

echo "== fuzz summary (${seconds}s per target)"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "crashes in: ${failed[*]} (inputs in fuzz/artifacts/; make each a unit test with the minimised input)"
  exit 1
fi
