"""Where a compiled fit's steady batches spend their time: torch.profiler over training batches of a later epoch.

    python bench/profile_fit.py --workflow text --epochs 3 --arm tiers   # learn.compile(), profiled in the last epoch
    python bench/profile_fit.py --workflow text --arm eager-fused        # torch's fused AdamW, eagerly

Prints each epoch's training time and its time between batches (the DataLoader, and the callbacks' `before_batch`); for the profiled batches, their wall time, the GPU's
busy time in them, the host calls that can wait for the GPU (synchronizations, copies, launches), the top host
operations, the processes beside the fit, and the Python lines that called `Tensor.item` or `torch.cuda.synchronize`
(an `.item()` of a GPU tensor waits for the GPU). `--smoke` runs it tiny on the CPU.
"""
import argparse, collections, sys, time, traceback
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import torch
from workflow import BUILDERS, WORKFLOWS, fused_adamw
import fastxtend_compile # noqa: F401
from fastai.callback.core import Callback
from torch.profiler import profile, ProfilerActivity

p = argparse.ArgumentParser()
p.add_argument('--workflow', default='text'); p.add_argument('--epochs', type=int, default=3)
p.add_argument('--arm', default='tiers', choices=['tiers', 'eager-fused', 'ro'])
p.add_argument('--batches', type=int, default=60); p.add_argument('--smoke', action='store_true')
p.add_argument('--cprofile', action='store_true', help="profile the fit's thread's Python over the last epoch (training and validation) with cProfile instead of torch.profiler")
p.add_argument('--num-workers', type=int, default=None, help="DataLoader workers (default: fastai's)")
args = p.parse_args()
cuda = torch.cuda.is_available() and not args.smoke
device = 'cuda' if cuda else 'cpu'
c = dict(WORKFLOWS[args.workflow]['smoke' if args.smoke else 'gpu'], epochs=args.epochs)
torch.manual_seed(0)
learn, fit = BUILDERS[args.workflow](args.workflow, c, None, device, args.num_workers if cuda else 0)
learn.opt_func = fused_adamw()
if args.arm == 'tiers': learn.compile(**({} if cuda else dict(backend='aot_eager', background=False)))
if args.arm == 'ro': learn.compile(mode='reduce-overhead', background=False)

sites, prof = collections.Counter(), None
def spy(name, orig):
    def f(*a, **k):
        if prof is not None and prof.on: sites[name + ': ' + ' <- '.join(f"{Path(s.filename).name}:{s.lineno}:{s.name}" for s in traceback.extract_stack()[-6:-1])] += 1
        return orig(*a, **k)
    return f
torch.Tensor.item = spy('item', torch.Tensor.item)
torch.cuda.synchronize = spy('synchronize', torch.cuda.synchronize)

class Prof(Callback):
    "Profiles `--batches` training batches from the middle of the last epoch"
    order = 2000
    def __init__(self): self.on, self.p, self.t, self.first = False, None, None, None
    def before_batch(self):
        if args.cprofile: return
        if self.training and self.epoch == self.n_epoch - 1 and self.iter == self.n_iter // 3:
            if cuda: torch.cuda.synchronize()
            self.p = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self.p.__enter__(); self.on, self.t, self.first = True, time.perf_counter(), self.iter
    def after_batch(self):
        if self.on and self.iter == self.first + args.batches - 1:
            if cuda: torch.cuda.synchronize()
            wall = time.perf_counter() - self.t
            self.on = False
            self.p.__exit__(None, None, None)
            ev = self.p.key_averages()
            gpu = sum(e.self_device_time_total for e in ev if e.device_type.name == 'CUDA') / 1e3 if cuda else 0
            print(f"\n== {args.arm}: {args.batches} training batches in {wall*1e3:.0f} ms ({wall*1e3/args.batches:.2f} ms a batch); "
                  f"GPU kernels and copies {gpu:.0f} ms ({gpu/args.batches:.2f} ms a batch)")
            waits = [e for e in ev if any(k in e.key for k in ('Synchronize', 'cudaMemcpy', 'local_scalar', 'cudaStreamWait', 'cudaEventQuery', 'cudaGraphLaunch', 'cudaLaunchKernel'))]
            for e in sorted(waits, key=lambda e: -e.cpu_time_total): print(f"  {e.key:42s} calls {e.count:6d}  host {e.cpu_time_total/1e3:8.1f} ms")
            print("  host ops by self time:")
            for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:14]: print(f"  {e.key[:42]:42s} calls {e.count:6d}  self {e.self_cpu_time_total/1e3:8.1f} ms")
            try:
                import psutil
                kids = psutil.Process().children(recursive=True)
                print(f"  child processes: {len(kids)}, their CPU seconds: {sum(sum(k.cpu_times()[:2]) for k in kids):.1f}; "
                      f"this process's threads: {psutil.Process().num_threads()}")
            except Exception as e: print('  no psutil:', e)
            print("  Python calls of `Tensor.item` and `torch.cuda.synchronize`, while profiled:")
            for k, v in sites.most_common(8): print(f"  {v:5d}  {k}")
prof = Prof()
learn.add_cb(prof)
class CProf(Callback):
    "cProfile over the last epoch, from its training's start to its validation's end: the fit's thread's Python, by function"
    order = -2000
    def __init__(self): self.p = None
    def before_epoch(self):
        if self.epoch != self.n_epoch - 1: return
        import cProfile
        self.p = cProfile.Profile(); self.p.enable()
    def after_epoch(self):
        if self.p is None: return
        self.p.disable()
        import pstats, io
        for key, n in (('cumulative', 60), ('tottime', 35)):
            out = io.StringIO(); pstats.Stats(self.p, stream=out).sort_stats(key).print_stats(n)
            print(f"\n== cProfile of the last epoch, by {key}\n" + '\n'.join(l[:220] for l in out.getvalue().splitlines()[4:]))
if args.cprofile: learn.add_cb(CProf())
class Epochs(Callback):
    "Each epoch's training time, and its time between batches: from this callback's `after_batch` to its next `before_batch`"
    order = 1999 # Last but one at each event: between batches counts the DataLoader and the other callbacks' `before_batch`
    def before_train(self): self.t, self.wait, self.mark = time.perf_counter(), 0., time.perf_counter()
    def before_batch(self):
        if self.training: self.wait += time.perf_counter() - self.mark
    def after_batch(self):
        if self.training: self.mark = time.perf_counter()
    def after_train(self):
        if cuda: torch.cuda.synchronize()
        print(f"epoch {self.epoch}: train {time.perf_counter()-self.t:.2f}s, between batches {self.wait:.2f}s")
learn.add_cb(Epochs())
t = time.perf_counter()
with learn.no_bar(): fit()
print(f"fit {time.perf_counter()-t:.1f}s")
