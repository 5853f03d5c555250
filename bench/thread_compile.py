"""Whether a model's cold compile can run beside the fit in a thread of its own process, rather than in the fit's path
or a worker process: what it costs the eager steps that run meanwhile, and how long the compile takes there.

A training loop of the workflow's transformer (bench/arm.py's `TextClassifier`, bf16 autocast, torch's fused AdamW)
runs `--steps` steps on batches made on the device. Each arm is a process of its own with a fresh inductor cache:

    eager           every step eager
    path            eager until step `--at`, which compiles the model (`--mode`) in the loop's path; compiled after it
    thread          at step `--at` a thread compiles a copy of the model (`--mode`): its forward and backward on one
                    batch, into inductor's caches. The loop goes on eagerly; once the thread is done, the model compiles
                    in the loop's path from those caches, and the steps after it run compiled
    thread-default  as `thread`, the copy compiled with the default mode (no CUDA graphs): the loop's compile with
                    `--mode` then finds inductor's code of the default, not of the mode

    python3 bench/thread_compile.py --size text --steps 2000 --out OUT        # on one GPU
    python3 bench/thread_compile.py --device cpu --smoke                      # the same code on the CPU, tiny

Prints a line an arm and writes `thread_compile.json`: the whole loop's seconds, the compile's seconds (in the path, or
in the thread then the warm compile in the path), the eager steps run while the thread compiled, and the eager step's
mean seconds before and during the compile, and the compiled step's after it."""
from __future__ import annotations
import argparse, copy, json, sys, tempfile, threading, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from procs import arm_env, run_process, error_line, versions, git_commit
from workflow import WORKFLOWS # The transformers' sizes: the text workflows'

ARMS = ('eager', 'path', 'thread', 'thread-default')

def child(arm:str, args)->dict:
    "In an arm's own process: the training loop the arm says, timed"
    import torch
    from torch import nn
    from arm import TextClassifier
    c, dev = WORKFLOWS[args.size]['smoke' if args.smoke else 'gpu'], torch.device(args.device)
    cuda = dev.type == 'cuda'
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    torch.manual_seed(0)
    model = TextClassifier(c['vocab'], c['seq'], c['d'], c['layers'], c['heads'], c['classes']).to(dev)
    xs = [torch.randint(1, c['vocab'], (c['bs'], c['seq']), device=dev) for _ in range(8)]
    ys = [torch.randint(0, c['classes'], (c['bs'],), device=dev) for _ in range(8)]
    loss_func, opt = nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), fused=cuda)
    mode = None if args.mode == 'default' else args.mode
    amp = lambda: torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda)

    def forward_backward(fn, x, y):
        with amp(): loss = loss_func(fn(x).float(), y)
        loss.backward()

    def step(fn, i):
        forward_backward(fn, xs[i % 8], ys[i % 8])
        opt.step(); opt.zero_grad()

    box = {}
    def compile_copy(twin, x, y):
        "The thread's work: the copy's forward and backward, compiled cold"
        t = time.perf_counter()
        try:
            forward_backward(torch.compile(twin, mode=None if arm == 'thread-default' else mode), x, y)
            sync()
        except Exception as e: box['error'] = f'{type(e).__name__}: {e}'
        box['thread_s'] = time.perf_counter() - t

    fn, thread, marks, res, switch = model, None, {}, dict(arm=arm, switch=args.switch), sys.getswitchinterval()
    def mark(name, i): sync(); marks[name] = (i, time.perf_counter())
    mark('start', 0)
    for i in range(args.steps):
        if i == args.at // 2: mark('before', i)
        if i == args.at:
            mark('at', i)
            if arm == 'path':
                fn = torch.compile(model, mode=mode)
                step(fn, i); mark('compiled', i + 1)
                res['path_s'] = marks['compiled'][1] - marks['at'][1]
                continue
            if arm.startswith('thread'):
                twin = copy.deepcopy(model) # In the loop's thread, between its steps
                thread = threading.Thread(target=compile_copy, args=(twin, xs[0].clone(), ys[0].clone()), daemon=True)
                if args.switch: sys.setswitchinterval(args.switch) # How long the compiling thread may hold the GIL the loop waits for
                thread.start()
        if thread is not None and not thread.is_alive():
            thread.join(); thread = None
            sys.setswitchinterval(switch)
            mark('thread_done', i)
            res.update(box, eager_meanwhile=i - args.at)
            fn = torch.compile(model, mode=mode)
            step(fn, i); mark('compiled', i + 1)
            res['path_s'] = marks['compiled'][1] - marks['thread_done'][1]
            continue
        if 'compiled' in marks and i == marks['compiled'][0] + 20: mark('steady', i)
        step(fn, i)
    mark('end', args.steps)
    if thread is not None: # The process waits for the thread's compile to end, out of the loop's time
        res.update(unfinished=True, eager_meanwhile=args.steps - args.at)
        thread.join()
    per = lambda a, b: (marks[b][1] - marks[a][1]) / max(marks[b][0] - marks[a][0], 1)
    res.update(total_s=marks['end'][1] - marks['start'][1], eager_step_ms=1e3*per('before', 'at'))
    if 'thread_done' in marks: res['eager_during_ms'] = 1e3*per('at', 'thread_done')
    if 'steady' in marks: res['compiled_step_ms'] = 1e3*per('steady', 'end')
    return res

def run_arm(arm:str, args, tmp:Path)->dict:
    "One arm in a process of its own, with a fresh inductor cache"
    cmd = [sys.executable, __file__, '--child', arm, '--device', args.device, '--size', args.size, '--steps', str(args.steps),
           '--at', str(args.at), '--mode', args.mode] + ([] if args.switch is None else ['--switch', str(args.switch)]) + (['--smoke'] if args.smoke else [])
    fin = run_process(cmd, arm_env(tmp/arm), args.timeout)
    if fin.rc != 0 or fin.timed_out: return dict(arm=arm, status='timed out' if fin.timed_out else 'failed', error=error_line(fin.out or ''))
    return dict(json.loads(fin.out.strip().splitlines()[-1]), status='ok', process_s=fin.wall)

def show(r:dict)->str:
    if r['status'] != 'ok': return f"{r['arm']:<15} {r['status']}: {r.get('error')}"
    f = lambda k, spec='.2f': '—' if r.get(k) is None else format(r[k], spec)
    return (f"{r['arm']:<15} loop {f('total_s', '.1f')}s; compile in the path {f('path_s')}s, in the thread {f('thread_s')}s; "
            f"eager steps meanwhile {r.get('eager_meanwhile', '—')}; eager step {f('eager_step_ms')} ms, during {f('eager_during_ms')} ms; "
            f"compiled step {f('compiled_step_ms')} ms" + (f"; thread error {r['error']}" if r.get('error') else '')
            + ('; the thread was still compiling at the end' if r.get('unfinished') else ''))

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--child', default=None, help=argparse.SUPPRESS)
    p.add_argument('--device', default='cuda')
    p.add_argument('--size', default='text', choices=['text', 'text-small'], help="the workflow whose transformer trains")
    p.add_argument('--steps', type=int, default=2000, help="training steps in each arm's loop")
    p.add_argument('--at', type=int, default=40, help="the step at which the compile starts")
    p.add_argument('--mode', default='reduce-overhead', help="the `torch.compile` mode the loop runs compiled ('default' for none)")
    p.add_argument('--arms', default=','.join(ARMS))
    p.add_argument('--switch', type=float, default=None, help="Python's switch interval (seconds) while the thread compiles; default: Python's")
    p.add_argument('--smoke', action='store_true', help="tiny sizes, for the CPU")
    p.add_argument('--timeout', type=int, default=200, help="seconds an arm's process may take")
    p.add_argument('--out', default=None, help="folder for thread_compile.json (default: a temporary one)")
    args = p.parse_args()
    if args.smoke and args.device == 'cpu': args.mode = 'default' if args.mode == 'reduce-overhead' else args.mode
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    out = Path(args.out or tempfile.mkdtemp(prefix='fxc-thread-compile-'))
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix='fxc-thread-caches-'))
    meta = dict(versions(args.device), git=git_commit(), date=time.strftime('%Y-%m-%d'), size=args.size, steps=args.steps,
                at=args.at, mode=args.mode, switch=args.switch, smoke=args.smoke)
    runs = []
    for arm in args.arms.split(','):
        runs.append(run_arm(arm, args, tmp))
        print(show(runs[-1]), flush=True)
        (out/'thread_compile.json').write_text(json.dumps(dict(meta=meta, runs=runs), indent=1))
    if any(r['status'] != 'ok' for r in runs): sys.exit(1)

if __name__ == '__main__': main()
