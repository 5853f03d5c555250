"""How long a warm compile takes against a cold one: the share `WARM_SHARE` in `fastxtend_compile.payoff` stands for.

    python bench/warm_share.py [--device cpu] [--runs 3] [--out DIR]

For each model, each run compiles the same model state twice in a fit's path (`learn.compile(background=False)`, one
epoch), each time in a process of its own: cold, with an empty inductor cache, then warm, from the cache the cold one
filled. Each reads its `CompileReport.compile_seconds`. The table gives the medians and the warm share of each run.
"""
import argparse, json, statistics, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import arm_env, run_process

FIT = r"""
import json, sys, torch
from torch import nn
from fastai.data.core import DataLoaders, TfmdDL
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastxtend_compile import *
kind, device = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
if kind == 'cnn':
    x, y = torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,))
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2, padding=1),
                          nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
else:
    x, y = torch.randint(0, 1000, (512, 64)), torch.randint(0, 2, (512,))
    class Text(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1000, 128)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.), 2)
            self.out = nn.Linear(128, 2)
        def forward(self, x): return self.out(self.enc(self.emb(x)).mean(1))
    model = Text()
ds = list(zip(x, y))
dls = DataLoaders(TfmdDL(ds, bs=64, shuffle=True, drop_last=True), TfmdDL(ds, bs=64), device=device)
learn = Learner(dls, model, loss_func=CrossEntropyLossFlat()).compile(background=False, verbose=False)
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
print(json.dumps(dict(compile_s=learn.compiler.report.compile_seconds, torch=torch.__version__)))
"""

def compile_s(kind:str, device:str, cache:Path)->dict:
    "Fit `kind` once in a process of its own with `cache` as inductor's: its compile's seconds"
    fin = run_process([sys.executable, '-c', FIT, kind, device], arm_env(cache), timeout=900)
    if fin.rc != 0: sys.exit(f"warm_share: the {kind} fit failed:\n{fin.tail()}")
    return json.loads(fin.out.strip().splitlines()[-1])

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--runs', type=int, default=3)
    ap.add_argument('--models', default='cnn,text')
    ap.add_argument('--out', default=None, help='a folder for results.json')
    args = ap.parse_args()
    rows, res = [], {}
    for kind in args.models.split(','):
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix='fxc-warm-share-') as cache:
                cold = compile_s(kind, args.device, Path(cache))
                warm = compile_s(kind, args.device, Path(cache))
            runs.append(dict(cold_s=cold['compile_s'], warm_s=warm['compile_s'], torch=cold['torch']))
        cold, warm = statistics.median(r['cold_s'] for r in runs), statistics.median(r['warm_s'] for r in runs)
        shares = ', '.join(f"{r['warm_s']/r['cold_s']:.2f}" for r in runs)
        rows.append(f"| {kind} | {len(runs)} | {cold:.2f} s | {warm:.2f} s | {warm/cold:.2f} ({shares}) |")
        res[kind] = runs
    print(f"device {args.device}, torch {runs[0]['torch']}\n\n| model | runs | cold compile | warm compile | warm ÷ cold (each run) |\n"
          "|---|---:|---:|---:|---:|\n" + '\n'.join(rows))
    if args.out: Path(args.out).mkdir(parents=True, exist_ok=True); (Path(args.out)/'results.json').write_text(json.dumps(res, indent=1))

if __name__ == '__main__': main()
