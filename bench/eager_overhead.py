"""What `learn.compile()` costs a fit it trains eagerly: fits of one process, side by side, each arm in turn.

A fit too short to pay back a compile trains eagerly under `learn.compile()`. Whatever the library adds to it (the
probe, its callback, its optimizer step) shows as the difference between these fits, which run in one process on one
warm GPU, an arm after another in a new order each round, so a drift of the host's speed spreads over every arm.

    eager-fused    torch's fused AdamW (`OptimWrapper`), as a user picks it instead of compiling
    eager          fastai's `Adam`, the optimizer the workflows' Learners make
    compile        `learn.compile()`: on a GPU the background compile, whose probe finds the fit too short to pay back a
                   compile; on the CPU `background=True` does the same
    compile-added  the same, with every backward adding into the gradients fastai's `zero_grad` zeroed, as an eager
                   fastai `Optimizer` does (`ZeroedGrads.on = False`), where `compile` lets it write them
    compile-pinned `compile` with every training batch copied ahead from pinned memory on a side stream, as a compiled
                   batch's is, where `compile` copies an eager batch from the memory it is in
    compile-noprefetch  `compile` with no training batch copied ahead (`pace.prefetches` off): fastai's loop copies each
                   batch in the fit's thread, from pageable memory
    compile-nopace `compile` with none of `Pace` (`Pace.devices` empty): fastai's smooth loss, copied to the host each
                   batch, and no batch copied ahead

    python bench/eager_overhead.py --workflows vision,tabular --rounds 3 --out DIR
    python bench/eager_overhead.py --smoke --out /tmp/eo            # tiny, on the CPU

Each fit also times its training batches on the host's clock, from one batch's start to the next within an epoch: the
median of those is the fit's pace, steadier than its whole time, which epochs' starts, validation and the host's
hiccups move by 10% and more on a GPU machine.

A warm-up fit of the first arm runs first and is not counted. Prints each fit's seconds and each arm's median, and
what `learn.compile()`'s report said of its fits; writes DIR/eager_overhead.json (every fit) and DIR/eager_overhead.md.
The inductor cache is a fresh folder of its own: nothing compiles, so no arm finds another's code.
"""
from __future__ import annotations
import argparse, json, os, statistics, sys, tempfile, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
os.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', tempfile.mkdtemp(prefix='fxc-eager-overhead-'))
import torch
import torch._dynamo # noqa: F401 (imported before any fit is timed, as learn.compile() and torch's fused AdamW import it)
from workflow import BUILDERS, WORKFLOWS, fused_adamw, write_images
from procs import git_commit, versions
from fastai.torch_core import set_seed
from fastai.callback.core import Callback
import fastxtend_compile # noqa: F401 (learn.compile)
from fastxtend_compile.optimizer import ZeroedGrads
import fastxtend_compile.pace as pace

ARMS = ('eager-fused', 'eager', 'compile', 'compile-added', 'compile-pinned', 'compile-noprefetch', 'compile-nopace')

class BatchClock(Callback):
    "The host's seconds from each training batch's start to the next's, within an epoch"
    order = -100 # Before every other callback's `before_batch`
    def __init__(self): self.gaps, self.last = [], None
    def before_train(self): self.last = None
    def before_batch(self):
        if not self.training: return
        now = time.perf_counter()
        if self.last is not None: self.gaps.append(now - self.last)
        self.last = now

def one_fit(w:str, c:dict, data, device:str, arm:str)->dict:
    "Build a new Learner of workflow `w`, train it as `arm` does, and time its fit"
    set_seed(0) # Python's, numpy's and torch's generators: every arm shuffles and augments alike
    learn, fit = BUILDERS[w](w, c, data, device, None if device == 'cuda' else 0)
    if arm == 'eager-fused': learn.opt_func = fused_adamw()
    if arm.startswith('compile'): learn.compile(**({} if device == 'cuda' else dict(background=True)))
    ZeroedGrads.on = arm != 'compile-added'
    prefetches, devices, after_batch = pace.prefetches, pace.Pace.devices, pace.Pace.after_batch
    if arm == 'compile-pinned': pace.Pace.after_batch = lambda self, eager: None
    if arm == 'compile-noprefetch': pace.prefetches = lambda dl: False
    if arm == 'compile-nopace': pace.Pace.devices = ()
    clock = BatchClock()
    learn.add_cb(clock)
    sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
    sync()
    t = time.perf_counter()
    try:
        with learn.no_bar(), learn.no_logging(): fit()
        sync()
    finally: ZeroedGrads.on, pace.prefetches, pace.Pace.devices, pace.Pace.after_batch = True, prefetches, devices, after_batch
    took = time.perf_counter() - t
    said = [l.strip() for l in str(learn.compiler.report).splitlines() if 'eagerly' in l] if arm.startswith('compile') else []
    return dict(workflow=w, arm=arm, fit_s=took, batch_ms=1e3*statistics.median(clock.gaps), loss=float(learn.recorder.losses[-1]), report=said)

def main():
    p = argparse.ArgumentParser()
    p.add_argument('--workflows', default='vision,tabular')
    p.add_argument('--arms', default=','.join(ARMS))
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--smoke', action='store_true', help='tiny sizes on the CPU')
    p.add_argument('--out', default=None)
    a = p.parse_args()
    device = 'cuda' if torch.cuda.is_available() and not a.smoke else 'cpu'
    arms, out = a.arms.split(','), Path(a.out or tempfile.mkdtemp(prefix='fxc-eager-overhead-out-'))
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(env=versions(device), commit=git_commit(), rounds=a.rounds, device=device, date=time.strftime('%Y-%m-%d'))
    fits = []
    for w in a.workflows.split(','):
        c = WORKFLOWS[w]['smoke' if a.smoke else 'gpu']
        data = None
        if w.startswith('vision'):
            data = Path(tempfile.mkdtemp(prefix='fxc-eager-overhead-data-'))
            write_images(data, c)
        one_fit(w, c, data, device, arms[0]) # Warm-up: CUDA's libraries, cuDNN's choices, the first DataLoader workers
        for r in range(a.rounds):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]: # Each round starts one arm later
                f = one_fit(w, c, data, device, arm)
                fits.append(dict(f, round=r))
                print(f"{w:<8} round {r} {arm:<18} {f['fit_s']:7.2f}s  {f['batch_ms']:7.3f} ms a batch  loss {f['loss']:.4f}  {' | '.join(f['report'])}", flush=True)
        (out/'eager_overhead.json').write_text(json.dumps(dict(meta=meta, fits=fits), indent=1))
    L = [f"# What learn.compile() costs a fit it trains eagerly ({meta['env'].get('device', device)}, torch {meta['env'].get('torch')}, "
         f"library at {meta['commit']})", "", "| workflow | arm | fits (s) | median | × eager-fused | a training batch, median (ms) | × eager-fused |",
         "|---|---|---|---:|---:|---:|---:|"]
    for w in a.workflows.split(','):
        med = {arm: statistics.median([f['fit_s'] for f in fits if f['workflow'] == w and f['arm'] == arm]) for arm in arms}
        pace_ms = {arm: statistics.median([f['batch_ms'] for f in fits if f['workflow'] == w and f['arm'] == arm]) for arm in arms}
        for arm in arms:
            runs = ', '.join(f"{f['fit_s']:.2f}" for f in fits if f['workflow'] == w and f['arm'] == arm)
            ratio = f"{med[arm]/med['eager-fused']:.3f}" if 'eager-fused' in med else ''
            paced = f"{pace_ms[arm]/pace_ms['eager-fused']:.3f}" if 'eager-fused' in pace_ms else ''
            L.append(f"| {w} | {arm} | {runs} | {med[arm]:.2f} | {ratio} | {pace_ms[arm]:.3f} | {paced} |")
    (out/'eager_overhead.md').write_text('\n'.join(L) + '\n')
    print('\n'.join(L))

if __name__ == '__main__': main()
