"""Step time: fastai + `learn.compile()` against hand-written PyTorch loops, eager and compiled, on batches already on the device.

Runs each arm (see `arm.py`) in its own process with a fresh `TORCHINDUCTOR_CACHE_DIR`, then, for the arms in
`--warm`, a second process reusing that cache, and writes `results.json`, `results.md`, `results.png` and `arms.log`
to `--out`:

    python bench/bench.py --device cuda --workloads resnet18,small --out /tmp/part1
    python bench/bench.py --device cuda --workloads gpt --out /tmp/part2
    python bench/bench.py --merge /tmp/part1/results.json /tmp/part2/results.json --out bench/results/step_time/latest
    python bench/bench.py --device cuda --profile --workloads resnet18 --arms fastai_compile --opts fastai_adam --out DIR

    python bench/bench.py --device cpu --smoke --out /tmp/bench-smoke   # a few minutes on 2 CPU cores (CI: --workloads gpt)

Exits with status 1 when an arm failed or timed out (after writing the results).
"""
from __future__ import annotations
import argparse, datetime, json, shutil, sys, tempfile, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from arm import ARMS, OPTS, WORKLOADS, describe # Light: importing it loads torch, not fastai
from procs import arm_env, env_line, git_commit, log_process, run_jobs, run_process

LABELS = {
    'hand_eager': 'hand eager', 'hand_compile': 'hand compile', 'hand_compile_ro': 'hand compile RO',
    'hand_compile_regional': 'hand compile regional', 'hand_compile_nested': 'hand compile nested', 'fastai_eager': 'fastai eager',
    'fastai_compile': 'fastai learn.compile()', 'fastai_compile_ro': 'fastai learn.compile(RO)',
    'fastai_compile_regional': 'fastai learn.compile regional', 'fastai_compile_nested': "fastai learn.compile regional='nested'",
}
OPT_LABELS = {'fastai_adam': "fastai Adam", 'fused_adamw': 'fused AdamW'}
DEFAULT_ARMS = ['hand_eager', 'hand_compile', 'hand_compile_ro', 'fastai_eager', 'fastai_compile', 'fastai_compile_ro']
CEILING = ('hand_compile', 'fused_adamw') # The hand-written compiled loop with fused AdamW

# ---------------------------------------------------------------------------------------------------------------------
# Planning and running

# The smoke run's default jobs, fewest processes that still run every code path: (arm, opt, with a warm process)
SMOKE_JOBS = [('hand_eager', 'fused_adamw', False), ('hand_compile', 'fused_adamw', False), ('fastai_eager', 'fastai_adam', False),
              ('fastai_compile', 'fastai_adam', True), ('fastai_compile', 'fused_adamw', False)]

def plan(args)->list:
    "The (workload, arm, opt, phase) jobs to run, each warm job right after its cold one"
    arms = args.arms.split(',') if args.arms else None
    if args.smoke and not arms and not args.warm:
        return [(w, a, o, ph) for w in args.workloads.split(',') for a, o, warm in
                SMOKE_JOBS + ([('fastai_compile_regional', 'fastai_adam', False), ('hand_compile_nested', 'fused_adamw', False)]
                              if w == 'gpt' else [])
                if o in args.opts.split(',') for ph in ('cold', 'warm')[:1+warm]]
    warm = args.warm or 'hand_compile,fastai_compile'
    warm = {'all': [a for a in ARMS if ARMS[a][1]], 'none': []}.get(warm, warm.split(','))
    jobs = []
    for w in args.workloads.split(','):
        # Regional compilation is for repeated blocks: by default only the GPT-style workload runs it
        for a in arms or DEFAULT_ARMS + (['fastai_compile_regional'] if w == 'gpt' else []):
            if args.device == 'cpu' and ARMS[a][1] == 'reduce-overhead': continue # CUDA graphs: GPU only
            for o in args.opts.split(','):
                # The hand loops are the ceiling: fused AdamW, unless asked for fastai's Adam too
                if a.startswith('hand') and o == 'fastai_adam' and not args.hand_fastai_adam: continue
                if a.endswith(('regional', 'nested')) and o == 'fused_adamw' and not arms: continue
                jobs.append((w, a, o, 'cold'))
                if a in warm and ARMS[a][1]: jobs.append((w, a, o, 'warm'))
    return jobs

def run_job(args, job, cache_root:Path, log)->dict:
    w, a, o, phase = job
    cache = cache_root/f'{w}-{a}-{o}' # The warm job reuses its cold job's cache
    result = cache_root/f'{w}-{a}-{o}-{phase}.json'
    cmd = [sys.executable, HERE/'arm.py', '--workload', w, '--arm', a, '--opt', o, '--phase', phase,
           '--device', args.device, '--steps', args.steps, '--warmup', args.warmup, '--backend', args.backend,
           '--compile-kwargs', args.compile_kwargs, '--config', json.dumps(json.loads(args.config).get(w, {})), '--result', result] + ['--smoke']*args.smoke + ['--plain']*args.plain
    if args.profile: cmd += ['--profile', Path(args.out)/f'profile_{w}_{a}_{o}.txt']
    fin = run_process(cmd, arm_env(cache), args.timeout)
    tail = log_process(log, ' '.join(job), cmd, fin)
    if result.exists(): rec = json.loads(result.read_text())
    else:
        rec = dict(workload=w, arm=a, opt=o, phase=phase, status='timeout' if fin.timed_out else 'error',
                   reason=f'timed out after {args.timeout}s' if fin.timed_out else f'exit {fin.rc}, no result')
    rec['process_s'] = fin.wall
    if rec['status'] == 'error': rec['log_tail'] = tail[-3000:]
    return rec

def fmt_progress(rec)->str:
    if rec['status'] != 'ok': return f"{rec['status'].upper()}: {rec.get('reason', '')}"
    s = f"{rec['median_ms']:.2f} ms/step, first step {rec['first_step_s']:.1f}s"
    if rec.get('compile_s') is not None: s += f" (compile {rec['compile_s']:.1f}s)"
    if rec.get('peak_mem_gb') is not None: s += f", peak {rec['peak_mem_gb']:.2f} GB"
    if rec.get('dynamo_graphs') is not None: s += f", graphs {compiled_stats(rec)}"
    if rec.get('vs_eager'): s += f", vs eager {eager_match(rec)}"
    return s + f", process {rec['process_s']:.0f}s"

# ---------------------------------------------------------------------------------------------------------------------
# Report

def index(records)->dict: return {(r['workload'], r['arm'], r['opt'], r['phase']): r for r in records}

def ok(idx, w, a, o, phase='cold'):
    r = idx.get((w, a, o, phase))
    return r if r and r.get('status') == 'ok' else None

def goals(idx, workloads)->list:
    "(goal, workload, measured, bound, passed or None when not measured): what `learn.compile()` should reach"
    res = []
    def add(name, w, val, goal, fmt, passed):
        res.append((name, w, '—' if val is None else fmt.format(val), goal, None if val is None else passed(val)))
    def ratio(a, b): return a/b if a is not None and b else None
    def get(w, a, o, key, phase='cold'):
        r = ok(idx, w, a, o, phase)
        return None if r is None else r.get(key)
    for w in workloads:
        ceil = get(w, *CEILING, 'median_ms')
        add("learn.compile() + fastai Adam step time vs hand compile + fused AdamW", w,
            ratio(get(w, 'fastai_compile', 'fastai_adam', 'median_ms'), ceil), '≤ 1.10×', '{:.2f}×', lambda v: v <= 1.10)
        add("learn.compile() + fused AdamW (OptimWrapper) step time vs hand compile + fused AdamW", w,
            ratio(get(w, 'fastai_compile', 'fused_adamw', 'median_ms'), ceil), '≤ 1.10×', '{:.2f}×', lambda v: v <= 1.10)
        if w == 'resnet18':
            add("learn.compile(RO) speed-up over fastai eager, fastai Adam", w,
                ratio(get(w, 'fastai_eager', 'fastai_adam', 'median_ms'), get(w, 'fastai_compile_ro', 'fastai_adam', 'median_ms')),
                '≥ 3×', '{:.2f}×', lambda v: v >= 3)
        hand_cold = get(w, *CEILING, 'compile_s')
        for o in OPTS:
            add(f"learn.compile() + {OPT_LABELS[o]} cold compile vs hand compile's", w,
                ratio(get(w, 'fastai_compile', o, 'compile_s'), hand_cold), '≤ 1.1×', '{:.2f}×', lambda v: v <= 1.1)
        for o in OPTS:
            add(f"learn.compile() + {OPT_LABELS[o]} warm start vs cold compile", w,
                ratio(get(w, 'fastai_compile', o, 'compile_s', 'warm'), get(w, 'fastai_compile', o, 'compile_s')),
                '≤ 30 %', '{:.0%}', lambda v: v <= 0.30)
        if w == 'gpt':
            add("regional compilation: learn.compile() cold compile over regional's, fastai Adam", w,
                ratio(get(w, 'fastai_compile', 'fastai_adam', 'compile_s'), get(w, 'fastai_compile_regional', 'fastai_adam', 'compile_s')),
                '≥ 2×', '{:.2f}×', lambda v: v >= 2)
        for loop, o in ((l, o) for l in ('hand', 'fastai') for o in OPTS): # Nested regions, where they were measured
            whole, nested = ok(idx, w, f'{loop}_compile', o), ok(idx, w, f'{loop}_compile_nested', o)
            if not (whole and nested): continue
            add(f"{loop} nested regions: cold compile over the whole model's, {OPT_LABELS[o]}", w,
                ratio(nested['compile_s'], whole['compile_s']), '≤ 0.7×', '{:.2f}×', lambda v: v <= 0.7)
            add(f"{loop} nested regions: step time over the whole model's, {OPT_LABELS[o]}", w,
                ratio(nested['median_ms'], whole['median_ms']), '≤ 1.05×', '{:.2f}×', lambda v: v <= 1.05)
    return res

def fmt(v, spec, none='—'): return none if v is None else format(v, spec)

def config(recs, w)->dict:
    "Workload `w`'s sizes as its arms ran it"
    return next((r['config'] for r in recs if r['workload'] == w and 'config' in r),
                WORKLOADS[w]['smoke' if any(r.get('smoke') for r in recs) else 'full'])

def graph_stats(rep)->str: return '' if not rep else f"{rep['graphs']} / {rep['graph_breaks']} / {rep['recompiles']}"

def compiled_stats(r)->str:
    "TorchDynamo's graphs / inductor's (forward and backward) / nested regions traced + reused, where the arm recorded them"
    if r.get('dynamo_graphs') is None: return ''
    return f"{r['dynamo_graphs']} / {r['inductor_graphs']} / {r['regions_traced']} + {r['regions_reused']}"

def eager_match(r)->str:
    "A training step's loss difference and largest relative gradient difference against eager, where measured"
    v = r.get('vs_eager')
    if not v: return ''
    return f"{v['loss_diff']:.1e} / {v['grad_rel_err']:.1e}" + (f" ({v['grads_missing']} grads missing)" if v['grads_missing'] else '')

def render_md(data)->str:
    env, meta, recs = data['env'], data['meta'], data['records']
    idx = index(recs)
    workloads = list(dict.fromkeys(r['workload'] for r in recs))
    arms = [a for a in ARMS if any(r['arm'] == a for r in recs)]
    smoke = any(r.get('smoke') for r in recs)
    L = ["# fastxtend_compile benchmark", ""]
    if env:
        L += [env_line(env, meta), ""]
    if smoke: L += ["**CPU smoke run: tiny sizes, timings mean nothing.**", ""]
    r0 = next((r for r in recs if r.get('status') == 'ok'), recs[0] if recs else {})
    L.append(f"Median step time over {r0.get('steps')} timed steps after {r0.get('warmup')} warm-up steps, "
             f"{'float32' if str(env.get('device')).startswith('CPU') else 'bf16 autocast'}, "
             f"torch.compile backend `{r0.get('backend')}`. Each arm runs in its own process with a fresh "
             "`TORCHINDUCTOR_CACHE_DIR`; *cold compile* is the first step's wall time less the median step, *warm* "
             "the same in a second process reusing that cache. × ceiling: step time over the hand-written compiled loop "
             "with fused AdamW. RO: `mode='reduce-overhead'`. Peak memory: `torch.cuda.max_memory_allocated` (data excluded).")
    L.append("")
    for r in recs:
        if r.get('status') == 'skipped': L.append(f"- Not measured: {LABELS[r['arm']]} ({r['workload']}, {OPT_LABELS[r['opt']]}): {r['reason']}.")
        elif r.get('status') in ('error', 'timeout'):
            reason = str(r.get('reason')).split(' Stack trace:')[0][:300]
            L.append(f"- **Failed**: {LABELS[r['arm']]} ({r['workload']}, {OPT_LABELS[r['opt']]}, {r['phase']}): {reason}")
    L.append("")
    # Summary: one row per workload and optimizer, one column per arm
    shown = [a for a in arms if any(ok(idx, w, a, o) for w in workloads for o in OPTS)]
    L += ["## Median ms/step (× ceiling)", "",
          "| workload | optimizer | " + " | ".join(LABELS[a] for a in shown) + " |",
          "|---|---|" + "---:|"*len(shown)]
    for w in workloads:
        ceil = ok(idx, w, *CEILING)
        for o in OPTS:
            if not any(idx.get((w, a, o, 'cold')) for a in arms): continue
            cells = []
            for a in shown:
                r = ok(idx, w, a, o)
                cells.append('' if r is None else f"{r['median_ms']:.2f}" + (f" ({r['median_ms']/ceil['median_ms']:.2f}×)" if ceil else ''))
            L.append(f"| {w} | {OPT_LABELS[o]} | " + " | ".join(cells) + " |")
    L.append("")
    # Goals
    L += ["## Goals", "", "| goal | workload | measured | bound | |", "|---|---|---:|---:|---|"]
    for name, w, val, goal, passed in goals(idx, workloads):
        L.append(f"| {name} | {w} | {val} | {goal} | {'not measured' if passed is None else 'PASS' if passed else '**FAIL**'} |")
    L.append("")
    # Details per workload
    L.append("## Details")
    for w in workloads:
        ceil = ok(idx, w, *CEILING)
        L += ["", f"### {w}: {describe(config(recs, w))}", "",
              "| arm | optimizer | ms/step | mean | × ceiling | × faster than fastai eager | cold compile s | warm compile s "
              "| warm/cold | peak GB | graphs / breaks / recompiles | dynamo / inductor graphs / regions | vs eager: loss Δ / grad rel. err |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
        for o in OPTS:
            eager = ok(idx, w, 'fastai_eager', o)
            for a in arms:
                r, wr = ok(idx, w, a, o), ok(idx, w, a, o, 'warm')
                if r is None: continue
                cold, warm = r.get('compile_s'), wr and wr.get('compile_s')
                rep = r.get('compile_report')
                L.append(f"| {LABELS[a]} | {OPT_LABELS[o]} | {r['median_ms']:.2f} | {r['mean_ms']:.2f} | "
                         f"{fmt(ceil and r['median_ms']/ceil['median_ms'], '.2f')} | "
                         f"{fmt(eager and eager['median_ms']/r['median_ms'], '.2f')} | {fmt(cold, '.1f')} | {fmt(warm, '.1f')} | "
                         f"{fmt(warm/cold if warm is not None and cold else None, '.0%')} | {fmt(r.get('peak_mem_gb'), '.2f')} | "
                         f"{graph_stats(rep)} | {compiled_stats(r)} | {eager_match(r)} |")
    return '\n'.join(L) + '\n'

def plot(data, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    idx = index(data['records'])
    workloads = list(dict.fromkeys(r['workload'] for r in data['records']))
    fig, axs = plt.subplots(1, len(workloads), figsize=(6*len(workloads), 4.5), squeeze=False)
    for ax, w in zip(axs[0], workloads):
        arms = [a for a in ARMS if any(ok(idx, w, a, o) for o in OPTS)]
        for j, o in enumerate(OPTS):
            xs = [i + (j - 0.5)*0.4 for i,a in enumerate(arms) if ok(idx, w, a, o)]
            ys = [ok(idx, w, a, o)['median_ms'] for a in arms if ok(idx, w, a, o)]
            bars = ax.bar(xs, ys, width=0.4, label=OPT_LABELS[o])
            ax.bar_label(bars, fmt='%.1f', fontsize=7)
        if ceil := ok(idx, w, *CEILING): ax.axhline(ceil['median_ms'], color='gray', ls='--', lw=1, label='ceiling')
        ax.set_title(f"{w}: {describe(config(data['records'], w))}", fontsize=9)
        ax.set_xticks(range(len(arms)), [LABELS[a].replace('learn.', '').replace(' ', '\n') for a in arms], fontsize=7)
        ax.set_ylabel('median ms/step')
        ax.legend(fontsize=7)
    env = data['env']
    fig.suptitle(f"fastxtend_compile: {env.get('device')}, torch {env.get('torch')}, fastai {env.get('fastai')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

def data(meta, records)->dict: return dict(env=next((r['env'] for r in records if r.get('env')), {}), meta=meta, records=records)

def write_outputs(data, out:Path, chart=True, quiet=False):
    out.mkdir(parents=True, exist_ok=True)
    (out/'results.json').write_text(json.dumps(data, indent=1))
    (out/'results.md').write_text(render_md(data))
    if not chart: return
    try: plot(data, out/'results.png')
    except Exception as e: print(f"No chart: {type(e).__name__}: {e}")
    if not quiet: print(f"Wrote {out/'results.md'}, results.json, results.png")

def merge(paths)->dict:
    "Records of several results.json files; a later file's record replaces an earlier one's for the same job"
    parts = [json.loads(Path(p).read_text()) for p in paths]
    recs = index(r for d in parts for r in d['records'])
    devices = {d['env'].get('device') for d in parts if d['env']}
    if len(devices) > 1: print(f"Warning: merging results from different devices: {devices}")
    return dict(env=next((d['env'] for d in parts if d['env']), {}), meta=parts[-1]['meta'], records=list(recs.values()))

# ---------------------------------------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='cuda', choices=['cuda', 'cpu'])
    p.add_argument('--out', default=None, help='folder for results.{json,md,png} and arms.log '
                   '(default: bench/results/step_time/latest; smoke: fxc-bench-smoke in the temp folder)')
    p.add_argument('--workloads', default=None, help=f"comma-separated, of {','.join(WORKLOADS)} (default: all; smoke: resnet18,gpt)")
    p.add_argument('--arms', default=None, help=f"comma-separated, of {','.join(ARMS)} (default: {','.join(DEFAULT_ARMS)}, "
                                                "plus fastai_compile_regional on gpt; reduce-overhead arms are skipped on CPU)")
    p.add_argument('--opts', default=','.join(OPTS), help=f"comma-separated, of {','.join(OPTS)}")
    p.add_argument('--hand-fastai-adam', action='store_true', help="also run the hand loops with fastai's Adam (default: fused AdamW only)")
    p.add_argument('--warm', default=None, help="arms that also get a second, warm-cache process: comma-separated, "
                   "'all' compiled arms or 'none' (default: hand_compile,fastai_compile)")
    p.add_argument('--steps', type=int, default=None, help='timed steps per arm (default 100; smoke 3)')
    p.add_argument('--warmup', type=int, default=None, help='warm-up steps per arm, the compile step included (default 20; smoke 1)')
    p.add_argument('--backend', default=None, help="torch.compile backend (default inductor; smoke aot_eager, for speed)")
    p.add_argument('--compile-kwargs', default='{}', help="extra `learn.compile` keyword arguments, as JSON, for the fastai compiled arms")
    p.add_argument('--config', default='{}', help='changes to workload sizes, as JSON by workload, e.g. \'{"gpt": {"n_layer": 4}}\'')
    p.add_argument('--timeout', type=float, default=300, help='seconds per arm process before it is killed')
    p.add_argument('--budget', type=float, default=None, help='start no arm process after this many seconds (the rest are skipped)')
    p.add_argument('--smoke', action='store_true', help='tiny sizes and few steps: checks that every code path runs')
    p.add_argument('--plain', action='store_true', help="feed the fastai arms plain tensors instead of fastai's typed ones")
    p.add_argument('--profile', action='store_true', help="profile the fastai arms' steady steps instead of timing them: "
                   "torch.profiler's operators and kernel launches, and host time by package (profile_*.txt in --out)")
    p.add_argument('--merge', nargs='+', metavar='RESULTS_JSON', help='only combine these results.json files into --out')
    args = p.parse_args()
    out = Path(args.out or (Path(tempfile.gettempdir())/'fxc-bench-smoke' if args.smoke else HERE/'results'/'step_time'/'latest'))
    args.out = str(out)
    if args.merge:
        write_outputs(merge(args.merge), out)
        return
    args.workloads = args.workloads or ('resnet18,gpt' if args.smoke else ','.join(WORKLOADS))
    args.steps = args.steps or (3 if args.smoke else 100)
    args.warmup = args.warmup or (1 if args.smoke else 20)
    args.backend = args.backend or ('aot_eager' if args.smoke else 'inductor')
    for name, valid in (('workloads', WORKLOADS), ('arms', ARMS), ('opts', OPTS)):
        if bad := [v for v in (getattr(args, name) or '').split(',') if v and v not in valid]: p.error(f"unknown {name}: {bad}")
    if args.device == 'cpu' and args.arms and any(ARMS[a][1] == 'reduce-overhead' for a in args.arms.split(',')):
        print("Skipping the reduce-overhead arms: CUDA graphs need a GPU")
    jobs = plan(args)
    if args.profile: jobs = [j for j in jobs if j[1].startswith('fastai') and j[3] == 'cold']
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=datetime.datetime.now().isoformat(timespec='seconds'), git=git_commit(), argv=sys.argv[1:])
    print(f"{len(jobs)} arm processes on {args.device}: {args.workloads}; {args.steps} steps after {args.warmup} warm-up, "
          f"backend {args.backend}, timeout {args.timeout:.0f}s each", flush=True)
    t0, cache_root = time.perf_counter(), Path(tempfile.mkdtemp(prefix='fxc-bench-'))
    write = (lambda recs: None) if args.profile else lambda recs: write_outputs(data(meta, recs), out, chart=False, quiet=True)
    try:
        with open(out/'arms.log', 'w') as log:
            records = run_jobs(jobs, ('workload', 'arm', 'opt', 'phase'), lambda job: run_job(args, job, cache_root, log),
                               write, fmt_progress, args.budget)
    finally: shutil.rmtree(cache_root, ignore_errors=True)
    if not args.profile: write_outputs(data(meta, records), out)
    failed = [r for r in records if r['status'] in ('error', 'timeout')]
    print(f"Done in {time.perf_counter()-t0:.0f}s; {len(failed)} of {len(records)} arm processes failed")
    if failed: sys.exit(1)

if __name__ == '__main__': main()
