"""Run one benchmark arm in this process and write its result as JSON.

An arm is one way of training one workload with one optimizer:

    python bench/arm.py --workload resnet18 --arm fastai_compile --opt fastai_adam --device cuda --result out.json

`bench/bench.py` runs every arm in its own process with a fresh `TORCHINDUCTOR_CACHE_DIR`; run this file directly
only to debug one arm.
"""
from __future__ import annotations
import argparse, inspect, json, os, platform, statistics, sys, time, traceback, types
from contextlib import nullcontext
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1])) # The repository's `fastxtend_compile`, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn
import torch.nn.functional as F
from procs import library_version, versions

ARMS = {
    # name: (training loop, torch.compile mode or None for eager, regional: False, True or 'nested')
    'hand_eager':              ('hand',   None,              False),
    'hand_compile':            ('hand',   'default',         False),
    'hand_compile_ro':         ('hand',   'reduce-overhead', False),
    'hand_compile_regional':   ('hand',   'default',         True),
    'hand_compile_nested':     ('hand',   'default',         'nested'),
    'fastai_eager':            ('fastai', None,              False),
    'fastai_compile':          ('fastai', 'default',         False),
    'fastai_compile_ro':       ('fastai', 'reduce-overhead', False),
    'fastai_compile_regional': ('fastai', 'default',         True),
    'fastai_compile_nested':   ('fastai', 'default',         'nested'),
}
OPTS = ('fastai_adam', 'fused_adamw')
LR = 1e-3

# Workload sizes: the full size runs on a GPU, `smoke` is a tiny CPU check of the same code paths
WORKLOADS = {
    'resnet18': dict(full=dict(kind='resnet', px=128, bs=64), smoke=dict(kind='resnet', px=32, bs=4)),
    'small':    dict(full=dict(kind='resnet', px=64,  bs=16), smoke=dict(kind='resnet', px=32, bs=2)),
    'gpt':      dict(full=dict(kind='gpt', n_layer=8, d=512, n_head=8, T=256, vocab=8192, bs=64),
                     smoke=dict(kind='gpt', n_layer=2, d=64, n_head=2, T=32, vocab=256, bs=4)),
}

def workload_config(args)->dict:
    "The workload's sizes: full or smoke, with `--config`'s changes"
    return {**WORKLOADS[args.workload]['smoke' if args.smoke else 'full'], **json.loads(args.config)}

def describe(cfg:dict)->str:
    "A workload's size in a few words"
    if cfg['kind'] == 'resnet': return f"ResNet-18, {cfg['px']} px, bs {cfg['bs']}"
    return f"GPT {cfg['n_layer']} layers, d={cfg['d']}, T={cfg['T']}, vocab {cfg['vocab']}, bs {cfg['bs']}"

# ---------------------------------------------------------------------------------------------------------------------
# Models and data

class Block(nn.Module):
    "Pre-norm transformer block with causal self-attention through `F.scaled_dot_product_attention`"
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3*d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4*d), nn.GELU(approximate='tanh'), nn.Linear(4*d, d))

    def forward(self, x):
        B,T,C = x.shape
        q,k,v = (t.view(B, T, self.n_head, C//self.n_head).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    "A GPT-style decoder: token and position embeddings, `n_layer` blocks, final norm and a vocabulary head"
    def __init__(self, vocab, T, d, n_layer, n_head):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks: x = b(x)
        return self.head(self.ln_f(x))

class TextClassifier(nn.Module):
    """The workflow benchmark's text model (bench/workflow.py): token and position embeddings, a pre-norm transformer
    encoder, mean pooling, a linear head. At a module's top level, where TorchDynamo can save its code (`precompile=True`)"""
    def __init__(self, vocab, seq, d, layers, heads, n_out):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(1, seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4*d, dropout=0.1, activation='gelu', batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, n_out)

    def forward(self, x):
        h = self.encoder(self.tok(x) + self.pos[:, :x.shape[1]])
        return self.head(self.norm(h).mean(1))

def make_model(cfg):
    if cfg['kind'] == 'resnet':
        import torchvision
        return torchvision.models.resnet18(num_classes=1000) # Random init
    return GPT(cfg['vocab'], cfg['T'], cfg['d'], cfg['n_layer'], cfg['n_head'])

def repeated_blocks(model)->list:
    "The repeated blocks that regional compilation compiles one by one"
    if isinstance(model, GPT): return list(model.blocks)
    return [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]

def twins(blocks:list)->list:
    "`blocks` in sets of twins: of one class, with parameters of the same shapes"
    res = {}
    for b in blocks: res.setdefault((type(b), tuple(p.shape for p in b.parameters())), []).append(b)
    return list(res.values())

def nest_by_hand(model):
    """Each set of twin blocks runs its `forward` as one `torch.compiler.nested_compile_region`, as a PyTorch user would
    mark it; `torch.compile(model)` then traces each set once inside the whole model's graph"""
    def block_forward(module, *args, **kwargs): return type(module).forward(module, *args, **kwargs)
    for i, group in enumerate(twins(repeated_blocks(model))):
        # A code object of its own for each set (TorchDynamo keeps a region's traces by its code); the block is passed to
        # the region as an argument, as `partial` does, not captured by a closure or a bound method
        code = block_forward.__code__.replace(co_name=f'block_region{i}')
        region = torch.compiler.nested_compile_region(types.FunctionType(code, globals(), f'block_region{i}'))
        for b in group: b.forward = partial(region, b)

def make_batches(cfg, device, n=4, typed=True)->list:
    "`n` distinct synthetic batches, already on `device`; typed as fastai's data blocks would type them if `typed`"
    from fastai.torch_core import TensorBase, TensorImage, TensorCategory
    g = torch.Generator().manual_seed(0)
    res = []
    for _ in range(n):
        if cfg['kind'] == 'resnet':
            x = torch.randn(cfg['bs'], 3, cfg['px'], cfg['px'], generator=g)
            y = torch.randint(0, 1000, (cfg['bs'],), generator=g)
            tx, ty = TensorImage, TensorCategory
        else:
            x = torch.randint(0, cfg['vocab'], (cfg['bs'], cfg['T']), generator=g)
            y = torch.randint(0, cfg['vocab'], (cfg['bs'], cfg['T']), generator=g)
            tx = ty = TensorBase # fastai's language-model batches are `TensorText`, a plain `TensorBase` subclass
        x, y = x.to(device), y.to(device)
        res.append((tx(x), ty(y)) if typed else (x, y))
    return res

# ---------------------------------------------------------------------------------------------------------------------
# Timing

class StepTimer:
    "Wall time of each warm-up step (synchronized) and device time between the ends of the timed steps"
    def __init__(self, device, warmup):
        self.cuda, self.warmup = device.type == 'cuda', warmup
        self.warm_s, self.ends = [], []

    def sync(self):
        if self.cuda: torch.cuda.synchronize()

    def start(self):
        self.sync()
        self.t = time.perf_counter()

    def step_done(self, i):
        "Call at the end of training step `i` (0-based)"
        if i < self.warmup:
            self.sync()
            t = time.perf_counter()
            self.warm_s.append(t - self.t)
            self.t = t
            if i < self.warmup - 1: return
        # Timed steps are not synchronized, so the host can run ahead of the GPU as it does in real training
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.ends.append(e)
        else: self.ends.append(time.perf_counter())

    def step_ms(self)->list:
        self.sync()
        if self.cuda: return [a.elapsed_time(b) for a,b in zip(self.ends, self.ends[1:])]
        return [(b - a)*1e3 for a,b in zip(self.ends, self.ends[1:])]

# ---------------------------------------------------------------------------------------------------------------------
# The two training loops

def hand_loop(args, cfg, model, batches, device, mode, regional, timer):
    "A hand-written PyTorch training loop"
    if mode is not None:
        if regional == 'nested':
            nest_by_hand(model)
            model = torch.compile(model, backend=args.backend, mode=mode)
        elif regional:
            for b in repeated_blocks(model): b.compile(backend=args.backend, mode=mode)
        else: model = torch.compile(model, backend=args.backend, mode=mode)
    if args.opt == 'fused_adamw': opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    else:
        from fastai.optimizer import Adam
        opt = Adam(list(model.parameters()), lr=LR)
    autocast = torch.autocast('cuda', torch.bfloat16) if device.type == 'cuda' else nullcontext()
    mark_step = mode == 'reduce-overhead' and not regional
    model.train()
    timer.start()
    for i in range(args.warmup + args.steps):
        x, y = batches[i % len(batches)]
        if mark_step: torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            out = model(x)
            loss = F.cross_entropy(out.view(-1, out.shape[-1]), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        timer.step_done(i)
    return dict(compiled=model)

def fastai_loop(args, cfg, model, batches, device, mode, regional, timer, cbs=()):
    "`Learner.fit` for exactly warmup+steps batches, no validation, no progress bar or logging"
    from fastcore.basics import noop
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.data.load import DataLoader
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.optimizer import Adam, OptimWrapper

    class Batches:
        "`n` prebatched items cycling through `pool`"
        def __init__(self, pool, n): self.pool, self.n = pool, n
        def __len__(self): return self.n
        def __getitem__(self, i): return self.pool[i % len(self.pool)]

    class TimeSteps(Callback):
        order = 1000 # After every other callback, so a step ends when fastai's work on the batch is done
        def before_train(self): timer.start()
        def after_batch(self):
            if self.training: timer.step_done(self.iter)

    dls = DataLoaders(DataLoader(Batches(batches, args.warmup + args.steps), bs=None),
                      DataLoader(Batches(batches, 0), bs=None), device=device)
    opt_func = Adam if args.opt == 'fastai_adam' else partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))
    cbs = [TimeSteps(), *cbs]
    if device.type == 'cuda':
        from fastai.callback.fp16 import MixedPrecision
        cbs.append(MixedPrecision(amp_mode='bf16'))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=opt_func, lr=LR, cbs=cbs)
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    learn.logger = noop
    info = {}
    if mode is not None:
        import fastxtend_compile # Patches `Learner.compile`
        from fastxtend_compile import CompilerCallback
        kwargs = dict(backend=args.backend, mode=None if mode == 'default' else mode, **json.loads(args.compile_kwargs))
        if regional:
            if 'regional' not in inspect.signature(CompilerCallback.__init__).parameters:
                raise Skip(f"fastxtend_compile {library_version()} has no `regional` option on `learn.compile`")
            if regional == 'nested' and not hasattr(fastxtend_compile.core, 'nest_blocks'):
                raise Skip(f"fastxtend_compile {library_version()} has no `regional='nested'`")
            kwargs['regional'] = regional
        learn.compile(**kwargs)
        info['compile_kwargs'] = {k:str(v) for k,v in kwargs.items()}
    learn.fit(1)
    if mode is not None:
        try:
            r = learn.compiler.report
            info['compile_report'] = dict(graphs=r.graphs, graph_breaks=r.graph_breaks, recompiles=len(r.recompiles),
                                          fallbacks=len(r.fallbacks), compile_seconds=round(r.compile_seconds, 2))
        except AttributeError as e: info['compile_report_error'] = str(e) # The report's fields moved: not fatal here
    info['compiled'] = learn.model
    return info

class Skip(Exception): "The arm cannot run with this version of the library"

# ---------------------------------------------------------------------------------------------------------------------
# Profiling a fastai arm (`--profile FILE`): where the time goes that compiling doesn't save

PACKAGES = ('fastxtend_compile', 'fastai', 'fastcore', 'fastprogress', 'torch')

def _package(file:str)->str|None:
    if 'torchinductor' in file or file.startswith(os.environ.get('TORCHINDUCTOR_CACHE_DIR') or '\0'): return 'compiled code'
    return next((k for k in PACKAGES if f'/{k}/' in file), None)

def python_profile(py, steps:int)->list:
    "Host time per step by package (each package's own Python and the C functions it calls), and the top functions"
    import io, pstats
    st = pstats.Stats(py)
    by_pkg, total = {}, 0.
    for (file, line, fn), (cc, nc, tt, ct, callers) in st.stats.items():
        if file == '~': # A C function: count it for the package of the Python that called it most
            caller = max(callers.items(), key=lambda kv: kv[1][2], default=None)
            pkg = (caller and _package(caller[0][0])) or 'other'
        else: pkg = _package(file) or 'other'
        by_pkg[pkg] = by_pkg.get(pkg, 0.) + tt
        total += tt
    lines = ["", f"Host time under cProfile: {total/steps*1e3:.2f} ms/step, by the package whose code spends it:"]
    lines += [f"  {k:18s} {v/steps*1e3:6.2f} ms/step  {v/total:5.1%}" for k,v in sorted(by_pkg.items(), key=lambda kv: -kv[1])]
    out = io.StringIO()
    pstats.Stats(py, stream=out).sort_stats('tottime').print_stats(25)
    table = out.getvalue()
    return lines + ["", "Top Python functions by own time:", table[table.find('   ncalls'):]]

def profile(args)->dict:
    """Train a fastai arm for `warmup` steps, then `steps` under torch.profiler (operators, kernel launches, device time)
    and `steps` more under cProfile (host time by package); write the report to `args.profile`"""
    import cProfile
    from torch.profiler import profile as torch_profile, ProfilerActivity
    from fastai.callback.core import Callback
    loop, mode, regional = ARMS[args.arm]
    if loop != 'fastai': raise Skip('--profile profiles the fastai arms')
    device = torch.device(args.device)
    cuda = device.type == 'cuda'
    cfg = workload_config(args)
    if cuda: torch.set_float32_matmul_precision('high')
    def sync():
        if cuda: torch.cuda.synchronize()
    class Profile(Callback):
        order = 1000
        def before_batch(self):
            if not self.training: return
            if self.iter == args.warmup:
                sync()
                self.prof = torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA]*cuda)
                self.prof.__enter__(); self.t0 = time.perf_counter()
            if self.iter == args.warmup + steps: # torch.profiler's steps are done: Python's next
                sync()
                self.wall = time.perf_counter() - self.t0
                self.prof.__exit__(None, None, None)
                self.py = cProfile.Profile(); self.py.enable()
        def after_fit(self): self.py.disable()
    prof, steps = Profile(), args.steps
    torch.manual_seed(0)
    model = make_model(cfg).to(device)
    batches = make_batches(cfg, device, typed=not args.plain)
    args.steps = 2*steps # The fit runs both profiled stretches
    fastai_loop(args, cfg, model, batches, device, mode, regional, StepTimer(device, args.warmup), cbs=[prof])
    args.steps = steps
    ev = prof.prof.key_averages()
    launches = sum(e.count for e in ev if e.key in ('cudaLaunchKernel', 'cuLaunchKernel', 'cudaLaunchKernelExC', 'cuLaunchKernelEx'))
    dev_attr = 'self_device_time_total' if hasattr(ev[0], 'self_device_time_total') else 'self_cuda_time_total'
    dev_total = sum(getattr(e, dev_attr, 0) for e in ev)
    lines = [f"{args.workload}, {args.opt}, {args.arm}, {versions(args.device)['device']}, torch {torch.__version__}",
             f"wall {prof.wall/steps*1e3:.2f} ms/step (profiled); device busy {dev_total/steps/1e3:.2f} ms/step; "
             f"{launches/steps:.0f} kernel launches/step",
             "", "Top operators by self CPU time:", ev.table(sort_by='self_cpu_time_total', row_limit=15)]
    if cuda: lines += ["Top operators by device time:", ev.table(sort_by=dev_attr, row_limit=12)]
    lines += python_profile(prof.py, steps)
    Path(args.profile).write_text('\n'.join(lines))
    return dict(status='profiled', reason=f'wrote {args.profile}')

# ---------------------------------------------------------------------------------------------------------------------
# What the compiler made, and whether it trains as eager does

def compile_stats()->dict:
    "TorchDynamo's graphs, inductor's compiled graphs (forward and backward count apart), nested regions traced and reused"
    from torch._dynamo.utils import counters, compilation_time_metrics
    ind = counters['inductor']
    return dict(dynamo_graphs=counters['stats']['unique_graphs'],
                inductor_graphs=ind['fxgraph_cache_miss'] + ind['fxgraph_cache_hit'],
                regions_traced=len(compilation_time_metrics.get('invoke_subgraph_trace', [])),
                regions_reused=len(compilation_time_metrics.get('invoke_subgraph_reuse_stamp_out', [])),
                # Where the seconds went: TorchDynamo's tracing, AOTAutograd (which calls inductor), inductor's lowering and
                # code generation, and the wait for its compiled kernels (C++ or triton)
                phases={k: round(sum(compilation_time_metrics.get(k, [])), 2) for k in
                        ('bytecode_tracing', 'create_aot_dispatcher_function', 'GraphLowering.run', 'Scheduler.codegen', 'async_compile.wait')})

def matches_eager(cfg, module, compiled, batch, device)->dict:
    """One training step's loss and gradients through `compiled` against an eager copy of `module` with the same weights:
    the loss's absolute difference and the largest relative difference (by norm) of a parameter's gradient"""
    eager = make_model(cfg).to(device)
    eager.load_state_dict(module.state_dict())
    module.train(), eager.train() # A fastai fit ends on its validation, in eval mode
    autocast = torch.autocast('cuda', torch.bfloat16) if device.type == 'cuda' else nullcontext()
    x, y = (t.as_subclass(torch.Tensor) for t in batch)
    module.zero_grad(set_to_none=True)
    losses = []
    for m in (compiled, eager):
        with autocast:
            out = m(x)
            loss = F.cross_entropy(out.view(-1, out.shape[-1]).float(), y.view(-1))
        loss.backward()
        losses.append(loss.item())
    errs = [((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12)).item()
            for p,q in zip(module.parameters(), eager.parameters()) if q.grad is not None]
    missing = sum(p.grad is None for p,q in zip(module.parameters(), eager.parameters()) if q.grad is not None)
    return dict(loss_diff=abs(losses[0] - losses[1]), grad_rel_err=max(errs) if not missing else float('inf'),
                grads_missing=missing)

# ---------------------------------------------------------------------------------------------------------------------

def run(args)->dict:
    device = torch.device(args.device)
    cfg = workload_config(args)
    loop, mode, regional = ARMS[args.arm]
    if device.type == 'cuda':
        torch.zeros(1, device=device); torch.cuda.synchronize() # CUDA context up front, not in the first step
        torch.set_float32_matmul_precision('high') # What `learn.compile` sets; the same for every arm
    torch.manual_seed(0)
    model = make_model(cfg).to(device)
    batches = make_batches(cfg, device, typed=loop == 'fastai' and not args.plain)
    if device.type == 'cuda': torch.cuda.reset_peak_memory_stats(device)
    timer = StepTimer(device, args.warmup)
    t0 = time.perf_counter()
    info = (hand_loop if loop == 'hand' else fastai_loop)(args, cfg, model, batches, device, mode, regional, timer)
    ms = timer.step_ms()
    compiled = info.pop('compiled', None)
    if mode is not None:
        info.update(compile_stats())
        info['vs_eager'] = matches_eager(cfg, model, compiled, batches[0], device)
    if len(ms) != args.steps: raise RuntimeError(f"timed {len(ms)} steps, expected {args.steps}")
    med = statistics.median(ms)
    return dict(status='ok', median_ms=med, mean_ms=statistics.fmean(ms), min_ms=min(ms), max_ms=max(ms),
                first_step_s=timer.warm_s[0],
                # Cold (or warm-cache) compile time: the first step's wall time less a steady-state step
                compile_s=timer.warm_s[0] - med/1e3 if mode is not None else None,
                # Time all warm-up steps took over steady state (also counts CUDA graph recording, late recompiles)
                warmup_excess_s=sum(timer.warm_s) - len(timer.warm_s)*med/1e3,
                peak_mem_gb=torch.cuda.max_memory_allocated(device)/2**30 if device.type == 'cuda' else None,
                run_s=time.perf_counter() - t0, **info)

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--workload', choices=WORKLOADS, required=True)
    p.add_argument('--arm', choices=ARMS, required=True)
    p.add_argument('--opt', choices=OPTS, required=True)
    p.add_argument('--device', default='cuda')
    p.add_argument('--steps', type=int, default=100, help='timed steps')
    p.add_argument('--warmup', type=int, default=20, help='untimed steps before them (at least 1: the first is the compile step)')
    p.add_argument('--backend', default='inductor', help='torch.compile backend for the compiled arms')
    p.add_argument('--compile-kwargs', default='{}', help='extra keyword arguments for `learn.compile`, as JSON')
    p.add_argument('--smoke', action='store_true', help='tiny workload sizes')
    p.add_argument('--config', default='{}', help='changes to the workload\'s sizes, as JSON, e.g. \'{"n_layer": 4}\'')
    p.add_argument('--plain', action='store_true', help="feed the fastai arms plain tensors, not fastai's typed ones")
    p.add_argument('--phase', default='cold', help='label only: cold or warm (bench.py reuses the cache dir for warm)')
    p.add_argument('--profile', default=None, help="a fastai arm: profile its steady steps into this file instead of timing them")
    p.add_argument('--result', required=True, help='where to write the JSON result')
    args = p.parse_args()
    if args.warmup < 1: p.error('--warmup must be at least 1')
    rec = dict(workload=args.workload, arm=args.arm, opt=args.opt, phase=args.phase, backend=args.backend,
               steps=args.steps, warmup=args.warmup, smoke=args.smoke,
               config=workload_config(args),
               cache_dir=os.environ.get('TORCHINDUCTOR_CACHE_DIR'))
    rc = 0
    try:
        rec['env'] = versions(args.device)
        rec.update(profile(args) if args.profile else run(args))
    except Skip as e: rec.update(status='skipped', reason=str(e))
    except Exception as e:
        traceback.print_exc()
        lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()] # torch's compiler errors say what failed on a later line
        rec.update(status='error', reason=f"{type(e).__name__}: {' '.join(lines[:2])[:400]}")
        rc = 1
    Path(args.result).write_text(json.dumps(rec, indent=1))
    sys.exit(rc)

if __name__ == '__main__': main()
