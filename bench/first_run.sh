#!/usr/bin/env bash
# The first run of `learn.compile()` on one GPU, against the eager fit a user would run instead: torch's fused AdamW
# (`eager-fused`). Each arm is a process of its own (bench/workflow.py): *tiers-cold* is `learn.compile(background=True)`
# on an empty inductor cache (a notebook's first run on a new machine), *tiers-warm* the same on its cache (a second
# run), *compile-ro* `learn.compile(mode='reduce-overhead')` compiling in the fit's path (CUDA graphs from the start).
# Sized for a 10-minute command: no arm starts after BUDGET seconds (default 420), each is killed after TIMEOUT (150).
# text and text-small are fits of about 45 s on an H100, each process ~15 s more: three arms take ~2.5 minutes, so
# REPEAT 3 fits one command, and BUDGET skips what would not.
#
#   bash bench/first_run.sh OUT WORKFLOWS [REPEAT] [ARMS] [workflow.py's options...]
#   bash bench/first_run.sh $OUT/text text 3                # eager-fused,tiers-cold,tiers-warm, 3 runs each
#   bash bench/first_run.sh $OUT/small text-small 3 launch  # eager-fused,tiers-cold,compile-ro: a launch-bound step
#   bash bench/first_run.sh /tmp/fr text,text-small 1 warm --smoke   # the same code on the CPU, tiny
#
# ARMS is `warm` (the default), `launch`, or workflow.py's arm names, comma-separated. It ends with workflow.md's
# tables, so the end of a remote call's output has the numbers; its exit status is workflow.py's.
set -u
usage='usage: first_run.sh OUT WORKFLOWS [REPEAT] [ARMS] [options...]'
out=${1:?$usage} workflows=${2:?$usage} repeat=${3:-1}
case ${4:-warm} in
    warm) arms=eager-fused,tiers-cold,tiers-warm ;;
    launch) arms=eager-fused,tiers-cold,compile-ro ;;
    *) arms=$4 ;;
esac
export PYTHONUNBUFFERED=1 # The progress lines as each arm ends, in a remote call's output
${PYTHON:-python3} "$(dirname "$0")/workflow.py" --workflows "$workflows" --arms "$arms" --repeat "$repeat" --out "$out" \
    --budget "${BUDGET:-420}" --timeout "${TIMEOUT:-150}" "${@:5}"
rc=$?
echo; echo "== $out/workflow.md: each workflow's table, its runs that failed or were skipped, and what the reports said"
grep -E '^(## |\||- .*(\*\*|the report:))' "$out/workflow.md"
exit $rc
