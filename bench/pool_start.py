"""How long a model's first compiled training step takes, cold or warm, with inductor's Triton compile processes started
as the compile starts (`early`, as `learn.compile()` starts them: `CompileWorkers`) or left to inductor (`inductor`,
which starts them once TorchDynamo has traced the graph). One process an arm, the text-small workflow's transformer under bf16
autocast, CUDA graphs (`mode='reduce-overhead'`), as the tier a launch-bound fit compiles first:

    python3 bench/pool_start.py --rounds 2 --out OUT      # cold early and cold inductor, each on a fresh cache; then warm
                                                          # early and warm inductor in turn, on the first cold run's cache
    python3 bench/pool_start.py --device cpu --smoke      # the same code on the CPU, tiny (the processes start on CUDA only)

Prints a line an arm and writes `pool_start.json`: the first step's seconds (forward and backward, synchronized), which
is the compile, and the median of the next steps."""
import argparse, json, shutil, statistics, sys, tempfile, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from procs import arm_env, run_process, error_line
from workflow import WORKFLOWS # The text-small workflow's sizes

def child(arm:str, device:str, smoke:bool)->dict:
    "In an arm's own process: compile the model's training step as the arm says; its first step and the next ones' median"
    t0 = time.perf_counter()
    import torch
    from torch import nn
    from arm import TextClassifier
    from fastxtend_compile.core import CompileWorkers
    from fastxtend_compile.internals import compile_workers_started
    imported = time.perf_counter() - t0
    c = WORKFLOWS['text-small']['smoke' if smoke else 'gpu']
    torch.manual_seed(0)
    model = TextClassifier(c['vocab'], c['seq'], c['d'], c['layers'], c['heads'], c['classes']).to(device)
    x = torch.randint(1, c['vocab'], (c['bs'], c['seq']), device=device)
    y = torch.randint(0, c['classes'], (c['bs'],), device=device)
    loss_func, opt = nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), fused=device == 'cuda')
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == 'cuda' else (lambda: None)
    workers = CompileWorkers()
    CompileWorkers.on = arm == 'early'
    workers.start({'backend': 'inductor'}, dev)
    step_fn = torch.compile(model, mode='reduce-overhead' if dev.type == 'cuda' else None)
    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16): loss = loss_func(step_fn(x).float(), y)
        loss.backward(); opt.step(); opt.zero_grad()
    sync(); t = time.perf_counter(); step(); sync(); first = time.perf_counter() - t
    times = []
    for _ in range(30):
        t = time.perf_counter(); step(); sync(); times.append(time.perf_counter() - t)
    workers.stop()
    return dict(arm=arm, import_s=imported, first_s=first, step_ms=1e3*statistics.median(times[5:]), started=compile_workers_started())

def run_arm(arm:str, start:str, cache:Path, args)->dict:
    "One arm's process on `cache` (`start`: cold or warm)"
    cmd = [sys.executable, __file__, '--child', arm, '--device', args.device] + (['--smoke'] if args.smoke else [])
    fin = run_process(cmd, arm_env(cache), args.timeout) # A process group of its own: a timeout ends inductor's workers too
    if fin.rc != 0 or fin.timed_out: return dict(arm=arm, start=start, status='failed', error='timed out' if fin.timed_out else error_line(fin.out or ''))
    res = json.loads(fin.out.strip().splitlines()[-1])
    return dict(res, start=start, status='ok', process_s=fin.wall)

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--child', default=None, help=argparse.SUPPRESS)
    p.add_argument('--device', default='cuda')
    p.add_argument('--smoke', action='store_true', help="tiny sizes, for the CPU")
    p.add_argument('--rounds', type=int, default=2, help="warm rounds: each runs early and inductor, in turns of order")
    p.add_argument('--timeout', type=int, default=150, help="seconds an arm's process may take")
    p.add_argument('--out', default=None, help="folder for pool_start.json (default: a temporary one)")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.device, args.smoke)))
        return
    out = Path(args.out or tempfile.mkdtemp(prefix='fxc-pool-start-'))
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix='fxc-pool-caches-'))
    runs = []
    def show(r):
        runs.append(r)
        print(f"{r['start']:>4} {r['arm']:<8} " + (f"first step {r['first_s']:.2f}s, then {r['step_ms']:.2f} ms a step; "
              f"import {r['import_s']:.1f}s, process {r['process_s']:.1f}s; pool started: {r['started']}" if r['status'] == 'ok'
              else f"FAILED: {r['error']}"), flush=True)
        (out/'pool_start.json').write_text(json.dumps(dict(argv=sys.argv[1:], device=args.device, runs=runs), indent=1))
    try:
        show(run_arm('early', 'cold', tmp/'early', args))
        show(run_arm('inductor', 'cold', tmp/'inductor', args))
        for i in range(args.rounds): # On the first cold run's cache; each round's first arm alternates
            for arm in (('early', 'inductor') if i % 2 == 0 else ('inductor', 'early')): show(run_arm(arm, 'warm', tmp/'early', args))
    finally: shutil.rmtree(tmp, ignore_errors=True)

if __name__ == '__main__': main()
