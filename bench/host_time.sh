#!/usr/bin/env bash
# The library's host time a compiled training batch, by part, with the loader's worker processes making the batches and
# the library's copying thread receiving and copying each one ahead (`thread`), against no workers: the fit's own
# thread makes and copies each batch when it asks for it (`inline`). bench/workflow.py's `--drain` runs of a compiled
# fit (`compile-cold`), the arms alternating, each a process of its own with a fresh inductor cache.
#
#   bash bench/host_time.sh OUT [REPEAT] [workflow.py's options...]
#   bash bench/host_time.sh /tmp/ht 2 --config '{"text": {"epochs": 2}}'
#   bash bench/host_time.sh /tmp/ht 1 --smoke --config '{"text": {"n": 2000}}'   # the same code on the CPU, where nothing is copied ahead
set -u
out=${1:?usage: host_time.sh OUT [REPEAT] [options...]} repeat=${2:-1}
export PYTHONUNBUFFERED=1
for i in $(seq 1 "$repeat"); do
    for how in thread inline; do
        flag=; [ "$how" = inline ] && flag="--num-workers 0"
        ${PYTHON:-python3} "$(dirname "$0")/workflow.py" --workflows text --arms compile-cold --drain $flag --out "$out/$how-$i" "${@:3}" \
            | tail -1 || exit 1
    done
done
${PYTHON:-python3} - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
rows = {}
for f in sorted(Path(sys.argv[1]).glob('*/workflow.json')):
    for r in json.loads(f.read_text())['records']:
        if (h := r.get('host_work_ms')): rows.setdefault(f.parent.name.split('-')[0], []).append(h)
parts = sorted({p for hs in rows.values() for h in hs for p in h['parts']})
print('| part, ms a batch | ' + ' | '.join(f'{k} (median of {len(v)})' for k,v in rows.items()) + ' |')
print('|---|' + '---:|'*len(rows))
for p in parts:
    vals = [statistics.median(h['parts'].get(p, 0.) for h in hs) for hs in rows.values()]
    if any(v >= 0.001 for v in vals): print(f'| {p} | ' + ' | '.join(f'{v:.3f}' for v in vals) + ' |')
print('| **all** | ' + ' | '.join(f"**{statistics.median(h['median'] for h in hs):.3f}**" for hs in rows.values()) + ' |')
PY
