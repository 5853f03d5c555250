"""Compiled vs eager fastai training on 1 and several GPUs through `learn.distrib_ctx()` (DistributedDataParallel).

One command runs everything and writes `ddp.md` and `ddp.json` to `--out`:

    NCCL_NVLS_ENABLE=0 python bench/ddp_bench.py --gpus 2 --repeat 3 --out bench/results/ddp/latest

It starts a 1-GPU launch as a plain process (no DDP, as one GPU trains), then `--repeat` launches of
`torchrun --standalone --nproc_per_node=GPUS`. In each launch every workload trains once per mode, the modes in turn
and in reverse order every other launch: by default eager, `learn.compile()` (whole graphs) and
`learn.compile(ddp_compiled_autograd=True)` (DDP's all-reduces in compiled autograd's backward graphs). Workloads: ResNet-18
(torchvision, 128 px, bs 64 per GPU) and a GPT-style model (8 layers, d=512, T=256, vocab 8192, bs 64 per GPU) on
synthetic batches already on the GPU, no validation; a step is timed from the end of the warm-up steps to the end of the
last step, synchronized, slowest rank. And `vision`: the workflow benchmark's images on disk (bench/workflow.py, written
once) through `ImageDataLoaders` with item and batch transforms, `vision_learner(resnet34)`, `fine_tune`, its step the
last epoch's training time per batch, DataLoader included, slowest rank. All in bf16 (`learn.to_bf16()`). After each
fit the ranks' parameters are compared. The launches share one inductor cache: the first launch's compiles are cold,
later ones warm (compile times are not what this measures; bench/workflow.py measures them).

    python bench/ddp_bench.py --smoke --out /tmp/ddp-smoke   # the same code paths on the CPU with gloo, tiny sizes

A worker (`--worker`) is what the launches run; run one directly only to debug.
"""
from __future__ import annotations
import argparse, datetime, gc, json, os, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)) # The repository's `fastxtend_compile`, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))
from arm import make_model # The same ResNet-18 and GPT-style models as the step-time benchmark
from procs import arm_env, run_process, versions

# Multicast over NVLink can take a shared host's GPUs out of service: keep it off in every process started here
SAFE_ENV = dict(NCCL_NVLS_ENABLE='0', TORCH_SYMM_MEM_DISABLE_MULTICAST='1', NVSHMEM_DISABLE_NVLS='1')
os.environ.update(SAFE_ENV)

WORKLOADS = {
    'resnet18': dict(full=dict(kind='resnet', px=128, bs=64), smoke=dict(kind='resnet', px=32, bs=2)),
    'gpt':      dict(full=dict(kind='gpt', n_layer=8, d=512, n_head=8, T=256, vocab=8192, bs=64),
                     smoke=dict(kind='gpt', n_layer=2, d=64, n_head=2, T=32, vocab=256, bs=2)),
    # The workflow benchmark's vision run (bench/workflow.py), fewer images: each GPU gets its share of them
    'vision':   dict(full=dict(kind='vision', n=6000, size=128, bs=64, epochs=3, arch='resnet34', classes=5, valid_pct=0.2, stored=160),
                     smoke=dict(kind='vision', n=48, size=32, bs=4, epochs=1, arch='resnet18', classes=3, valid_pct=0.2, stored=40)),
}
DIST_ENV = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'GROUP_RANK',
            'ROLE_RANK', 'ROLE_WORLD_SIZE', 'TORCHELASTIC_RUN_ID')

def describe(cfg:dict)->str:
    if cfg['kind'] == 'resnet': return f"ResNet-18, {cfg['px']} px, bs {cfg['bs']}/GPU"
    if cfg['kind'] == 'vision':
        return f"vision: {cfg['n']} JPEGs, {cfg['arch']} {cfg['size']} px, fine_tune({cfg['epochs']}), bs {cfg['bs']}/GPU"
    return f"GPT {cfg['n_layer']}L d={cfg['d']} T={cfg['T']} vocab {cfg['vocab']}, bs {cfg['bs']}/GPU"

# ---------------------------------------------------------------------------------------------------------------------
# Worker: one process of one launch, training every workload eager then compiled

def make_batches(cfg, device, rank, n=4):
    "`n` distinct synthetic batches for this rank, on `device`, typed as fastai's data blocks type them"
    import torch
    from fastai.torch_core import TensorBase, TensorImage, TensorCategory
    g = torch.Generator().manual_seed(rank)
    res = []
    for _ in range(n):
        if cfg['kind'] == 'resnet':
            x = TensorImage(torch.randn(cfg['bs'], 3, cfg['px'], cfg['px'], generator=g))
            y = TensorCategory(torch.randint(0, 1000, (cfg['bs'],), generator=g))
        else:
            x = TensorBase(torch.randint(0, cfg['vocab'], (cfg['bs'], cfg['T']), generator=g))
            y = TensorBase(torch.randint(0, cfg['vocab'], (cfg['bs'], cfg['T']), generator=g))
        res.append((x.to(device), y.to(device)))
    return res

def _cpu_gloo_patch():
    "fastai's `DistributedDL` broadcasts the sample order as a CUDA tensor, which only NCCL needs"
    import torch
    from fastai.distributed import DistributedDL
    def _broadcast(self, t, rank):
        t = torch.LongTensor(t)
        torch.distributed.broadcast(t, rank)
        return t.tolist()
    DistributedDL._broadcast = _broadcast

COMPILE_KWARGS = {'compile': {}, 'compile-ca': dict(ddp_compiled_autograd=True)}

def ddp_context(learn, mode:str, cuda:bool, sync_bn:bool):
    "fastai's `distrib_ctx`"
    ctx = dict(sync_bn=sync_bn) if cuda else dict(sync_bn=False, cpu=True) # SyncBatchNorm needs a GPU
    return learn.distrib_ctx(**ctx)

def run_one(args, name, cfg, mode, device, rank, world):
    "Train one workload eager or compiled for `warmup+steps` steps per rank; the timings and compile report"
    import torch
    from functools import partial
    from fastai.callback.core import Callback, CancelValidException
    from fastai.callback.progress import ProgressCallback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.optimizer import OptimWrapper
    import fastai.callback.fp16, fastai.distributed
    from fastxtend_compile import is_compiled

    cuda = device.type == 'cuda'
    n_steps = args.warmup + args.steps

    class Batches:
        "Prebatched items cycling through `pool` (a DataLoader with `bs=None` yields them as they are)"
        def __init__(self, pool, n): self.pool, self.n = pool, n
        def __len__(self): return self.n
        def __getitem__(self, i): return self.pool[i % len(self.pool)]

    def sync():
        if cuda: torch.cuda.synchronize(device)

    class TimeSteps(Callback):
        "Wall time of each warm-up step, then of all timed steps together; no validation"
        order = 1000
        def before_fit(self): self.warm, self.t = [], None
        def before_train(self):
            sync()
            self.t = time.perf_counter()
        def after_batch(self):
            if not self.training: return
            if self.iter < args.warmup:
                sync()
                t = time.perf_counter()
                self.warm.append(t - self.t)
                self.t = t
            elif self.iter == n_steps - 1:
                sync()
                self.timed = time.perf_counter() - self.t
        def before_validate(self): raise CancelValidException()

    torch.manual_seed(0) # Same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = make_model(cfg)
    pool = make_batches(cfg, device, rank)
    # `DistributedDL` deals each rank `1/world` of the items: `n_steps` batches of `bs` each
    dls = DataLoaders(DataLoader(Batches(pool, n_steps*world), bs=None), DataLoader(Batches(pool, world), bs=None),
                      device=device)
    adamw = partial(torch.optim.AdamW, fused=True) if cuda else partial(torch.optim.AdamW, foreach=True)
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=partial(OptimWrapper, opt=adamw), lr=1e-3,
                    cbs=TimeSteps())
    learn.remove_cb(ProgressCallback)
    if cuda: learn.to_bf16()
    if mode in COMPILE_KWARGS: learn.compile(backend=args.backend, **COMPILE_KWARGS[mode])
    if cuda: torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with learn.no_logging(), ddp_context(learn, mode, cuda, args.sync_bn): learn.fit(1)
    fit_s = time.perf_counter() - t0
    ts = learn.time_steps
    res = dict(workload=name, mode=mode, world=world, desc=describe(cfg), fit_s=fit_s, first_step_s=ts.warm[0],
               warm_s=ts.warm, step_ms=ts.timed/args.steps*1e3, steps=args.steps, warmup=args.warmup,
               peak_gib=torch.cuda.max_memory_allocated(device)/2**30 if cuda else None,
               model_after_fit=type(learn.model).__name__, compiled_after_fit=is_compiled(learn.model), bs=cfg['bs'])
    return finish(learn, res, mode, device, world)

def finish(learn, res:dict, mode:str, device, world:int)->dict:
    "Add the compile report and, over the ranks, the slowest rank's times and whether every rank has the same parameters"
    import torch
    if mode in COMPILE_KWARGS:
        r = learn.compiler.report
        res.update(graphs=r.graphs, graph_breaks=r.graph_breaks, recompiles=len(r.recompiles), fallbacks=len(r.fallbacks),
                   compile_s=r.compile_seconds, events=[str(e) for e in r.events], ddp=r.ddp,
                   ddp_backward_graphs=r.ddp_backward_graphs, summary=r.summary())
    if world > 1:
        t = torch.tensor([res['step_ms'], res['first_step_s'], res['fit_s']], device=device, dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        res['step_ms'], res['first_step_s'], res['fit_s'] = t.tolist()
        flat = torch.cat([p.detach().float().flatten() for p in learn.model.parameters()])
        mine = torch.stack([flat.sum(), flat.abs().sum(), (flat*torch.arange(len(flat), device=flat.device)%7).sum()]).double()
        allp = [torch.zeros_like(mine) for _ in range(world)]
        torch.distributed.all_gather(allp, mine)
        res['ranks_identical'] = all(torch.equal(allp[0], a) for a in allp[1:])
    res['samples_per_s'] = world*res['bs']*1e3/res['step_ms'] # Every GPU's samples
    return res

def run_vision(args, name, cfg, mode, device, rank, world):
    "fine_tune the workflow benchmark's vision Learner from the images on disk; the last epoch's step, DataLoader included"
    import torch
    from fastai.callback.core import Callback
    from fastai.callback.progress import ProgressCallback
    import fastai.distributed
    from fastxtend_compile import is_compiled
    from workflow import build_vision
    cuda = device.type == 'cuda'
    def sync():
        if cuda: torch.cuda.synchronize(device)

    class TimeEpochs(Callback):
        "Each epoch's training time and batch count, synchronized, over `fine_tune`'s two fits"
        order = 1000
        def __init__(self): self.epochs = []
        def before_train(self): sync(); self.t = time.perf_counter()
        def after_train(self):
            sync()
            self.epochs.append((time.perf_counter() - self.t, self.n_iter))

    torch.manual_seed(0)
    learn, fine_tune = build_vision(name, cfg, args.data, 'cuda' if cuda else 'cpu', None if cuda else 0)
    learn.add_cb(TimeEpochs()).remove_cb(ProgressCallback)
    if mode in COMPILE_KWARGS: learn.compile(backend=args.backend, **COMPILE_KWARGS[mode])
    t0 = time.perf_counter()
    with learn.no_logging(), ddp_context(learn, mode, cuda, args.sync_bn): fine_tune()
    fit_s = time.perf_counter() - t0
    last_s, batches = learn.time_epochs.epochs[-1]
    res = dict(workload=name, mode=mode, world=world, desc=describe(cfg), fit_s=fit_s, first_step_s=fit_s,
               step_ms=last_s/batches*1e3, steps=batches, epochs=[e for e,_ in learn.time_epochs.epochs],
               model_after_fit=type(learn.model).__name__, compiled_after_fit=is_compiled(learn.model), bs=cfg['bs'])
    return finish(learn, res, mode, device, world)

def worker(args):
    import torch
    from fastai.torch_core import rank_distrib, num_distrib
    rank, world = rank_distrib(), max(num_distrib(), 1)
    local = int(os.environ.get('LOCAL_RANK', 0))
    if args.device == 'cuda':
        torch.cuda.set_device(local)
        device = torch.device('cuda', local)
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device('cpu')
        _cpu_gloo_patch()
    results = []
    for name in args.workloads.split(','):
        cfg = WORKLOADS[name]['smoke' if args.smoke else 'full']
        for mode in args.modes.split(','):
            t0 = time.time()
            run = run_vision if cfg['kind'] == 'vision' else run_one
            try: res = run(args, name, cfg, mode, device, rank, world)
            except Exception as e:
                import traceback; traceback.print_exc()
                res = dict(workload=name, mode=mode, world=world, desc=describe(cfg), error=f"{type(e).__name__}: {e}")
            # The Learner is gone with `run`'s frame: free its memory and compiled code before the next one
            gc.collect()
            torch._dynamo.reset()
            if device.type == 'cuda': torch.cuda.empty_cache()
            if rank == 0:
                print(f"[{world} proc] {name} {mode}: " + (res.get('error') or
                      f"first step {res['first_step_s']:.1f}s, {res['step_ms']:.1f} ms/step, {res['samples_per_s']:.0f} samples/s")
                      + f" ({time.time()-t0:.0f}s)", flush=True)
                results.append(res)
                Path(args.result).write_text(json.dumps(dict(results=results, env=versions(device.type)), indent=1))
    if world > 1: torch.distributed.barrier()

# ---------------------------------------------------------------------------------------------------------------------
# Driver: the launches and the table

def launch(args, world:int, modes:list, result:Path, timeout:float, cache:str)->tuple:
    "Run one launch of `world` processes, each training every workload in each of `modes`; (exit code or 'timeout', seconds)"
    env = {k:v for k,v in arm_env(cache).items() if k not in DIST_ENV}
    env.update(SAFE_ENV, OMP_NUM_THREADS=env.get('OMP_NUM_THREADS', '1' if args.smoke else '4'))
    wargs = ['--worker', '--result', str(result), '--workloads', args.workloads, '--modes', ','.join(modes), '--device', args.device,
             '--backend', args.backend, '--steps', str(args.steps), '--warmup', str(args.warmup)]
    wargs += ['--data', args.data] if args.data else []
    wargs += ['--smoke'] * args.smoke + ['--sync-bn'] * args.sync_bn
    me = str(Path(__file__).resolve())
    cmd = [sys.executable, me, *wargs] if world == 1 else \
          [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={world}', me, *wargs]
    print(f"$ {' '.join(cmd)}", flush=True)
    fin = run_process(cmd, env, timeout, capture=False) # The ranks print as they go
    return 'timeout' if fin.timed_out else fin.rc, fin.wall

MODE_NAMES = {'eager': 'eager', 'compile': 'learn.compile()',
              'compile-ca': 'learn.compile(ddp_compiled_autograd=True)'}

def one_gpu_mode(mode:str)->str:
    "The mode of the 1-GPU launch a multi-GPU mode is compared with: without DDP, the DDP strategy changes nothing"
    return 'compile' if mode in COMPILE_KWARGS else mode

def medians(results:list)->str:
    "Median step of each workload and mode over the multi-GPU launches, with its spread, against eager and 1 GPU"
    import statistics
    one = {(r['workload'], r['mode']): r for r in results if r['world'] == 1 and 'error' not in r}
    lines = ['| workload | mode | GPUs | launches | median step (ms) | min–max | median of per-launch eager/mode | '
             'scaling efficiency vs 1 GPU (median) |', '|---|---|---|---|---|---|---|---|']
    keys = dict.fromkeys((r['workload'], r['mode'], r['world']) for r in results if r['world'] > 1 and 'error' not in r)
    for w, m, world in keys:
        rs = [r for r in results if (r['workload'], r['mode'], r['world']) == (w, m, world) and 'error' not in r]
        steps = [r['step_ms'] for r in rs]
        ratios = [e['step_ms']/r['step_ms'] for r in rs for e in results if e['workload'] == w and e['mode'] == 'eager'
                  and e.get('launch') == r.get('launch') and 'error' not in e]
        base = one.get((w, one_gpu_mode(m)))
        eff = f"{statistics.median(r['samples_per_s'] for r in rs)/base['samples_per_s']/world:.0%}" if base else '–'
        lines.append(f"| {rs[0]['desc']} | {MODE_NAMES.get(m, m)} | {world} | {len(rs)} | {statistics.median(steps):.1f} | "
                     f"{min(steps):.1f}–{max(steps):.1f} | {statistics.median(ratios):.2f}× | {eff} |")
    return '\n'.join(lines)

def table(results:list, gpus:int)->str:
    one = {(r['workload'], r['mode']): r for r in results if r['world'] == 1 and 'error' not in r}
    lines = ['| workload | mode | GPUs | first step (s) | step (ms) | samples/s | vs eager | scaling vs 1 GPU | '
             'graphs / breaks / recompiles | compiled autograd backward graphs | ranks identical | peak GiB |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|']
    order = sorted(results, key=lambda r: (list(WORKLOADS).index(r['workload']), r['mode'] != 'eager', r['world']))
    for r in order:
        head = f"| {r['desc']} | {MODE_NAMES.get(r['mode'], r['mode'])} | {r['world']} |"
        if 'error' in r:
            lines.append(head + f" failed: {r['error'][:120]} |" + ' |'*8)
            continue
        eager = next((e for e in results if e['workload'] == r['workload'] and e.get('launch') == r.get('launch')
                      and e['mode'] == 'eager' and 'error' not in e), None)
        vs_eager = f"{eager['step_ms']/r['step_ms']:.2f}×" if eager and r['mode'] != 'eager' else '–'
        base = one.get((r['workload'], one_gpu_mode(r['mode'])))
        scaling = f"{r['samples_per_s']/base['samples_per_s']:.2f}× ({r['samples_per_s']/base['samples_per_s']/r['world']:.0%})" \
                  if base and r['world'] > 1 else '–'
        graphs = f"{r['graphs']} / {r['graph_breaks']} / {r['recompiles']}" if 'graphs' in r else '–'
        backs = r['ddp_backward_graphs'] if r.get('ddp_backward_graphs') is not None else '–'
        same = {True: 'yes', False: 'NO'}.get(r.get('ranks_identical'), '–')
        peak = f"{r['peak_gib']:.1f}" if r.get('peak_gib') is not None else '–'
        lines.append(f"{head} {r['first_step_s']:.1f} | {r['step_ms']:.1f} | {r['samples_per_s']:.0f} | {vs_eager} | "
                     f"{scaling} | {graphs} | {backs} | {same} | {peak} |")
    return '\n'.join(lines)

def report(args, results, env, launches, total_s)->str:
    gpu = env.get('gpu', env.get('device', '?'))
    where = f"{args.gpus} GPUs" if args.device == 'cuda' else f"{args.gpus} CPU processes (smoke run)"
    out = [f"# Compiled training on {where} through fastai's `distrib_ctx`", '',
           f"{datetime.date.today()}, {gpu}; torch {env.get('torch')}, fastai {env.get('fastai')}, "
           f"accelerate {env.get('accelerate')}, Python {env.get('python')}. "
           f"`{' '.join(['python', 'bench/ddp_bench.py'] + sys.argv[1:])}`, {total_s/60:.1f} min in all.", '',
           medians(results), '', 'Each launch:', '', table(results, args.gpus), '',
           f"- bf16 mixed precision (`learn.to_bf16()`). ResNet-18 and GPT: fused AdamW, synthetic batches already on the GPU, "
           f"no validation; {args.warmup} warm-up steps, then {args.steps} timed steps (synchronized at both ends, slowest "
           f"rank). Vision: fastai's defaults (Adam, `num_workers`), its step is the last epoch's training time per batch, "
           f"waits for the DataLoader included, slowest rank; first step (s) is its whole `fine_tune`. "
           f"`sync_bn={args.sync_bn}`." if args.device == 'cuda' else
           f"- CPU smoke run: gloo, tiny sizes, backend `{args.backend}`; the timings mean nothing.",
           f"- 1 GPU is a plain process, as one GPU trains (no DDP); {args.gpus} GPUs is `torchrun --nproc_per_node={args.gpus}` "
           "with `learn.distrib_ctx()`. The launches share one inductor cache: the first launch that compiles a graph "
           "compiles it cold, later ones load it.",
           f"- samples/s counts all GPUs' samples; scaling = {args.gpus}-GPU samples/s over 1-GPU samples/s (efficiency in "
           "brackets), against the 1-GPU `learn.compile()` for every compiled mode (they differ only under DDP).",
           "- graphs / breaks / recompiles come from `learn.compiler.report`; compiled autograd backward graphs are "
           "those `ddp_compiled_autograd=True` captured, from the report (`ddp_backward_graphs`).",
           "- ranks identical: a checksum of every rank's parameters after the fit is the same."]
    for l in launches: out.append(f"- launch of {l['world']} process(es), modes {', '.join(l['modes'])}: exit {l['rc']}, {l['seconds']:.0f}s")
    return '\n'.join(out) + '\n'

def driver(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, results, launches, env = time.time(), [], [], {}
    modes = args.modes.split(',')
    one_gpu = list(dict.fromkeys(map(one_gpu_mode, modes)))
    with tempfile.TemporaryDirectory() as tmp:
        if 'vision' in args.workloads.split(','): # The images, written once for every launch
            from workflow import write_images
            args.data = str(Path(tmp)/'images')
            print(f"Wrote {write_images(args.data, WORKLOADS['vision']['smoke' if args.smoke else 'full'])}", flush=True)
        cache = Path(tmp)/'inductor' # One inductor cache for every launch: the first launch's compiles are cold
        for i, world in enumerate([1] + [args.gpus]*args.repeat):
            left = args.budget - (time.time() - t0)
            if left < 30:
                print(f"Skipping the {world}-process launch: the {args.budget}s budget is spent", flush=True)
                continue
            result = Path(tmp)/f'launch{i}.json'
            # The modes in turn, in reverse order every other launch, so neither always runs first on a warm machine
            order = one_gpu if world == 1 else modes if i % 2 else modes[::-1]
            rc, secs = launch(args, world, order, result, timeout=min(args.timeout, left), cache=str(cache))
            launches.append(dict(world=world, rc=rc, seconds=secs, modes=order))
            if result.exists():
                d = json.loads(result.read_text())
                results += [dict(r, launch=i) for r in d['results']]
                env = d['env']
            if rc != 0: print(f"The {world}-process launch ended with {rc}", flush=True)
    total = time.time() - t0
    (out/'ddp.json').write_text(json.dumps(dict(env=env, args=vars(args), launches=launches, results=results), indent=1))
    md = report(args, results, env, launches, total)
    (out/'ddp.md').write_text(md)
    print(md)
    ok = all(l['rc'] == 0 for l in launches) and len(launches) == 1 + args.repeat and results and not any('error' in r for r in results)
    ok = ok and all(r.get('ranks_identical', True) for r in results)
    return 0 if ok else 1

def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', default=str(ROOT/'bench'/'results'/'ddp'/'latest'), help='Folder for ddp.md and ddp.json')
    p.add_argument('--gpus', type=int, default=2, help='Processes of the multi-GPU launch')
    p.add_argument('--repeat', type=int, default=1, help='Multi-GPU launches, each running every mode in turn: medians and spread')
    p.add_argument('--workloads', default='resnet18,gpt,vision')
    p.add_argument('--modes', default='eager,compile,compile-ca',
                   help="eager; compile (learn.compile()'s default), compile-ca (ddp_compiled_autograd=True)")
    p.add_argument('--data', default=None, help=argparse.SUPPRESS)
    p.add_argument('--device', default=None, help='cuda (default with a GPU) or cpu')
    p.add_argument('--backend', default=None, help="torch.compile backend (default: inductor; aot_eager with --smoke)")
    p.add_argument('--steps', type=int, default=None, help='Timed steps per rank (default 40; 3 with --smoke)')
    p.add_argument('--warmup', type=int, default=None, help='Warm-up steps, compiling included (default 5; 2 with --smoke)')
    p.add_argument('--sync-bn', action='store_true', help="Convert BatchNorm to SyncBatchNorm (fastai's default in distrib_ctx)")
    p.add_argument('--smoke', action='store_true', help='Tiny sizes on the CPU with gloo: checks the code paths')
    p.add_argument('--timeout', type=float, default=300, help='Seconds for one launch')
    p.add_argument('--budget', type=float, default=530, help='Seconds for the whole run; a launch that would start later is skipped')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--result', help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device is None:
        import torch
        args.device = 'cuda' if torch.cuda.is_available() and not args.smoke else 'cpu'
    args.backend = args.backend or ('aot_eager' if args.smoke else 'inductor')
    args.steps = args.steps or (3 if args.smoke else 40)
    args.warmup = args.warmup or (2 if args.smoke else 5)
    if args.device == 'cuda' and not args.worker:
        import torch
        if torch.cuda.device_count() < args.gpus: sys.exit(f"{args.gpus} GPUs asked for, {torch.cuda.device_count()} found")
    if args.worker: worker(args)
    else: sys.exit(driver(args))

if __name__ == '__main__': main()
