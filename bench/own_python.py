"""The library's own Python a batch, by function: cProfile's time inside `fastxtend_compile`'s functions (not what they
call) over a whole fit of a workflow, on the CPU, with `learn.compile()` and its background compile on, as on a GPU.

    python bench/own_python.py --workflow tabular --config '{"rows": 40000, "bs": 256, "epochs": 2}'
"""
import argparse, cProfile, json, pstats, sys, time
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import torch
from workflow import BUILDERS, WORKFLOWS
import fastxtend_compile # noqa: F401

p = argparse.ArgumentParser()
p.add_argument('--workflow', default='tabular'); p.add_argument('--config', default='{}', help="JSON over the workflow's smoke config")
p.add_argument('--num-workers', type=int, default=0); p.add_argument('--top', type=int, default=20)
args = p.parse_args()
torch.set_num_threads(1)
c = {**WORKFLOWS[args.workflow]['smoke'], **json.loads(args.config)}
learn, fit = BUILDERS[args.workflow](args.workflow, c, None, 'cpu', args.num_workers)
learn.compile(background=True)
prof, t = cProfile.Profile(), time.perf_counter()
with learn.no_bar():
    prof.enable(); fit(); prof.disable()
wall = time.perf_counter() - t
own = [(tt, n, f"{Path(f).name}:{line} {name}") for (f, line, name), (_, n, tt, _, _) in pstats.Stats(prof).stats.items()
       if 'fastxtend_compile' in f]
batches = (len(learn.dls.train) + len(learn.dls.valid)) * c['epochs']
total = sum(tt for tt,_,_ in own)
print(f"{args.workflow}: fit {wall:.1f}s (profiled), {batches} batches; the library's own Python {1e3*total/batches:.3f} ms a batch")
for tt, n, where in sorted(own, reverse=True)[:args.top]: print(f"{1e3*tt/batches:8.4f} ms a batch  {n:7d} calls  {where}")
print(learn.compiler.report.summary())
