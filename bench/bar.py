"""fastai's progress bar against none, in a compiled fit: fits of one process, the bar shown and hidden in turn.

A first fit compiles the model and is not counted. Then each round fits the same Learner twice, once with fastai's
progress bar shown and once hidden, the order alternating by round. Both run the same compiled code in one process, so
what differs between them is the bar: its drawing on the host, and whether reading the loss makes the host wait for the
device. Each fit is timed whole (synchronized at its end) and by its training batches' pace (`BatchClock`).

    python bench/bar.py --rounds 5 --out DIR                     # the text workflow on a GPU
    python bench/bar.py --smoke --rounds 2 --out /tmp/bar        # tiny, on the CPU

Prints each fit and each arm's medians; writes DIR/bar.json (every fit) and DIR/bar.md.
"""
from __future__ import annotations
import argparse, contextlib, io, json, statistics, sys, tempfile, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from eager_overhead import BatchClock # Also gives this process a fresh inductor cache of its own
import torch
from workflow import BUILDERS, WORKFLOWS
from procs import git_commit, versions
from fastai.torch_core import set_seed
import fastxtend_compile # noqa: F401 (learn.compile)

def one_fit(learn, clock:BatchClock, epochs:int, bar:bool)->dict:
    "Fit `learn` for `epochs`, fastai's progress bar shown or not, and time it"
    clock.gaps = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    shown = io.StringIO() # The console bar's drawing is done in full; only where it lands differs from a terminal
    sync()
    t = time.perf_counter()
    with contextlib.redirect_stdout(shown), (contextlib.nullcontext() if bar else learn.no_bar()), learn.no_logging():
        learn.fit_one_cycle(epochs, 1e-3)
    sync()
    return dict(bar=bar, fit_s=time.perf_counter() - t, batch_ms=1e3*statistics.median(clock.gaps), drawn_chars=len(shown.getvalue()))

def main():
    p = argparse.ArgumentParser()
    p.add_argument('--workflow', default='text')
    p.add_argument('--config', default='{}', help="JSON over the workflow's config")
    p.add_argument('--epochs', type=int, default=1, help='epochs of each counted fit')
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--smoke', action='store_true', help='tiny sizes on the CPU')
    p.add_argument('--out', default=None)
    a = p.parse_args()
    device = 'cuda' if torch.cuda.is_available() and not a.smoke else 'cpu'
    c = {**WORKFLOWS[a.workflow]['smoke' if a.smoke else 'gpu'], **json.loads(a.config)}
    out = Path(a.out or tempfile.mkdtemp(prefix='fxc-bar-out-'))
    out.mkdir(parents=True, exist_ok=True)
    set_seed(0)
    learn, fit = BUILDERS[a.workflow](a.workflow, c, None, device, None if device == 'cuda' else 0)
    learn.compile(background=False) # Compiled in the first fit's path, whatever its length
    clock = BatchClock()
    learn.add_cb(clock)
    first = one_fit(learn, clock, c['epochs'], bar=False)
    print(f"first fit, compiling: {first['fit_s']:.1f}s", flush=True)
    fits = []
    for r in range(a.rounds):
        for bar in ((True, False) if r % 2 == 0 else (False, True)):
            f = dict(one_fit(learn, clock, a.epochs, bar), round=r)
            fits.append(f)
            print(f"round {r} bar {'shown ' if bar else 'hidden'} {f['fit_s']:7.2f}s  {f['batch_ms']:7.3f} ms a batch", flush=True)
    report = str(learn.compiler.report)
    meta = dict(env=versions(device), commit=git_commit(), workflow=a.workflow, config=c, epochs=a.epochs, rounds=a.rounds,
                date=time.strftime('%Y-%m-%d'), first_fit_s=first['fit_s'], report=report)
    (out/'bar.json').write_text(json.dumps(dict(meta=meta, fits=fits), indent=1))
    med = {b: (statistics.median(f['fit_s'] for f in fits if f['bar'] == b), statistics.median(f['batch_ms'] for f in fits if f['bar'] == b))
           for b in (False, True)}
    L = [f"# fastai's progress bar in a compiled fit ({meta['env'].get('device', device)}, torch {meta['env'].get('torch')}, "
         f"library at {meta['commit']})", "", f"{a.workflow}, `fit_one_cycle({a.epochs})` a fit, {a.rounds} rounds", "",
         "| bar | fits (s) | median | × hidden | a training batch, median (ms) | × hidden |", "|---|---|---:|---:|---:|---:|"]
    for b in (False, True):
        runs = ', '.join(f"{f['fit_s']:.2f}" for f in fits if f['bar'] == b)
        L.append(f"| {'shown' if b else 'hidden'} | {runs} | {med[b][0]:.2f} | {med[b][0]/med[False][0]:.3f} | {med[b][1]:.3f} | "
                 f"{med[b][1]/med[False][1]:.3f} |")
    L += ["", "The report after the last fit:", "", *('    ' + l for l in report.splitlines())]
    (out/'bar.md').write_text('\n'.join(L) + '\n')
    print('\n'.join(L))

if __name__ == '__main__': main()
