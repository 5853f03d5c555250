"""One process of a compiled fastai fit under `learn.distrib_ctx()` on the CPU with `gloo`, for tests/test_distributed.py.

The test starts it once per rank with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` set, as
`torchrun --nproc_per_node=2 tests/ddp_worker.py OUT` would; without them it runs the same fit in one process, without
DDP, on the same global batches. It writes what the test checks to `OUT/rank{RANK}.pt`.
"""
import argparse, faulthandler, os, time
os.environ.setdefault('OMP_NUM_THREADS', '1') # Before torch loads; else accelerate sets the thread count and warns
# Where the launch will time out, each process prints its stacks first: the log then says where a stuck rank waits
if (_dump := os.environ.get('FXC_TEST_DUMP_AFTER')): faulthandler.dump_traceback_later(float(_dump), exit=False)

import torch
from torch import nn
from fastai.data.core import TfmdDL, DataLoaders
from fastai.learner import Learner
from fastai.callback.progress import ProgressCallback
from fastai.optimizer import SGD
from fastai.callback.core import Callback
from fastai.torch_core import rank_distrib, num_distrib, distrib_barrier
from fastai.distributed import DistributedDL
from accelerate.utils import DistributedDataParallelKwargs
from torch._dynamo.backends.distributed import DDPOptimizer
from fastxtend_compile import *
from fastxtend_compile.worker import Worker
Worker.nice = 0 # Workers at the fit's priority, as in every test process (tests/conftest.py)

def _broadcast(self, t, rank):
    "fastai broadcasts the sample order as a CUDA tensor, which only NCCL needs; this fit runs on the CPU with `gloo`"
    t = torch.LongTensor(t)
    torch.distributed.broadcast(t, rank)
    return t.tolist()
DistributedDL._broadcast = _broadcast

# Record the buckets DDPOptimizer splits each graph into, if it does: graphs stay whole
_ddp_buckets, _ddp_compile_fn = [], DDPOptimizer.compile_fn
def _spy_compile_fn(self, gm, example_inputs, **kwargs):
    res = _ddp_compile_fn(self, gm, example_inputs, **kwargs)
    _ddp_buckets.append(len(self.buckets))
    return res
DDPOptimizer.compile_fn = _spy_compile_fn

N_TRAIN, N_VALID, BS, N_IN, N_HID, N_OUT = 64, 32, 8, 6, 512, 3 # `BS` per rank: a global batch is `BS*2` samples

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN+N_VALID, N_IN, generator=g)
    y = x @ torch.randn(N_IN, N_OUT, generator=g) + 0.1*torch.randn(N_TRAIN+N_VALID, N_OUT, generator=g)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]

def global_order(n, bs, world=2):
    "Sample order that makes a single process's batch `k` (`bs*world` samples) the union of the ranks' batches `k`"
    per = n // world # `DistributedDL` gives rank `r` the `r`-th contiguous `1/world` of the samples, unshuffled here
    return [r*per + k*bs + i for k in range(per//bs) for r in range(world) for i in range(bs)]

class TensorDS:
    "Pairs of tensors, with what fastai asks of a dataset: `n_inp` and, to export, `new_empty`"
    n_inp = 1
    def __init__(self, x, y): self.x,self.y = x,y
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return self.x[i], self.y[i]
    def new_empty(self): return TensorDS(self.x[:0], self.y[:0])

def dls(world):
    xt,yt,xv,yv = data()
    if world == 1:
        it,iv = global_order(N_TRAIN, BS), global_order(N_VALID, BS)
        xt,yt,xv,yv = xt[it],yt[it],xv[iv],yv[iv]
    bs = BS*2 if world == 1 else BS
    # `num_workers=0`, as tests/ddp_background.py and tests/ddp_ragged.py: batches made in the rank's own process. fastai's
    # default (one worker per core) forks worker processes every epoch from ranks that run gloo's and the TCPStore's threads,
    # 3 processes' workers on a 2-core machine
    return DataLoaders(*(TfmdDL(TensorDS(x,y), bs=bs, shuffle=False, num_workers=0, device='cpu') for x,y in ((xt,yt), (xv,yv))),
                       device='cpu')

class MLP(nn.Module):
    "The same layers as a class with its own `forward`"
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)
    def forward(self, x):
        for l in self.layers: x = l(x)
        return x

def model(kind):
    torch.manual_seed(42) # Same initial weights everywhere (DDP would broadcast rank 0's anyway)
    layers = [nn.Linear(N_IN, N_HID), nn.ReLU(), nn.Linear(N_HID, N_HID), nn.ReLU(), nn.Linear(N_HID, N_HID), nn.ReLU(),
              nn.Linear(N_HID, N_OUT)] # Two 1 MiB layers: more than one 1 MiB DDP bucket
    return nn.Sequential(*layers) if kind == 'sequential' else MLP(layers)

def events(report):
    return [dict(kind=e.kind, frame=e.frame, reason=e.reason, text=str(e)) for e in report.events]

def learner(world, model_kind, backend, **kwargs):
    learn = Learner(dls(world), model(model_kind), loss_func=nn.MSELoss(), opt_func=SGD, lr=0.1)
    learn.remove_cb(ProgressCallback)
    return learn.compile(backend=backend, **kwargs)

class _CountingReducer:
    "DDP's reducer, counting the backwards DDP prepares it for: those whose gradients DDP's reducer averages"
    def __init__(self, reducer): self.reducer, self.prepared = reducer, 0
    def prepare_for_backward(self, *args, **kwargs):
        self.prepared += 1
        return self.reducer.prepare_for_backward(*args, **kwargs)
    def __getattr__(self, name): return getattr(self.reducer, name)

class SyncSpy(Callback):
    "For each training batch: whether it ran compiled code, whether DDP's reducer averaged it, and how many times the library did"
    order = 13 # After DDP wraps the model (11) and the compiler chose this batch's code (12)
    def __init__(self): self.batches, self.counter, self.before = [], None, None
    def before_fit(self):
        if hasattr(self.learn.model, 'reducer'): self.learn.model.reducer = self.counter = _CountingReducer(self.learn.model.reducer)
    def before_batch(self):
        if self.counter is not None and self.training:
            self.before = (not self.learn.compiler.policy.eager, self.counter.prepared, self.learn.compiler.ddp.sync.synced)
    def after_batch(self):
        if self.before is None: return
        compiled, prepared, synced = self.before
        self.batches.append((compiled, self.counter.prepared - prepared, self.learn.compiler.ddp.sync.synced - synced))
        self.before = None
    def after_fit(self): self.counter = None # DDP goes with the fit, and an export pickles the Learner's callbacks

class EarlyGrads(Callback):
    "The gradients a callback that runs before `CompilerCallback` sees at `after_backward`, each training batch"
    order = 5
    def __init__(self): self.grads = []
    def after_backward(self):
        if self.training: self.grads.append(torch.cat([p.grad.flatten() for p in self.learn.model.parameters()]).clone())

def fit(world, model_kind, backend, epochs=2, **kwargs):
    learn = learner(world, model_kind, backend, **kwargs)
    learn.add_cbs([SyncSpy(), EarlyGrads()])
    with learn.distrib_ctx(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=1)]): learn.fit(epochs)
    return learn

def export_and_load(learn, fname, rank, world):
    "Export on every rank as a script would, count the files written, and load the export"
    saves, save = [], torch.save
    def spy(obj, f, *args, **kwargs):
        if str(f) == fname: saves.append(rank)
        return save(obj, f, *args, **kwargs)
    torch.save = spy
    try: learn.export(fname)
    finally: torch.save = save
    if world > 1: distrib_barrier() # The other ranks wait for rank 0's file
    return saves, load_learner(fname)

def compiled_autograd(world, model_kind, backend):
    "A fit with `ddp_compiled_autograd=True`: DDP's Python reducer, its all-reduces in compiled autograd's backward graphs"
    from torch._inductor import config as inductor_config
    from torch._dynamo import trace_rules
    settings = lambda: (torch._dynamo.config.optimize_ddp, inductor_config._fuse_ddp_communication,
                        'torch.nn.parallel.distributed' in trace_rules.LEGACY_MOD_INLINELIST,
                        torch._functorch.config.enable_autograd_cache)
    before, captures = settings(), torch._dynamo.utils.counters['compiled_autograd']['captures']
    learn = fit(world, model_kind, backend, epochs=1, ddp_compiled_autograd=True)
    r = learn.compiler.report
    return dict(ca_summary=r.summary(), ca_backward_graphs=r.ddp_backward_graphs, ca_ddp=r.ddp, ca_events=events(r),
                ca_captures=torch._dynamo.utils.counters['compiled_autograd']['captures'] - captures,
                ca_settings=(before, settings()), ca_params={k: v.detach().clone() for k,v in learn.model.state_dict().items()})

def gradsync_check(rank):
    "`all_reduce_grads` on two ranks: one gradient each has, one only rank 1 has, one neither has, and one of another dtype"
    from fastxtend_compile.gradsync import all_reduce_grads, by_kind
    a, b, c = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    d = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    a.grad, d.grad = torch.full((3,), rank + 1.), torch.full((2,), 2. * rank, dtype=torch.float64)
    if rank == 1: b.grad = torch.tensor([2., 4.])
    all_reduce_grads(by_kind([a, b, c, d]))
    return dict(gs_a=a.grad, gs_b=b.grad, gs_c=c.grad, gs_d=d.grad)

def explain(world, model_kind, backend):
    "A fit with `DynamoExplainCallback`, which explains on rank 0 and cancels the fit on every rank"
    learn = learner(world, model_kind, backend).add_cb(DynamoExplainCallback(print_results=False))
    with learn.distrib_ctx(cpu=True): learn.fit(1)
    out = learn.dynamo_explain.explain_output
    return dict(explain_graphs=None if out is None else out.graph_count, explain_iters=learn.train_iter,
                explain_model_type=type(learn.model).__name__)

def main():
    p = argparse.ArgumentParser()
    p.add_argument('out')
    p.add_argument('--model', default='sequential', choices=['sequential', 'class'])
    p.add_argument('--backend', default='aot_eager')
    p.add_argument('--no-explain', action='store_true')
    a = p.parse_args()
    rank, world = rank_distrib(), max(num_distrib(), 1)
    t0 = time.time()
    learn = fit(world, a.model, a.backend)
    report = learn.compiler.report
    res = dict(rank=rank, world=world, fit_seconds=time.time()-t0, model_type=type(learn.model).__name__,
               compiled_after_fit=is_compiled(learn.model), events=events(report), graph_breaks=report.graph_breaks,
               ddp_buckets=list(_ddp_buckets), ddp=report.ddp,
               summary=report.summary(), losses=[float(l) for l in learn.recorder.losses], sync_batches=learn.sync_spy.batches,
               early_grads=learn.early_grads.grads,
               params={k: v.detach().clone() for k,v in learn.model.state_dict().items()})
    res['export_saves'], loaded = export_and_load(learn, os.path.join(a.out, f'export{world}.pkl'), rank, world)
    x = data()[2][:4]
    with torch.no_grad(): res['loaded_out'], res['trained_out'] = loaded.model(x), learn.model.eval()(x)
    res['loaded_compiled'] = is_compiled(loaded.model)
    res['optimize_ddp_after'] = torch._dynamo.config.optimize_ddp
    res.update(compiled_autograd(world, a.model, a.backend))
    if world > 1: res.update(gradsync_check(rank))
    if world > 1 and not a.no_explain:
        res.update(explain(world, a.model, a.backend))
        distrib_barrier() # Every rank got here: none is left waiting in a collective
    torch.save(res, os.path.join(a.out, f'rank{rank}.pt'))
    print(f"rank {rank} of {world}: fit in {res['fit_seconds']:.1f}s, DDPOptimizer buckets {res['ddp_buckets']}\n"
          + learn.compiler.report.summary())

if __name__ == '__main__': main()
