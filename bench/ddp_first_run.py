"""A first run under DDP: eager DDP against `learn.compile()`, cold (an empty inductor cache) and warm (the cold run's
cache), each arm a launch of its own of N processes.

On the CPU (the default), an MLP regression on `gloo` processes, also compiling in the fit's path:

    python bench/ddp_first_run.py --world 2 4 --out bench/results/ddp/latest_first_run

On GPUs, a GPU-bound transformer classifier (bench/arm.py's `TextClassifier`: 6 layers, d=512, bf16), in-memory tokens,
torch's fused AdamW and `fit_one_cycle`, on NCCL; `--world 1` trains on one GPU without DDP:

    python bench/ddp_first_run.py --device cuda --world 1 2 4 --arms eager,compile_cold,compile_warm --repeat 2 --out OUT

`--workload vision` runs the vision workflow's `fine_tune` instead (bench/workflow.py's JPEG files, `vision_learner`,
bf16 on GPUs), with torch's fused AdamW in every arm and `sync_bn=False`. The `default_cold` arm names the default mode
(`mode='default'`), which tries no faster tier: on one GPU its worker hands over the default's code, as each device's
worker does under DDP, so the two hand-overs can be compared.

Each rank trains the same number of batches an epoch whatever the number of ranks (the data grows with them), so the
fits of every world size run as many steps. `--repeat` runs every arm again, in turn, each run's warm arm on that run's
cold cache. Writes `results.json` and `README.md` to `--out`: each arm's fit time (the slowest rank's; the median of the
runs), the training batch at which each rank first ran compiled code and how far into the fit that was, the worker's
hand-over, the tier the ranks kept, and how far each arm's final weights are from eager's, and from each other's across
ranks.
"""
import argparse, json, os, platform, re, socket, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workflow import median # noqa: E402 (bench/workflow.py, beside this script)
# An arm's `learn.compile` arguments (`None`: eager). `learn.compile()` compiles in a worker by default on a GPU alone
ARMS = {'eager': None, 'in_path': dict(background=False), 'background_cold': dict(background=True),
        'background_warm': dict(background=True), 'compile_cold': {}, 'compile_warm': {}, 'default_cold': dict(mode='default'),
        'ro': dict(mode='reduce-overhead', background=False), # CUDA graphs picked by hand, compiled in the fit's path
        'compile_warm_reducer': {}, # Warm, with DDP's reducer averaging the compiled batches' gradients (`GradSync.replaces = False`)
        'compile_warm_sync': {}, # Warm, the library's one all-reduce averaging them untried (`GradSync.replaces = True`)
        'compile_warm_gc': {}} # Warm, Python's collector not frozen during the fit, as before `GCFreeze`
COLD_OF = {'background_warm': 'background_cold', 'compile_warm': 'compile_cold', 'compile_warm_reducer': 'compile_cold',
           'compile_warm_sync': 'compile_cold',
           'compile_warm_gc': 'compile_cold'} # On its cache
WORKLOADS = {
    'mlp': dict(n_batches=512, bs=64, hidden=512, epochs=4), # Batches an epoch on each rank
    'text': dict(n_batches=640, bs=32, seq=256, vocab=8000, d=512, layers=6, heads=8, classes=4, epochs=7, valid=2048, lr=1e-3),
    # Images a rank trains on (with `valid_pct` more to validate), as the vision workflow's; `num_workers` `None`: fastai's
    'vision': dict(n=6000, stored=160, size=128, bs=64, epochs=3, arch='resnet34', classes=5, valid_pct=0.2, num_workers=None),
}

def _mlp(c:dict, world:int, device:str, data=None):
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

def _text(c:dict, world:int, device:str, data=None):
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

def _vision(c:dict, world:int, device:str, data:Path):
    from fastai.torch_core import set_seed
    from workflow import build_vision, fused_adamw
    set_seed(0) # The model's weights, the augmentations and the order of the images, as eager's
    learn, fit = build_vision('vision', c, data, 'cuda' if device.startswith('cuda') else device, c['num_workers'])
    learn.opt_func = fused_adamw() # Made at `fine_tune`'s freeze
    return learn, fit

def vision_data(base:Path, c:dict, world:int)->Path:
    "The vision workflow's JPEG files for `world` ranks, written once: each rank trains on `n` of them"
    from workflow import write_images
    data = base/'images'
    if not (data/'train').exists(): write_images(data, {**c, 'n': c['n'] * world})
    return data

BUILD = {'mlp': _mlp, 'text': _text, 'vision': _vision}

def rank_main(out:Path, arm:str, workload:str, config:dict, device_type:str, a=None):
    "One rank of one arm (or the one process of a one-device arm): the workload's fit, under `distrib_ctx` where there are ranks"
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    if (dump := os.environ.get('BENCH_DUMP_AFTER')): # Every thread's stack to the log after this many seconds: where a rank waits
        import faulthandler; faulthandler.dump_traceback_later(float(dump), exit=False)
    gc_trace = _trace_full_collections() if os.environ.get('BENCH_GC_TRACE') else None
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
    learn, fit = BUILD[workload](config, max(world, 1), device, out/'images')
    learn.remove_cb(ProgressCallback)
    settings = ARMS[arm]
    if settings is not None: learn.add_cb(CompilerCallback(**settings))
    if arm.endswith(('_reducer', '_sync')): # The arms that skip `GradSync`'s trial: DDP's reducer, or the one all-reduce, every batch
        from fastxtend_compile.gradsync import GradSync
        GradSync.replaces = arm.endswith('_sync')
    if arm.endswith('_gc'): # The arm compared with `GCFreeze`: full collections visit every object, as without it
        from fastxtend_compile.gcfreeze import GCFreeze
        GCFreeze.on = False
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
    phases = None
    if a is not None and a.phases:
        from phases import Phases
        phases = Phases(profile=a.profile and not rank_distrib())
        learn.add_cb(phases)
        _time_agreements(phases)
    if a is not None and a.loss == 'local': _local_smooth_loss()
    sync = torch.cuda.synchronize if device_type == 'cuda' else (lambda: None)
    ddp = {}
    if a is not None and a.ddp_kwargs:
        from accelerate import DistributedDataParallelKwargs
        ddp = dict(kwargs_handlers=[DistributedDataParallelKwargs(**json.loads(a.ddp_kwargs))])
    # No SyncBatchNorm (fastai's default converts to it): it needs a GPU, and no workload here compares it
    ctx = learn.distrib_ctx(cpu=device_type == 'cpu', sync_bn=False, **ddp) if world > 1 else nullcontext()
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
               summary=None if report is None else report.summary(), device=device,
               ddp_trial=None if report is None else report.ddp_trial, # DDP's reducer against the one all-reduce, where tried
               gc=None if report is None else dict(n=len(report.gc_pauses), s=round(sum(report.gc_pauses), 3)),
               phases=None if phases is None else {**phases.summary(), 'agreements': getattr(phases, 'agreements', None)},
               gc_trace=gc_trace)
    (out/f'{arm}_rank{rank}.json').write_text(json.dumps(res))

def _trace_full_collections()->list:
    "Each of Python's full collections from now on: its seconds, the objects frozen then, and the code that ran it"
    import gc, traceback
    trace = []
    def on_gc(phase, info):
        if info['generation'] != 2: return
        if phase == 'start':
            stack = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_stack(limit=8)[:-1]]
            trace.append(dict(t=time.perf_counter(), frozen=gc.get_freeze_count(), counts=gc.get_count(), stack=stack))
        elif trace: trace[-1]['s'] = round(time.perf_counter() - trace[-1].pop('t'), 4)
    gc.callbacks.append(on_gc)
    return trace

def _time_agreements(phases):
    "Count the ranks' agreements (`agreement.DDP.gather`) and their time into `phases.agreements`"
    from fastxtend_compile import agreement
    phases.agreements, gather = dict(n=0, s=0.), agreement.DDP.gather
    def timed(self, obj, where):
        t = time.perf_counter()
        try: return gather(self, obj, where)
        finally: phases.agreements['n'] += 1; phases.agreements['s'] += time.perf_counter() - t
    agreement.DDP.gather = timed

def _local_smooth_loss():
    "Each rank's smooth loss from its own batches, kept on its device: no gather across ranks and no wait for the GPU a batch"
    import torch
    from fastai.learner import AvgSmoothLoss
    def accumulate(self, learn):
        self.count += 1
        self.val = torch.lerp(learn.loss.detach().mean().float(), self.val.to(learn.loss.device), self.beta)
    AvgSmoothLoss.accumulate = accumulate

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
                                       '--workload', a.workload, '--config', json.dumps(a.cfg), '--loss', a.loss]
                                      + ['--phases'] * a.phases + ['--profile'] * a.profile
                                      + (['--ddp-kwargs', a.ddp_kwargs] if a.ddp_kwargs else []), env=env))
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

def _handover(notes:list)->tuple|None:
    "(seconds the worker took to hand over the state's code, its start-up's share), from the report's note"
    for n in notes:
        if (m := re.match(r"compiled in a worker process in ([\d.]+)s.*?start-up took ([\d.]+)s", n)): return float(m[1]), float(m[2])
    return None

def _tier(notes:list)->str:
    "The tier the ranks kept, and its step against the default's, from the report's notes"
    for n in notes:
        if (m := re.match(r"tier (\S+) took over at (.*?)(?:, on all \d+ ranks at once)?: .*?([\d.]+ ms a step against [\d.]+ ms for [^,;]*)", n)):
            return f"{m[1]} from {m[2]}: {m[3]}"
        if n.startswith(('no faster tier', 'tier ')): return n.split(':')[0]
    return ''

def _fits(results:dict, key:str)->list:
    "Each run's fit time of arm `key` ('world/arm'): its slowest rank's"
    return [max(r['fit_s'] for r in run['ranks']) for run in results.get(key, [])]

def table(results:dict, worlds:list, arms:list)->list:
    "The README's rows: each world size and arm, the median of its runs"
    rows = []
    for world in worlds:
        eager = median(_fits(results, f'{world}/eager'))
        for arm in arms:
            runs = results.get(f'{world}/{arm}', [])
            if not runs: continue
            fits = _fits(results, f'{world}/{arm}')
            m = median(fits)
            vs = f"{m / eager:.2f}" if eager and arm != 'eager' else '—'
            firsts = sorted({None if r['first_compiled'] is None else tuple(r['first_compiled'][:3]) for run in runs for r in run['ranks']}, key=str)
            at = '; '.join('none' if f is None else f'epoch {f[0]}, batch {f[1]} (training batch {f[2]})' for f in firsts)
            when = [r['first_compiled'][3] for run in runs for r in run['ranks'] if r['first_compiled']]
            when = f"{min(when):.1f}–{max(when):.1f} s" if when else '—'
            hands = [h for run in runs if (h := _handover(run['ranks'][0]['notes']))]
            hand = ', '.join(f"{h:.1f} s ({s:.1f})" for h,s in hands) or '—'
            tiers = '; '.join(sorted({t for run in runs if (t := _tier(run['ranks'][0]['notes']))})) or '—'
            diffs = [run['diff'] for run in runs if run['diff'] is not None]
            diff = f"{max(diffs):.1e}" if diffs and arm != 'eager' else '—'
            same = 'yes' if all(run['same'] for run in runs) else 'no'
            rows.append(f"| {world} | {arm} | {m:.1f} s | {', '.join(f'{f:.1f}' for f in fits)} | {vs} | {at} | {when} | {hand} | "
                        f"{tiers} | {diff} | {same} |")
    return rows

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--world', type=int, nargs='+', default=[2, 4])
    ap.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    ap.add_argument('--workload', default=None, choices=list(WORKLOADS), help='default: mlp on the CPU, text on GPUs')
    ap.add_argument('--arms', default=None, help='comma-separated, of ' + ', '.join(ARMS))
    ap.add_argument('--config', default='{}', help="JSON over the workload's sizes")
    ap.add_argument('--timeout', type=float, default=1800, help="seconds a launch may take")
    ap.add_argument('--repeat', type=int, default=1, help="runs of every arm, in turn")
    ap.add_argument('--resume', action='store_true', help="add the runs to `--out`'s results.json, of the same workload and sizes")
    ap.add_argument('--out', default='bench/results/ddp/latest_first_run')
    ap.add_argument('--phases', action='store_true', help="time each training batch's phases, host and device, in the last epoch")
    ap.add_argument('--profile', action='store_true', help="with --phases, profile 30 training batches of the last epoch on rank 0")
    ap.add_argument('--loss', default='fastai', choices=['fastai', 'local'],
                    help="'local': the smooth loss of each rank's own batches, on its device (no gather, no wait a batch)")
    ap.add_argument('--ddp-kwargs', default=None, help="JSON of DistributedDataParallel's arguments, through accelerate")
    ap.add_argument('--rank-of'); a = ap.parse_args()
    a.workload = a.workload or ('mlp' if a.device == 'cpu' else 'text')
    a.cfg = {**WORKLOADS[a.workload], **json.loads(a.config)}
    out = Path(a.out).resolve(); out.mkdir(parents=True, exist_ok=True) # Absolute: inductor needs its cache directory so
    if a.rank_of: return rank_main(out, a.rank_of, a.workload, a.cfg, a.device, a)
    arms = (a.arms or ('eager,in_path,background_cold,background_warm' if a.device == 'cpu' else 'eager,compile_cold,compile_warm')).split(',')
    results = json.loads((out/'results.json').read_text()) if a.resume and (out/'results.json').exists() else {}
    done = max((len(runs) for runs in results.values()), default=0) # Runs kept from before: the new ones follow them
    for rep in range(done, done + a.repeat):
        for world in a.world:
            base = out/f'world{world}'; base.mkdir(exist_ok=True)
            if a.workload == 'vision': vision_data(base, a.cfg, world)
            for arm in arms:
                cache = base/f'cache_{COLD_OF.get(arm, arm)}_{rep}'
                t0 = time.perf_counter()
                ranks = launch(base, arm, world, cache, a)
                diff, same = compare(base, arm, world)
                results.setdefault(f'{world}/{arm}', []).append(dict(ranks=ranks, diff=diff, same=same, launch_s=time.perf_counter() - t0))
                print(f'run {rep + 1}, {world} rank(s), {arm}: fit {max(r["fit_s"] for r in ranks):.1f}s, launch {time.perf_counter() - t0:.1f}s, '
                      f'first compiled {[r["first_compiled"] for r in ranks]}', flush=True)
                write(out, results, a, arms)
            for f in base.glob('*.pt'): f.unlink()
    print((out/'README.md').read_text())

def scaling(results:dict, worlds:list, arms:list)->list:
    "Each arm's scaling from one device to each world size: one device's fit time over the world's, the same steps on every device"
    return [f"- {arm}, 1 → {w} devices: {one / n:.0%} ({one:.1f} s against {n:.1f} s)" for arm in arms for w in worlds
            if w > 1 and (one := median(_fits(results, f'1/{arm}'))) and (n := median(_fits(results, f'{w}/{arm}')))]

def write(out:Path, results:dict, a, arms:list):
    "`results.json`, and the README's table of what ran so far, kept runs of other arms and world sizes included"
    import torch, fastai
    worlds = sorted({int(k.split('/')[0]) for k in results})
    arms = list(dict.fromkeys([k.split('/')[1] for k in results] + arms))
    (out/'results.json').write_text(json.dumps(results, indent=1))
    env = (f"{torch.cuda.get_device_name(0)} × {torch.cuda.device_count()}" if a.device == 'cuda' else
           f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    head = (f"{env} · torch {torch.__version__} · fastai {fastai.__version__} · Python {platform.python_version()} · "
            f"{time.strftime('%Y-%m-%d')} · {a.workload} {json.dumps(a.cfg)}\n\n"
            "| ranks | arm | fit (slowest rank), median | each run | × eager | first compiled training batch, every rank | "
            "when, from the fit's start | the worker's hand-over (its start-up) | tier | max abs weight difference from eager | "
            "ranks' weights identical |\n|---|---|---:|---|---:|---|---:|---|---|---:|---|\n")
    scale = '\n'.join(scaling(results, worlds, arms))
    notes = '\n'.join(f"- {k}, run {i + 1}: " + '; '.join(run['ranks'][0]['notes'])
                      for k,runs in results.items() for i,run in enumerate(runs) if run['ranks'][0]['notes'])
    (out/'README.md').write_text(head + '\n'.join(table(results, worlds, arms)) + (f'\n\nScaling:\n\n{scale}' if scale else '')
                                 + '\n\nReports (rank 0):\n\n' + notes + '\n')

if __name__ == '__main__': main()
