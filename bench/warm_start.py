"""Warm start after `load_learner`: does a Learner exported, loaded in a new process and compiled again start warm?

    python bench/warm_start.py --out bench/results/warm_start_cpu.md

Process 1 trains a small CNN on scikit-learn's digits with `learn.compile()` and a fresh `TORCHINDUCTOR_CACHE_DIR`,
timing the first batch (the cold compile), then exports it and saves its compile cache (`learn.save_compile_cache`).
Process 2, with the same cache directory, loads it with `load_learner`, compiles it again and times its first
training batch; process 3 does the same with an empty cache; process 4, with an empty cache too, loads the saved
compile cache first (`learn.load_compile_cache`): a fresh machine with the same torch and device.
"""
import argparse, json, os, subprocess, sys, tempfile, textwrap
from pathlib import Path

WORKER = textwrap.dedent('''
    import json, sys, time, warnings
    warnings.simplefilter('ignore')
    import numpy as np, torch
    from torch import nn
    from sklearn.datasets import load_digits
    from fastai.vision.all import *
    from fastxtend_compile import *
    role, path = sys.argv[1], Path(sys.argv[2])
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X, dtype=torch.float32).view(-1, 1, 8, 8) / 16, torch.tensor(y)
    def image(i): return X[i]
    def label(i): return y[i]
    n = len(X)
    dls = Datasets(range(n), [[image], [label]], splits=[list(range(n-320)), list(range(n-320, n))]).dataloaders(bs=64) # Exportable
    class FirstBatch(Callback):
        order = 100
        def before_batch(self):
            if self.training and self.iter == 0: self.t = time.perf_counter()
        def after_batch(self):
            if self.training and self.iter == 0: self.first = time.perf_counter() - self.t
            if self.training and self.iter == 1: raise CancelFitException()
    if role == 'train':
        model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                              nn.Flatten(), nn.Linear(32*4*4, 10))
        learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), path=path).compile()
    else:
        learn = load_learner(path/'export.pkl')
        learn.dls, learn.path = dls, path
        learn.compile()
        if role == 'portable': assert learn.load_compile_cache('export')
    cb = FirstBatch()
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3, cbs=cb)
    if role == 'train': learn.export('export.pkl'); learn.save_compile_cache('export')
    print(json.dumps(dict(role=role, first_batch_s=cb.first, compile_s=learn.compiler.report.compile_seconds)))
''')

def run(role, path, cache):
    env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': cache}
    out = subprocess.run([sys.executable, '-c', WORKER, role, str(path)], capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--out', default=None, help='write the markdown table here too')
    args = p.parse_args()
    import torch
    path, cache = Path(tempfile.mkdtemp()), tempfile.mkdtemp()
    rows = [run('train', path, cache), run('load', path, cache), run('load', path, tempfile.mkdtemp()),
            run('portable', path, tempfile.mkdtemp())]
    names = ['trained, fresh cache (cold)', 'load_learner + compile, same cache (warm)', 'load_learner + compile, empty cache',
             'load_learner + load_compile_cache + compile, empty cache']
    cold = rows[0]['first_batch_s']
    md = [f"# Warm start after load_learner\n\nCPU ({os.cpu_count()} cores), torch {torch.__version__}, inductor; a small CNN on "
          "scikit-learn's digits. First training batch, compile included, each in its own process.\n",
          "| process | first batch s | time compiling s | × cold (first batch) | × cold (compiling) |", "|---|---:|---:|---:|---:|"]
    md += [f"| {n} | {r['first_batch_s']:.2f} | {r['compile_s']:.2f} | {r['first_batch_s']/cold:.0%} | {r['compile_s']/rows[0]['compile_s']:.0%} |"
           for n,r in zip(names, rows)]
    text = '\n'.join(md)
    print(text)
    if args.out: Path(args.out).write_text(text + '\n')

if __name__ == '__main__': main()
