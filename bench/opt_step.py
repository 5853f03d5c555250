"""What compiling fastai's optimizer step saves: fastai's eager step against the step `compile_optimizer` compiles.

The parameters of a torchvision ResNet-50 (161 tensors, 25.6M values) in three parameter groups, with gradients already
in place, and a new learning rate every step, as a one-cycle schedule gives. Each optimizer in each way runs in a
process of its own with a fresh inductor cache (`procs.py`); PyTorch's foreach `AdamW` is measured for comparison.
Prints a markdown table of median milliseconds a step, and the compile's seconds.

    python3 bench/opt_step.py --device cuda
    python3 bench/opt_step.py --device cpu --smoke      # every code path, tiny and quick; its timings mean nothing
"""
import argparse, datetime, json, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import arm_env, run_process, versions, env_line, git_commit

OPTS = ('Adam', 'SGD', 'RAdam', 'Lamb')
WAYS = ('eager', 'compiled')

def make_opt(name:str, params:list):
    "fastai's optimizer `name` over `params` split into three groups"
    from fastai.optimizer import Adam, SGD, RAdam, Lamb
    third = len(params) // 3
    groups = [params[:third], params[third:2*third], params[2*third:]]
    if name == 'SGD': return SGD(groups, lr=1e-3, mom=0.9)
    return dict(Adam=Adam, RAdam=RAdam, Lamb=Lamb)[name](groups, lr=1e-3)

def time_steps(step, set_lr, steps:int, sync)->list:
    "Milliseconds of each of `steps` calls of `step`, each after a new learning rate"
    res = []
    for i in range(steps):
        set_lr(1e-3 * (1 + i % 7) / 7)
        sync(); t0 = time.perf_counter()
        step()
        sync(); res.append((time.perf_counter() - t0) * 1e3)
    return res

def arm(opt_name:str, way:str, device:str, steps:int, warmup:int, smoke:bool)->dict:
    "One optimizer one way, in this process: median ms a step after `warmup` steps, and the first step's seconds"
    import torch
    from torchvision.models import resnet18, resnet50
    model = (resnet18 if smoke else resnet50)().to(device)
    params = list(model.parameters())
    for p in params: p.grad = torch.randn_like(p) * 1e-3
    sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
    if opt_name == 'AdamW':
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
        step = opt.step
        def set_lr(lr):
            for g in opt.param_groups: g['lr'] = lr
    else:
        opt = make_opt(opt_name, params)
        if way == 'compiled':
            from fastxtend_compile import compile_optimizer
            opt = compile_optimizer(opt, fused=False) # fastai's `Adam` compiled too, not run as PyTorch's fused kernel
        step, set_lr = opt.step, (lambda lr: opt.set_hyper('lr', lr))
    sync(); t0 = time.perf_counter(); step(); sync()
    first = time.perf_counter() - t0
    times = time_steps(step, set_lr, warmup + steps, sync)[warmup:]
    return dict(opt=opt_name, way=way, ms=statistics.median(times), first_s=first, n_params=len(params))

def table(records:list)->str:
    "The markdown table of `records`: one row an optimizer"
    by = {(r['opt'], r['way']): r for r in records}
    rows = ['| optimizer | fastai eager | compiled | × faster | compile (first step) |', '|---|---:|---:|---:|---:|']
    for o in OPTS:
        e, c = by.get((o, 'eager')), by.get((o, 'compiled'))
        cell = lambda r: f"{r['ms']:.2f} ms" if r else ''
        ratio = f"{e['ms']/c['ms']:.1f}×" if e and c else ''
        rows.append(f"| `{o}` | {cell(e)} | {cell(c)} | {ratio} | {c['first_s']:.1f} s |" if c else f"| `{o}` | {cell(e)} | | | |")
    if (a := by.get(('AdamW', 'eager'))): rows.append(f"| PyTorch's foreach `AdamW` | {a['ms']:.2f} ms | | | |")
    return '\n'.join(rows)

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='cuda', choices=['cuda', 'cpu'])
    p.add_argument('--steps', type=int, default=None, help='timed steps an arm (default 100; smoke 3)')
    p.add_argument('--warmup', type=int, default=None, help='steps before timing, after the first (default 10; smoke 1)')
    p.add_argument('--smoke', action='store_true', help='a ResNet-18 and few steps: checks that every code path runs')
    p.add_argument('--out', default=None, help='folder for opt_step.json and opt_step.md (default: a temporary folder)')
    p.add_argument('--timeout', type=float, default=300, help='seconds an arm before it is killed')
    p.add_argument('--child', default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    steps, warmup = a.steps or (3 if a.smoke else 100), a.warmup or (1 if a.smoke else 10)
    if a.child:
        opt_name, way = a.child.split(':')
        print(json.dumps(arm(opt_name, way, a.device, steps, warmup, a.smoke)))
        return
    out = Path(a.out or tempfile.mkdtemp(prefix='fxc-opt-step-')); out.mkdir(parents=True, exist_ok=True)
    records = []
    for opt_name, way in [(o, w) for o in OPTS for w in WAYS] + [('AdamW', 'eager')]:
        cmd = [sys.executable, __file__, '--device', a.device, '--steps', steps, '--warmup', warmup, '--child', f'{opt_name}:{way}']
        if a.smoke: cmd.append('--smoke')
        with tempfile.TemporaryDirectory(prefix='fxc-opt-cache-') as cache:
            fin = run_process(cmd, arm_env(cache), a.timeout)
        last = (fin.out or '').strip().splitlines()[-1:]
        if fin.rc != 0 or not last: print(f'{opt_name} {way}: failed (exit {fin.rc})\n{fin.tail(20)}'); continue
        records.append(json.loads(last[0]))
        print(f"{opt_name} {way}: {records[-1]['ms']:.2f} ms a step, first step {records[-1]['first_s']:.1f} s", flush=True)
    env, meta = versions(a.device), dict(git=git_commit(), date=datetime.date.today().isoformat())
    md = f"{env_line(env, meta)}\n\n{table(records)}\n"
    (out/'opt_step.json').write_text(json.dumps(dict(env=env, meta=meta, records=records), indent=1))
    (out/'opt_step.md').write_text(md)
    print(f'\n{md}\nWrote {out}/opt_step.md and opt_step.json')
    sys.exit(0 if len(records) == len(OPTS) * len(WAYS) + 1 else 1)

if __name__ == '__main__': main()
