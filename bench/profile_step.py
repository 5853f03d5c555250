"""Profile steady-state training steps of one fastai workload, to see where the time goes that compiling doesn't save.

    python bench/profile_step.py --workload resnet18 --opt fastai_adam --out bench/results/profile_resnet18.txt

Trains with `learn.compile()` (`--mode reduce-overhead` for CUDA graphs, `--eager` without compiling), then profiles
`--steps` batches after `--warmup` with `torch.profiler`: the top operators by self CPU and by device time, CUDA kernel
launches per step, and CPU and device time per step. The next `--steps` batches run under Python's `cProfile`: host
time per step by package (fastai, fastcore, this library, torch) and the top Python functions, which is where a step
bound by the host spends it.
"""
import argparse, cProfile, io, os, pstats, sys, time
from functools import partial
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from torch.profiler import profile, ProfilerActivity
from arm import WORKLOADS, LR, make_model, make_batches

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--workload', choices=WORKLOADS, default='resnet18')
    p.add_argument('--opt', choices=['fastai_adam', 'fused_adamw'], default='fastai_adam')
    p.add_argument('--eager', action='store_true', help='profile without compiling')
    p.add_argument('--mode', default=None, help="`learn.compile` mode, e.g. reduce-overhead")
    p.add_argument('--warmup', type=int, default=30)
    p.add_argument('--steps', type=int, default=20)
    p.add_argument('--out', default=None, help='also write the report to this file')
    args = p.parse_args()
    from fastcore.basics import noop
    from fastai.callback.core import Callback
    from fastai.callback.fp16 import MixedPrecision
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.optimizer import Adam, OptimWrapper
    import fastxtend_compile

    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    cfg = WORKLOADS[args.workload]['full']
    batches = make_batches(cfg, device)
    n = args.warmup + 2*args.steps
    class Cycle:
        def __len__(self): return n
        def __getitem__(self, i): return batches[i % len(batches)]
    class Profile(Callback):
        order = 1000
        def before_batch(self):
            if self.training and self.iter == args.warmup:
                if device.type == 'cuda': torch.cuda.synchronize()
                self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else []))
                self.prof.__enter__(); self.t0 = time.perf_counter()
            if self.training and self.iter == args.warmup + args.steps: # torch.profiler's steps are done: Python's next
                if device.type == 'cuda': torch.cuda.synchronize()
                self.wall = time.perf_counter() - self.t0
                self.prof.__exit__(None, None, None)
                self.py = cProfile.Profile(); self.py.enable()
        def after_fit(self): self.py.disable()
    dls = DataLoaders(DataLoader(Cycle(), bs=None), DataLoader(Cycle(), bs=None), device=device)
    dls.valid.n = 0
    opt_func = Adam if args.opt == 'fastai_adam' else partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))
    prof_cb = Profile()
    cbs = [prof_cb] + ([MixedPrecision(amp_mode='bf16')] if device.type == 'cuda' else [])
    learn = Learner(dls.to(device), make_model(cfg).to(device), loss_func=CrossEntropyLossFlat(), opt_func=opt_func, lr=LR, cbs=cbs)
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    learn.logger = noop
    if not args.eager: learn.compile(mode=args.mode)
    learn.fit(1)
    ev = prof_cb.prof.key_averages()
    launches = sum(e.count for e in ev if e.key in ('cudaLaunchKernel', 'cuLaunchKernel', 'cudaLaunchKernelExC', 'cuLaunchKernelEx'))
    dev_attr = 'self_device_time_total' if hasattr(ev[0], 'self_device_time_total') else 'self_cuda_time_total'
    dev_total = sum(getattr(e, dev_attr, 0) for e in ev)
    what = 'eager' if args.eager else f"learn.compile({f'mode={args.mode!r}' if args.mode else ''})"
    lines = [f"{args.workload}, {args.opt}, {what}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}",
             f"wall {prof_cb.wall / args.steps * 1e3:.2f} ms/step (profiled); device busy {dev_total / args.steps / 1e3:.2f} ms/step; "
             f"{launches / args.steps:.0f} kernel launches/step",
             "", "Top operators by self CPU time:", ev.table(sort_by='self_cpu_time_total', row_limit=15)]
    if device.type == 'cuda': lines += ["Top operators by device time:", ev.table(sort_by=dev_attr, row_limit=12)]
    lines += python_profile(prof_cb.py, args.steps)
    report = '\n'.join(lines)
    print(report)
    if args.out: Path(args.out).write_text(report)

PACKAGES = ('fastxtend_compile', 'fastai', 'fastcore', 'fastprogress', 'torch')

def _package(file:str)->str|None:
    if 'torchinductor' in file or file.startswith(os.environ.get('TORCHINDUCTOR_CACHE_DIR') or '\0'): return 'compiled code'
    return next((k for k in PACKAGES if f'/{k}/' in file), None)

def python_profile(py:cProfile.Profile, steps:int)->list:
    "Host time per step by package (time spent in each package's own Python code and the C functions it calls), and the top functions"
    st = pstats.Stats(py)
    by_pkg, total = {}, 0.
    for (file, line, fn), (cc, nc, tt, ct, callers) in st.stats.items():
        if file == '~': # A C function: count it for the package of the Python that called it most
            caller = max(callers.items(), key=lambda kv: kv[1][2], default=None)
            pkg = (caller and _package(caller[0][0])) or 'other'
        else: pkg = _package(file) or 'other'

        by_pkg[pkg] = by_pkg.get(pkg, 0.) + tt
        total += tt
    lines = ["", f"Host time under cProfile: {total/steps*1e3:.2f} ms/step, by the package whose code spends it:"]
    lines += [f"  {k:18s} {v/steps*1e3:6.2f} ms/step  {v/total:5.1%}" for k,v in sorted(by_pkg.items(), key=lambda kv: -kv[1])]
    out = io.StringIO()
    pstats.Stats(py, stream=out).sort_stats('tottime').print_stats(25)
    table = out.getvalue()
    return lines + ["", "Top Python functions by own time:", table[table.find('   ncalls'):]]

if __name__ == '__main__': main()
