#!/usr/bin/env bash
# A headless agent step in CI: apply a skill to a recipe, run a short smoke run, and fail the
# job unless the run completes with a finite loss. Uses only the `trainwright` CLI twins of the
# MCP tools, with --json, and their exit codes (0 ok, 1 run failed, 2 bad input, 3 not found).
#
#   examples/ci/agent_smoke.sh RECIPE [SKILL]
#
# Environment:
#   WORKSPACE     the workspace (a git repository; default: the current directory)
#   SMOKE_STEPS   optimizer steps of the smoke run (default 20)
#   SMOKE_NPROC   processes (default 1)
#   SMOKE_SET     extra config overrides, space-separated key=value (default none)
#   TRAINWRIGHT   the trainwright command (default: trainwright)
set -euo pipefail

recipe=${1:?usage: agent_smoke.sh RECIPE [SKILL]}
skill=${2:-}
workspace=${WORKSPACE:-.}
steps=${SMOKE_STEPS:-20}
nproc=${SMOKE_NPROC:-1}
tw=${TRAINWRIGHT:-trainwright}
python=${PYTHON:-python3}

# field JSON KEY.PATH: one value from a JSON object (null when absent).
field() { "$python" -c 'import json, sys
value = json.loads(sys.argv[1])
for key in sys.argv[2].split("."):
    value = value.get(key) if isinstance(value, dict) else None
print(json.dumps(value) if not isinstance(value, str) else value)' "$1" "$2"; }

fail() { echo "::error::$*" >&2; exit 1; }

if [[ -n "$skill" ]]; then
    echo "== apply_skill $skill to $recipe"
    if ! applied=$($tw apply "$skill" "$recipe" --workspace "$workspace" --json); then
        fail "apply_skill $skill: $(field "$applied" error)"
    fi
    if [[ $(field "$applied" changed) == true ]]; then
        echo "committed $(field "$applied" commit): $(field "$applied" message)"
    else
        echo "$(field "$applied" message) (nothing to commit)"
    fi
fi

overrides=(--set "train.max_steps=$steps" --set "checkpoint.every=$steps")
for item in ${SMOKE_SET:-}; do overrides+=(--set "$item"); done

echo "== smoke run: $recipe, $steps steps on $nproc process(es)"
status=0
run=$($tw run "$recipe" --nproc "$nproc" "${overrides[@]}" --workspace "$workspace" --json) || status=$?
if [[ -z "$run" || $(field "$run" run_id) == null ]]; then
    fail "the smoke run did not start (exit $status): $(field "${run:-{\}}" error)"
fi
run_id=$(field "$run" run_id)
info=$($tw status "$run_id" --workspace "$workspace" --json)
loss=$(field "$info" latest.loss)
echo "run $run_id: $(field "$info" status) at step $(field "$info" step), loss $loss"
if [[ $status -ne 0 || $(field "$info" status) != completed ]]; then
    echo "$(field "$info" console_tail)" >&2
    fail "the smoke run $run_id ended $(field "$info" status) (exit $status): $(field "$info" error)"
fi
if ! "$python" -c 'import math, sys; sys.exit(0 if math.isfinite(float(sys.argv[1])) else 1)' "$loss" 2>/dev/null; then
    fail "the smoke run $run_id ended with a loss that is not finite: $loss"
fi
echo "ok: final loss $loss is finite"
if [[ -n "${GITHUB_STEP_SUMMARY:-}" ]]; then
    echo "smoke run \`$run_id\` of \`$recipe\`${skill:+ with \`$skill\`}: step $(field "$info" step), loss $loss" >> "$GITHUB_STEP_SUMMARY"
fi
