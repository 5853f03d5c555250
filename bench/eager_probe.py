"""How an eager training batch timed alone compares with the pace the eager fit keeps, in one process.

`learn.compile()` judges a new model state by its eager step: each of its first batches timed alone, from no work
queued on the device to all of it done. A fit's eager batches do not wait for the device at their ends, so the next
batch's host work overlaps the last one's device work. This script trains a workflow's fit eagerly with torch's fused
AdamW (no compiling) and times its training batches in windows that take turns:

    alone    each batch from a device sync to a device sync, as the probe times it
    paced    the window's batches back to back, a device sync at its two ends only: the fit's own pace

    python3 bench/eager_probe.py --workflow text --epochs 1 --out OUT       # on one GPU
    python3 bench/eager_probe.py --device cpu --smoke                      # the same code on the CPU, tiny

Prints the medians and writes `eager_probe.json`: the median batch of each kind, their ratio, and every window's
numbers. Windows begin after the first `--skip` training batches; a paced window that an epoch's end cuts is left out.
A paced batch includes the host's wait for the DataLoader, which an alone batch does not: `paced_wait_ms` is that wait."""
from __future__ import annotations
import argparse, json, statistics, sys, tempfile, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from procs import ROOT, versions, git_commit
from workflow import WORKFLOWS, BUILDERS, fused_adamw

def measure(args)->dict:
    "Train the workflow's fit eagerly, timing its training batches in windows, alone and paced by turns"
    sys.path.insert(0, str(ROOT))
    import torch
    from fastai.callback.core import Callback
    c = dict(WORKFLOWS[args.workflow]['smoke' if args.smoke else 'gpu'], epochs=args.epochs)
    cuda = args.device == 'cuda'
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda: torch.set_float32_matmul_precision('high')
    torch.manual_seed(0)
    learn, fit = BUILDERS[args.workflow](args.workflow, c, None, args.device, 0 if args.smoke else None)
    learn.opt_func = fused_adamw()

    class Windows(Callback):
        "Times training batches: `--window` of them alone, then as many paced, by turns"
        order = 1000 # After every other callback's `before_batch`
        def __init__(self): self.n, self.alone, self.paced, self.waits, self.t, self.end, self.wait, self.cut = 0, [], [], [], None, None, 0., False
        def _at(self)->tuple:
            "(kind, first of its window, last of it) of this training batch; kind `None` while skipped"
            i = self.n - args.skip
            if i < 0: return None, False, False
            return ('alone', 'paced')[(i // args.window) % 2], i % args.window == 0, i % args.window == args.window - 1
        def before_batch(self):
            if not self.training: return
            kind, first, _ = self._at()
            if first: self.cut, self.wait = False, 0.
            elif kind == 'paced': self.wait += time.perf_counter() - self.end # The host waiting for the DataLoader: a paced window's, not an alone batch's
            if kind == 'alone' or (kind == 'paced' and first): sync(); self.t = time.perf_counter()
        def after_batch(self):
            if not self.training: return
            kind, _, last = self._at()
            if kind == 'alone': sync(); self.alone.append(time.perf_counter() - self.t)
            elif kind == 'paced' and last and not self.cut:
                sync(); self.paced.append((time.perf_counter() - self.t) / args.window); self.waits.append(self.wait / args.window)
            self.end = time.perf_counter()
            self.n += 1
        def before_validate(self): self.cut = True # A paced window the epoch's end cuts is left out
    w = Windows()
    learn.add_cb(w)
    with learn.no_logging(), learn.no_bar(): fit()
    med = lambda xs: statistics.median(xs) if xs else None
    alone, paced, waits = med(w.alone), med(w.paced), med(w.waits)
    return dict(alone_ms=None if alone is None else 1e3*alone, paced_ms=None if paced is None else 1e3*paced,
                paced_wait_ms=None if waits is None else 1e3*waits,
                ratio=alone/paced if alone and paced else None, alone_batches=len(w.alone), paced_windows=len(w.paced),
                alone_all_ms=[round(1e3*s, 3) for s in w.alone], paced_all_ms=[round(1e3*s, 3) for s in w.paced])

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--workflow', default='text', choices=['text', 'text-small', 'tabular'])
    p.add_argument('--device', default='cuda')
    p.add_argument('--epochs', type=int, default=1)
    p.add_argument('--window', type=int, default=20, help="batches a window")
    p.add_argument('--skip', type=int, default=20, help="first training batches left out (the GPU's libraries loading)")
    p.add_argument('--smoke', action='store_true', help="tiny sizes, for the CPU")
    p.add_argument('--out', default=None, help="folder for eager_probe.json (default: a temporary one)")
    args = p.parse_args()
    if args.smoke: args.window, args.skip = 4, 2
    res = dict(versions(args.device), git=git_commit(), date=time.strftime('%Y-%m-%d'), workflow=args.workflow, epochs=args.epochs,
               window=args.window, skip=args.skip, smoke=args.smoke, **measure(args))
    out = Path(args.out or tempfile.mkdtemp(prefix='fxc-eager-probe-'))
    out.mkdir(parents=True, exist_ok=True)
    (out/'eager_probe.json').write_text(json.dumps(res, indent=1))
    f = lambda k: '—' if res[k] is None else f"{res[k]:.2f}"
    print(f"{args.workflow}: a training batch alone {f('alone_ms')} ms ({res['alone_batches']} batches), paced {f('paced_ms')} ms "
          f"({res['paced_windows']} windows of {args.window}), {f('paced_wait_ms')} ms of it waiting for the DataLoader; alone / paced {f('ratio')}")

if __name__ == '__main__': main()
