"""A first run under DDP: eager DDP against `learn.compile()`, cold (an empty inductor cache) and warm (the cold run's
cache), each arm a launch of its own of N processes.

On the CPU (the default), an MLP regression on `gloo` processes, also compiling in the fit's path:

    python bench/ddp_first_run.py --world 2 4 --out bench/results/ddp/latest_first_run

On GPUs, a GPU-bound transformer classifier (bench/arm.py's `TextClassifier`: 6 layers, d=512, bf16), in-memory tokens,
torch's fused AdamW and `fit_one_cycle`, on NCCL; `--world 1` trains on one GPU without DDP:

    python bench/ddp_first_run.py --device cuda --world 1 2 4 --arms eager,compile_cold,compile_warm --out OUT

Each rank trains the same number of batches an epoch whatever the number of ranks (the data grows with them), so the
fits of every world size run as many steps. Writes `results.json` and `README.md` to `--out`: each arm's fit time (the
slowest rank's), the training batch at which each rank first ran compiled code and how far into the fit that was, and
how far each arm's final weights are from eager's, and from each other's across ranks.
"""
import argparse, json, os, platform, socket, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# An arm's `learn.compile` arguments (`None`: eager). `learn.compile()` compiles in a worker by default on a GPU alone
ARMS = {'eager': None, 'in_path': dict(background=False), 'background_cold': dict(background=True),
        'background_warm': dict(background=True), 'compile_cold': {}, 'compile_warm': {}}
COLD_OF = {'background_warm': 'background_cold', 'compile_warm': 'compile_cold'} # Warm arms start on their cold arm's cache
WORKLOADS = {
    'mlp': dict(n_batches=512, bs=64, hidden=512, epochs=4), # Batches an epoch on each rank
    'text': dict(n_batches=640, bs=32, seq=256, vocab=8000, d=512, layers=6, heads=8, classes=4, epochs=7, valid=2048, lr=1e-3),
}

def _mlp(c:dict, world:int, device:str):
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.optimizer import SGD
    g = torch.Generator().manual_seed(0)
    n = c['n_batches'] * c['bs'] * world
    x = torch.randn(n, 32, generator=g); y = x @ torch.randn(32, 8, generator=g)
    dls = DataLoaders.from_dsets(TensorDataset(x, y), TensorDataset(x[:256], y[:256]), bs=c['bs'], num_workers=0, device=device)
    torch.manual_seed(0)
    h = c['hidden']
    model = nn.Sequential(nn.Linear(32, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 8))
    learn = Learner(dls, model, loss_func=nn.MSELoss(), opt_func=SGD, lr=1e-3)
    return learn, lambda: learn.fit(c['epochs'])

def _text(c:dict, world:int, device:str):
    import torch
    from torch.utils.data import TensorDataset
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.metrics import accuracy
    from arm import TextClassifier
    from workflow import fused_adamw
    # Random tokens; each sequence plants 8 tokens of its class's group of 8 token ids: a task the model learns
    g = torch.Generator().manual_seed(0)
    n, k, seq = c['n_batches'] * c['bs'] * world + c['valid'], c['classes'], c['seq']
    toks = torch.randint(1 + 8*k, c['vocab'], (n, seq), generator=g)
    labels = torch.randint(0, k, (n,), generator=g)
    pos = torch.rand(n, seq, generator=g).argsort(1)[:, :8]
    toks.scatter_(1, pos, 1 + 8*labels[:, None] + torch.randint(0, 8, (n, 8), generator=g))
    nv = c['valid']
    dls = DataLoaders.from_dsets(TensorDataset(toks[nv:], labels[nv:]), TensorDataset(toks[:nv], labels[:nv]), bs=c['bs'],
                                 num_workers=0, device=device, shuffle=True, drop_last=True)
    torch.manual_seed(0)
    model = TextClassifier(c['vocab'], seq, c['d'], c['layers'], c['heads'], k)
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy, opt_func=fused_adamw()).to_bf16()
    return learn, lambda: learn.fit_one_cycle(c['epochs'], c['lr'])

BUILD = {'mlp': _mlp, 'text': _text}

def rank_main(out:Path, arm:str, workload:str, config:dict, device_type:str):
    "One rank of one arm (or the one process of a one-device arm): the workload's fit, under `distrib_ctx` where there are ranks"
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    sys.path.insert(0, str(HERE))
    import torch
    from contextlib import nullcontext
    from fastai.callback.core import Callback
    from fastai.callback.progress import ProgressCallback
    from fastai.distributed import DistributedDL
    from fastai.torch_core import rank_distrib, num_distrib
    from fastxtend_compile import CompilerCallback
    import torch._dynamo # noqa: F401 (every arm imports it before its fit: torch's fused AdamW would in eager's timed fit)
    world, local = num_distrib(), int(os.environ.get('LOCAL_RANK', 0))
    if device_type == 'cuda':
        torch.cuda.set_device(local)
        torch.zeros(1, device='cuda')
        device = f'cuda:{local}'
    else:
        def _broadcast(self, t, rank): # fastai broadcasts the sample order as a CUDA tensor, which only NCCL needs
            t = torch.LongTensor(t); torch.distributed.broadcast(t, rank); return t.tolist()
        DistributedDL._broadcast = _broadcast
        device = 'cpu'
    learn, fit = BUILD[workload](config, max(world, 1), device)
    learn.remove_cb(ProgressCallback)
    settings = ARMS[arm]
    if settings is not None: learn.add_cb(CompilerCallback(**settings))
    class Switch(Callback):
        "The first training batch that ran compiled code, and when"
        order, first, t0 = 20, None, 0.
        def before_fit(self): self.t0 = time.perf_counter()
        def before_batch(self):
            cb = self.learn.__dict__.get('compiler')
            if self.training and self.first is None and cb is not None and not cb.policy.waiting and cb.policy.trained:
                self.first = (self.epoch, self.iter, self.train_iter, time.perf_counter() - self.t0)
    sw = Switch()
    learn.add_cb(sw)
    sync = torch.cuda.synchronize if device_type == 'cuda' else (lambda: None)
    ctx = learn.distrib_ctx(cpu=device_type == 'cpu') if world > 1 else nullcontext()
    with ctx, learn.no_logging():
        sync()
        t0 = time.perf_counter()
        fit()
        sync()
        fit_s = time.perf_counter() - t0
    rank = rank_distrib()
    torch.save({k: v.detach().cpu() for k,v in learn.model.state_dict().items()}, out/f'{arm}_rank{rank}.pt')
    report = None if settings is None else learn.compiler.report
    res = dict(rank=rank, fit_s=fit_s, first_compiled=sw.first, batches=learn.train_iter, loss=float(learn.recorder.losses[-1]),
               notes=[] if report is None else report.background,
               summary=None if report is None else report.summary(), device=device)
    (out/f'{arm}_rank{rank}.json').write_text(json.dumps(res))

def launch(out:Path, arm:str, world:int, cache:Path, a)->list:
    "Start `world` processes of `arm` (one, without DDP, where `world` is 1) and wait for them: what each wrote"
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    base = {k:v for k,v in os.environ.items() if k not in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE')}
    base.update(TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get('PYTHONPATH')])))
    if a.device == 'cpu': base['CUDA_VISIBLE_DEVICES'] = ''
    procs = []
    for r in range(world):
        env = dict(base) if world == 1 else dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, '--rank-of', arm, '--out', str(out), '--device', a.device,
                                       '--workload', a.workload, '--config', json.dumps(a.cfg)], env=env))
    for pr in procs: pr.wait(timeout=a.timeout)
    return [json.loads((out/f'{arm}_rank{r}.json').read_text()) for r in range(world)]

def compare(out:Path, arm:str, world:int, base:str='eager')->tuple:
    "(max abs difference of rank 0's weights from `base`'s rank 0, whether every rank's weights equal rank 0's)"
    import torch
    load = lambda a, r: torch.load(out/f'{a}_rank{r}.pt', weights_only=True)
    w0 = load(arm, 0)
    same = all(all(torch.equal(w0[k], v) for k,v in load(arm, r).items()) for r in range(1, world))
    diff = None
    if (out/f'{base}_rank0.pt').exists():
        b = load(base, 0)
        diff = max((w0[k].float() - b[k].float()).abs().max().item() for k in w0 if w0[k].is_floating_point())
    return diff, same

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--world', type=int, nargs='+', default=[2, 4])
    ap.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    ap.add_argument('--workload', default=None, choices=list(WORKLOADS), help='default: mlp on the CPU, text on GPUs')
    ap.add_argument('--arms', default=None, help='comma-separated, of ' + ', '.join(ARMS))
    ap.add_argument('--config', default='{}', help="JSON over the workload's sizes")
    ap.add_argument('--timeout', type=float, default=1800, help="seconds a launch may take")
    ap.add_argument('--out', default='bench/results/ddp/latest_first_run')
    ap.add_argument('--rank-of'); a = ap.parse_args()
    a.workload = a.workload or ('mlp' if a.device == 'cpu' else 'text')
    a.cfg = {**WORKLOADS[a.workload], **json.loads(a.config)}
    out = Path(a.out).resolve(); out.mkdir(parents=True, exist_ok=True) # Absolute: inductor needs its cache directory so
    if a.rank_of: return rank_main(out, a.rank_of, a.workload, a.cfg, a.device)
    arms = (a.arms or ('eager,in_path,background_cold,background_warm' if a.device == 'cpu' else 'eager,compile_cold,compile_warm')).split(',')
    import torch, fastai
    rows, results = [], {}
    for world in a.world:
        base = out/f'world{world}'; base.mkdir(exist_ok=True)
        for arm in arms:
            cache = base/f'cache_{COLD_OF.get(arm, arm)}'
            t0 = time.perf_counter()
            ranks = launch(base, arm, world, cache, a)
            diff, same = compare(base, arm, world)
            results[f'{world}/{arm}'] = dict(ranks=ranks, diff=diff, same=same, launch_s=time.perf_counter() - t0)
            print(f'{world} rank(s), {arm}: fit {max(r["fit_s"] for r in ranks):.1f}s, launch {time.perf_counter() - t0:.1f}s, '
                  f'first compiled {[r["first_compiled"] for r in ranks]}', flush=True)
            (out/'results.json').write_text(json.dumps(results, indent=1))
        for f in base.glob('*.pt'): f.unlink()
        eager = results.get(f'{world}/eager')
        for arm in arms:
            res = results[f'{world}/{arm}']; ranks = res['ranks']
            fit = max(r['fit_s'] for r in ranks)
            vs = f"{fit / max(r['fit_s'] for r in eager['ranks']):.2f}" if eager else '—'
            firsts = sorted({None if r['first_compiled'] is None else tuple(r['first_compiled'][:3]) for r in ranks}, key=str)
            at = ', '.join('none' if s is None else f'epoch {s[0]}, batch {s[1]} (training batch {s[2]})' for s in firsts)
            when = [r['first_compiled'][3] for r in ranks if r['first_compiled']]
            when = f"{min(when):.1f}–{max(when):.1f} s" if when else '—'
            diff = '—' if res['diff'] is None else f"{res['diff']:.1e}"
            rows.append(f"| {world} | {arm} | {fit:.1f} s | {vs} | {at} | {when} | {diff} | "
                        f"{'yes' if res['same'] else 'no'} | {ranks[0]['loss']:.4f} |")
    env = (f"{torch.cuda.get_device_name(0)} × {torch.cuda.device_count()}" if a.device == 'cuda' else
           f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    head = (f"{env} · torch {torch.__version__} · fastai {fastai.__version__} · Python {platform.python_version()} · "
            f"{time.strftime('%Y-%m-%d')} · {a.workload} {json.dumps(a.cfg)}\n\n"
            "| ranks | arm | fit (slowest rank) | × eager | first compiled training batch, every rank | when, from the fit's start | "
            "max abs weight difference from eager | ranks' weights identical | last loss, rank 0 |\n"
            "|---|---|---:|---:|---|---:|---:|---|---:|\n")
    notes = '\n'.join(f"- {k}: " + '; '.join(v['ranks'][0]['notes']) for k,v in results.items() if v['ranks'][0]['notes'])
    (out/'README.md').write_text(head + '\n'.join(rows) + '\n\nReports (rank 0):\n\n' + notes + '\n')
    print((out/'README.md').read_text())

if __name__ == '__main__': main()
