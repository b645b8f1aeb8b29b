#!/usr/bin/env bash
# Records what the CLI and the benchmarks print on the shared traces, to diff a refactor against:
#   tools/snapshot.sh OUT_DIR            (run from the repository root, with the venv active)
#   tools/snapshot.sh --quick OUT_DIR    (about a minute: tools/snapshot_quick.py, placements only)
#   diff -r before/ after/               (timing columns differ; placements and figures must not)
# Every solve uses a step budget or is deterministic, so two runs of one tree give the same files.
set -uo pipefail
if [ "${1:-}" = "--quick" ]; then
  exec python tools/snapshot_quick.py "${2:?usage: tools/snapshot.sh --quick OUT_DIR}"
fi
out=${1:?usage: tools/snapshot.sh [--quick] OUT_DIR}
mkdir -p "$out"
traces=${MOE_TRACES_DIR:-../shared/traces}
T=$traces/deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz
topo=(--ep-size 32 --num-nodes 4 --num-redundant 32)
run() { local name=$1; shift; echo "== $name: $*" >&2; "$@" >"$out/$name.txt" 2>&1; echo "rc=$?" >>"$out/$name.txt"; }
mp() { python -m moe_placement "$@"; }
[ -f moe_placement/cli/__main__.py ] || mp() { python -m placement "$@"; }

run inspect mp inspect "$T" --json
run solve-greedy mp solve --trace "$T" "${topo[@]}" --solver greedy --fit-fraction 0.5 --dispatch local -o "$out/p.json"
run solve-cpsat mp solve --trace "$T" "${topo[@]}" --solver cpsat --time-limit 4 --fit-fraction 0.5 -o "$out/sglang.json" --format sglang
run solve-locality mp solve --trace "$T" "${topo[@]}" --solver locality --balance-slack 0.02 --work-limit 4000 --fit-fraction 0.5 -o "$out/loc.json"
run solve-migration mp solve --trace "$T" "${topo[@]}" --previous "$out/p.json" --max-moves 40 --fit-fraction 0.5 -o "$out/next.json"
run solve-sglang mp solve --trace "$T" "${topo[@]}" --solver greedy --dispatch sglang-static --fit-fraction 0.5 -o "$out/sg.json" --format sglang
run evaluate-all mp evaluate "$out/p.json" "$T" --dispatch all --step-tokens 64
run evaluate mp evaluate "$out/p.json" "$T" --dispatch local --step-tokens 16 --hidden-size 2048
run convert-trtllm mp convert "$out/p.json" -o "$out/moe_load_balancer.yaml" --format trtllm
run convert-ascend mp convert "$out/p.json" -o "$out/ascend.json" --format vllm-ascend
run layout mp layout --model deepseek-v3 --nodes 4 --gpus-per-node 8 --hardware h200 --phase decode --output "$out/plan"
run demo mp demo --out "$out/demo"
run bench-layout python benchmarks/layout.py
run bench-greedy python benchmarks/greedy_speed.py --repeats 1
run bench-locality python benchmarks/locality.py --quick --work-limit 4000
run bench-solver-quality python benchmarks/solver_quality.py --quick
run bench-online python benchmarks/online.py
# volatile fields (wall times, dates, absolute paths) are dropped from the JSON files before diffing
find "$out" -name '*.json' -newer "$out/inspect.txt" -print0 | xargs -0 -r sha256sum | sed "s#$out/##" | sort -k2 >"$out/files.sha256"
