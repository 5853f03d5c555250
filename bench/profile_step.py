"""Profile steady-state training steps of one fastai workload, to see where the time goes that compiling doesn't save.

    python bench/profile_step.py --workload resnet18 --opt fastai_adam --out bench/results/profile_resnet18.txt

Trains with `learn.compile()` (or eagerly with `--eager`), then profiles `--steps` batches after `--warmup` with
`torch.profiler`: the top operators by self CPU and by device time, CUDA kernel launches per step, and CPU and device
time per step.
"""
import argparse, sys, time
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
    n = args.warmup + args.steps
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
        def after_fit(self):
            if device.type == 'cuda': torch.cuda.synchronize()
            self.wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
    dls = DataLoaders(DataLoader(Cycle(), bs=None), DataLoader(Cycle(), bs=None), device=device)
    dls.valid.n = 0
    opt_func = Adam if args.opt == 'fastai_adam' else partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))
    prof_cb = Profile()
    cbs = [prof_cb] + ([MixedPrecision(amp_mode='bf16')] if device.type == 'cuda' else [])
    learn = Learner(dls.to(device), make_model(cfg).to(device), loss_func=CrossEntropyLossFlat(), opt_func=opt_func, lr=LR, cbs=cbs)
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    learn.logger = noop
    if not args.eager: learn.compile()
    learn.fit(1)
    ev = prof_cb.prof.key_averages()
    launches = sum(e.count for e in ev if e.key in ('cudaLaunchKernel', 'cuLaunchKernel', 'cudaLaunchKernelExC', 'cuLaunchKernelEx'))
    dev_attr = 'self_device_time_total' if hasattr(ev[0], 'self_device_time_total') else 'self_cuda_time_total'
    dev_total = sum(getattr(e, dev_attr, 0) for e in ev)
    lines = [f"{args.workload}, {args.opt}, {'eager' if args.eager else 'learn.compile()'}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}",
             f"wall {prof_cb.wall / args.steps * 1e3:.2f} ms/step (profiled); device busy {dev_total / args.steps / 1e3:.2f} ms/step; "
             f"{launches / args.steps:.0f} kernel launches/step",
             "", "Top operators by self CPU time:", ev.table(sort_by='self_cpu_time_total', row_limit=15)]
    if device.type == 'cuda': lines += ["Top operators by device time:", ev.table(sort_by=dev_attr, row_limit=12)]
    report = '\n'.join(lines)
    print(report)
    if args.out: Path(args.out).write_text(report)

if __name__ == '__main__': main()
