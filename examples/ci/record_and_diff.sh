#!/usr/bin/env bash
# Record the digit maps of two commits with `fxstab record` and diff them with `fxstab diff`.
#
#   examples/ci/record_and_diff.sh BASE_REF [HEAD_REF]
#
# Each commit is checked out in a temporary git worktree and recorded from there, so the model
# code of each commit is analysed by the same installed fxstab. Settings (environment):
#   FXSTAB_TARGET       TARGET of `fxstab record` (default examples/ci/target.py:build)
#   FXSTAB_MAX_DROP     digits an operator may lose (default 0.5)
#   FXSTAB_METRIC       normwise | p10 | p50 | avg | min (default: fxstab diff's, avg)
#   FXSTAB_RECORD_ARGS  extra `fxstab record` options, e.g. "--format fp16 --n-samples 5"
#   FXSTAB_OUT          output folder (default ./fxstab-digits)
#   FXSTAB              the fxstab command (default fxstab)
# Writes base.json, head.json, diff.md (the pull-request comment), diff.txt and diff.json to
# FXSTAB_OUT, and two self-contained pages that open offline from the job's artifacts: head.html
# (the head's digit map: findings, graph, table) and diff.html (the verdict, the graph coloured
# by the change). It exits with `fxstab diff`'s code: 0 the gate passes, 1 it fails (an operator or
# module lost more than FXSTAB_MAX_DROP digits, a new NaN/inf origin, an operator no longer
# analysed), 2 unusable input. A TARGET file absent from BASE (the change adds it) is not an
# error: there is no baseline, diff.md says so and the exit code is 0. A TARGET file absent from
# HEAD (the change removes or moves it) is an error (exit 2): the gate would check nothing.
set -euo pipefail

base_ref=${1:?usage: record_and_diff.sh BASE_REF [HEAD_REF]}
head_ref=${2:-HEAD}
target=${FXSTAB_TARGET:-examples/ci/target.py:build}
max_drop=${FXSTAB_MAX_DROP:-0.5}
metric=${FXSTAB_METRIC:-}
fxstab=${FXSTAB:-fxstab}
read -r -a record_args <<< "${FXSTAB_RECORD_ARGS:-}"

repo=$(git rev-parse --show-toplevel)
mkdir -p "${FXSTAB_OUT:-fxstab-digits}"
out=$(cd "${FXSTAB_OUT:-fxstab-digits}" && pwd)
work=$(mktemp -d)
cleanup() {
    for name in base head; do
        if [ -d "$work/$name" ]; then
            git -C "$repo" worktree remove --force "$work/$name" >/dev/null 2>&1 || true
        fi
    done
    rm -rf "$work"
}
trap cleanup EXIT

base_sha=$(git -C "$repo" rev-parse --verify "$base_ref^{commit}")
head_sha=$(git -C "$repo" rev-parse --verify "$head_ref^{commit}")
target_file=${target%:*}

if ! git -C "$repo" cat-file -e "$head_sha:$target_file" 2>/dev/null; then
    echo "record_and_diff.sh: error: $target_file does not exist in the head commit" \
        "${head_sha:0:10}: set FXSTAB_TARGET to the model's new place" >&2
    exit 2
fi
if ! git -C "$repo" cat-file -e "$base_sha:$target_file" 2>/dev/null; then
    printf '%s\n' "<!-- fxstab-digit-map-diff -->" \
        "### fxstab digit map: no baseline" "" \
        "\`$target_file\` does not exist in the base commit \`${base_sha:0:10}\`; nothing to compare." \
        > "$out/diff.md"
    cat "$out/diff.md"
    exit 0
fi

record() {  # record NAME SHA
    git -C "$repo" worktree add --detach --quiet "$work/$1" "$2"
    echo "== fxstab record $target at $1 ${2:0:10}"
    (cd "$work/$1" && "$fxstab" record "$target" -o "$out/$1.json" ${record_args[@]+"${record_args[@]}"})
}
record base "$base_sha"
record head "$head_sha"

rc=0
metric_args=()
if [ -n "$metric" ]; then metric_args=(--metric "$metric"); fi
"$fxstab" show "$out/head.json" ${metric_args[@]+"${metric_args[@]}"} --html "$out/head.html" >/dev/null
"$fxstab" diff "$out/base.json" "$out/head.json" --max-drop "$max_drop" ${metric_args[@]+"${metric_args[@]}"} \
    --markdown-out "$out/diff.md" --json-out "$out/diff.json" --text-out "$out/diff.txt" \
    --html "$out/diff.html" || rc=$?
exit "$rc"
