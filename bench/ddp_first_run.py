"""A first run under DDP on the CPU: eager DDP against `learn.compile()` compiling in the fit's path, in the background
(cold, an empty inductor cache) and warm (the cold run's cache), each arm a launch of its own of N `gloo` processes.

    python bench/ddp_first_run.py --world 2 4 --out bench/results/ddp/latest_first_run

Writes `results.json` and `README.md` to `--out`: each arm's fit time (the slowest rank's), the batch at which each rank
took over, and how far each arm's final weights are from eager DDP's.
"""
import argparse, json, os, platform, socket, subprocess, sys, time
from pathlib import Path

ARMS = {'eager': None, 'in_path': dict(background=False), 'background_cold': dict(background=True),
        'background_warm': dict(background=True)}

def rank_main(out:Path, arm:str, n:int, hidden:int, epochs:int):
    "One rank of one arm: a seeded MLP regression fit under `distrib_ctx`"
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.callback.core import Callback
    from fastai.callback.progress import ProgressCallback
    from fastai.optimizer import SGD
    from fastai.distributed import DistributedDL
    from fastai.torch_core import rank_distrib
    from fastxtend_compile import CompilerCallback
    def _broadcast(self, t, rank): # fastai broadcasts the sample order as a CUDA tensor, which only NCCL needs
        t = torch.LongTensor(t); torch.distributed.broadcast(t, rank); return t.tolist()
    DistributedDL._broadcast = _broadcast
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g); y = x @ torch.randn(32, 8, generator=g)
    dls = DataLoaders.from_dsets(TensorDataset(x, y), TensorDataset(x[:256], y[:256]), bs=64, num_workers=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                          nn.ReLU(), nn.Linear(hidden, 8))
    settings = ARMS[arm]
    cbs = [] if settings is None else [CompilerCallback(**settings)]
    learn = Learner(dls, model, loss_func=nn.MSELoss(), opt_func=SGD, lr=1e-3, cbs=cbs)
    learn.remove_cb(ProgressCallback)
    class Switch(Callback):
        "The first training batch that ran compiled, not waiting for its code"
        order, first = 20, None
        def before_batch(self):
            cb = self.learn.__dict__.get('compiler')
            if self.training and self.first is None and cb is not None and not cb.policy.waiting and cb.policy.trained:
                self.first = (self.epoch, self.iter, self.train_iter)
    sw = Switch()
    t0 = time.perf_counter()
    with learn.distrib_ctx(cpu=True), learn.no_logging(): learn.fit(epochs, cbs=sw)
    res = dict(rank=rank_distrib(), fit_s=time.perf_counter() - t0, first_compiled=sw.first,
               notes=[] if settings is None else learn.compiler.report.background,
               params={k: v.tolist() for k,v in learn.model.state_dict().items()})
    (out/f'{arm}_rank{res["rank"]}.json').write_text(json.dumps(res))

def launch(out:Path, arm:str, world:int, cache:Path, args)->list:
    port = socket.socket(); port.bind(('127.0.0.1', 0)); p = port.getsockname()[1]; port.close()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR='127.0.0.1', MASTER_PORT=str(p), CUDA_VISIBLE_DEVICES='', TORCHINDUCTOR_CACHE_DIR=str(cache),
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get('PYTHONPATH', '')]))
        procs.append(subprocess.Popen([sys.executable, __file__, '--rank-of', arm, '--out', str(out), '--n', str(args.n),
                                       '--hidden', str(args.hidden), '--epochs', str(args.epochs)], env=env))
    for pr in procs: pr.wait(timeout=1800)
    return [json.loads((out/f'{arm}_rank{r}.json').read_text()) for r in range(world)]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--world', type=int, nargs='+', default=[2, 4])
    ap.add_argument('--n', type=int, default=32768) # Training samples: 64 a batch on each rank
    ap.add_argument('--hidden', type=int, default=512)
    ap.add_argument('--epochs', type=int, default=4)
    ap.add_argument('--out', default='bench/results/ddp/latest_first_run')
    ap.add_argument('--rank-of'); a = ap.parse_args()
    out = Path(a.out).resolve(); out.mkdir(parents=True, exist_ok=True) # Absolute: inductor needs its cache directory so
    if a.rank_of: return rank_main(out, a.rank_of, a.n, a.hidden, a.epochs)
    import torch, fastai
    rows, results = [], {}
    for world in a.world:
        base = out/f'world{world}'; base.mkdir(exist_ok=True)
        for arm in ARMS:
            cache = base/('cache_bg' if arm.startswith('background') else f'cache_{arm}')
            t0 = time.perf_counter()
            ranks = launch(base, arm, world, cache, a)
            results[f'{world}/{arm}'] = ranks
            print(f'{world} ranks, {arm}: {time.perf_counter() - t0:.1f}s', flush=True)
        eager = results[f'{world}/eager'][0]['params']
        for arm in ARMS:
            ranks = results[f'{world}/{arm}']
            diff = max(abs(u - v) for k in eager for u, v in zip(_flat(ranks[0]['params'][k]), _flat(eager[k])))
            same = all(r['params'] == ranks[0]['params'] for r in ranks)
            switch = sorted({tuple(r['first_compiled']) if r['first_compiled'] else None for r in ranks}, key=str)
            rows.append(f"| {world} | {arm} | {max(r['fit_s'] for r in ranks):.1f} s | "
                        f"{max(r['fit_s'] for r in ranks) / max(r['fit_s'] for r in results[f'{world}/eager']):.2f} | "
                        f"{', '.join('none' if s is None else f'epoch {s[0]}, batch {s[1]} (training batch {s[2]})' for s in switch)} | "
                        f"{diff:.1e} | {'yes' if same else 'no'} |")
    head = (f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores · torch {torch.__version__} · fastai "
            f"{fastai.__version__} · Python {platform.python_version()} · {time.strftime('%Y-%m-%d')}\n\n"
            "| ranks | arm | fit (slowest rank) | × eager DDP | first compiled training batch, every rank | max abs weight difference from eager DDP | ranks' weights identical |\n"
            "|---|---|---:|---:|---|---:|---|\n")
    (out/'README.md').write_text(head + '\n'.join(rows) + '\n\nReports (rank 0):\n\n' + '\n'.join(
        f"- {k}: " + '; '.join(v[0]['notes']) for k,v in results.items() if v[0]['notes']) + '\n')
    (out/'results.json').write_text(json.dumps({k: [{kk: vv for kk, vv in r.items() if kk != 'params'} for r in v] for k,v in results.items()}, indent=1))
    print((out/'README.md').read_text())

def _flat(v): return [x for y in v for x in _flat(y)] if isinstance(v, list) else [v]

if __name__ == '__main__': main()
