"""One rank of compiled fits under `learn.distrib_ctx()` that compile in the background, for tests/test_distributed.py.

Started once per rank with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` set, on the CPU with
`gloo`, sharing one inductor cache: a first fit (cold: the host's worker compiles while every rank trains eagerly), a
second of a new `Learner` of the same model (warm: compiled at once), one of the model with its first layer frozen (a
new state: the worker again), on 2 ranks fits that try a faster tier (kept, then raising in rank 1's path) and fits whose
eager step rank 0 finds launch-bound (its tier compiled first in every rank's path, cold then warm), one whose worker fails, and eager DDP fits for reference; then an agreement that rank 1 never comes to, and
a fit that rank 1 ends with an exception while rank 0's worker compiles. It writes what the test checks to
`OUT/rank{RANK}.pt`.
"""
import argparse, math, os, time, warnings
os.environ.setdefault('OMP_NUM_THREADS', '1') # Before torch loads; else accelerate sets the thread count and warns

import torch
from fastai.callback.core import Callback
from fastai.torch_core import rank_distrib, num_distrib, distrib_barrier
from fastxtend_compile import *
from fastxtend_compile.background import BackgroundCompile, WarmStarts
from fastxtend_compile.worker import Worker
from fastxtend_compile.agreement import DDP
from fastxtend_compile import tiers, background, life
from fastxtend_compile.tiers import Tiers
from tier_backends import sleepy, flaky, IdleMeter as _IdleMeter
import ddp_worker as learner_module
from ddp_worker import learner, model as _model, dls, nn, Learner, SGD, ProgressCallback # Its `DistributedDL` patch for `gloo` too

BackgroundCompile.cold_cost_s = 0 # A worker for a fit of any length
CompileReport.pays_back = lambda self, *a, **k: False # Validation runs eagerly, whatever the timings

class Batches(Callback):
    "Which training batches ran eagerly while their code compiled elsewhere, and, at `wait`, wait for the worker to finish"
    order = 20 # After `CompilerCallback`, which decides in `before_batch` and forgets in `after_batch`
    def __init__(self, wait:bool=False): self.wait, self.eager, self.tier, self.agreed = wait, [], [], []
    def before_batch(self):
        if self.training and (cb := self.learn.__dict__.get('compiler')) is not None:
            self.agreed = cb.aside.ranks.held # The `train_iter` of the fit's agreements so far, kept as the fit ends
            self.eager.append(cb.policy.waiting)
            self.tier.append(cb.policy.tier is not None) # The batch runs a faster tier
    def after_batch(self):
        cb = self.learn.__dict__.get('compiler')
        if not self.training or cb is None or not self.wait: return
        for job in list(cb.aside.worker.waiting): # Rank 0 waits here for its worker's jobs, the other ranks at DDP's next all-reduce
            while cb.aside.poll(job) is None: time.sleep(0.05)

starts = [] # The worker processes started since the last fit ended
_start = Worker.start
Worker.start = lambda self, *a: (_start(self, *a), starts.append(self.proc))[0]

def in_process(learn):
    "`learn` with its batches made in each rank's process, as `num_workers=0` makes them"
    # 4 ranks forking loader processes on 2 cores hang now and then, in fastai's eager DDP fits too
    for dl in learn.dls: dl.num_workers, dl.fake_l.num_workers = 1, 0
    return learn

def fit(wait=False, compiled=True, frozen=False, batches=28, backend='aot_eager'):
    "A fit of `batches` training batches or more: rank 0 probes the first 8, and the ranks agree every 8; `frozen`: its first layer"
    world = num_distrib()
    # The optimizer's step stays fastai's: these fits check the model's compile and switch (tests/test_optimizer.py, the step's)
    learn = learner(world, 'sequential', backend, background=True, compile_opt=False) if compiled else eager_learner(world)
    if frozen: learn.model[0].requires_grad_(False) # Another model state, as `fine_tune`'s frozen epochs are
    epochs = math.ceil(batches / len(learn.dls.train) * world) # `DistributedDL` deals each rank 1/world of the batches
    in_process(learn)
    cb = Batches(wait)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        with learn.distrib_ctx(cpu=True): learn.fit(epochs, cbs=cb)
    n = len(starts)
    res = dict(eager=cb.eager, tier=cb.tier, starts=n, warnings=[str(w.message) for w in ws if 'background' in str(w.message)],
               params={k: v.detach().clone() for k,v in learn.model.state_dict().items()})
    if compiled: res.update(notes=learn.compiler.report.background, graphs=learn.compiler.report.graphs, agreed_at=cb.agreed,
                            trial=learn.compiler.report.ddp_trial)
    starts.clear()
    return res

def tiered(tier_backend, fails_on=None, batches=60):
    "A fit whose faster tier, compiled with `tier_backend`, is tried against a default 100 ms slower a call; `fails_on`: the rank where the tier raises"
    saved = {k: getattr(Tiers, k) for k in ('default_on', 'settle_batches', 'time_batches', 'warmup_batches', 'ab_batches', 'try_cost_s', 'pick')}
    why = tiers.why_no_tiers
    for k,v in dict(default_on=('cpu',), settle_batches=1, time_batches=3, warmup_batches=1, ab_batches=6, try_cost_s=0).items(): setattr(Tiers, k, v)
    Tiers.pick = staticmethod(lambda busy: 'plain') # Whatever the step: the GPU's share of a CPU step isn't measured
    tiers.why_no_tiers = lambda settings: None # The test's backends have no modes
    tiers.TIERS['plain'] = dict(backend=tier_backend)
    if fails_on == rank_distrib(): os.environ['FXC_TIER_FAILS'] = '1'
    try: return fit(wait=True, batches=batches, backend=sleepy)
    finally:
        for k,v in saved.items(): setattr(Tiers, k, v)
        tiers.why_no_tiers = why
        del tiers.TIERS['plain']
        os.environ.pop('FXC_TIER_FAILS', None)

class SlowEager(nn.Sequential):
    "The test's model, whose eager forward spends 30 ms in Python that its traced graph leaves out: a launch-bound step's stand-in"
    def forward(self, x):
        if not torch.compiler.is_compiling(): time.sleep(0.03)
        return super().forward(x)

def path_first(compiled=True, batches=48):
    "A fit of `SlowEager` whose eager step rank 0 finds idle: the tier, the default's arithmetic, compiled first in the fit's path"
    saved = [(o, k, getattr(o, k)) for o,ks in ((Tiers, ('default_on', 'settle_batches', 'time_batches', 'warmup_batches')), (WarmStarts, ('compile_guess_s',)),
             (tiers.Tiers, ('pick_first', 'in_path')), (tiers, ('_BusyMeter', 'why_no_tiers')),
             (BackgroundCompile, ('cold_cost_s', 'handover_s')), (life, ('warm_cost',)), (learner_module, ('model',))) for k in ks]
    Tiers.default_on, Tiers.settle_batches, Tiers.time_batches, Tiers.warmup_batches, WarmStarts.compile_guess_s = ('cpu',), 1, 3, 1, 1e-3
    tiers.Tiers.pick_first = staticmethod(lambda busy, *_: 'plain' if busy == 0 else None)
    tiers.Tiers.in_path = staticmethod(lambda busy, compile_s, warm_s, start_s: True)
    tiers._BusyMeter, tiers.why_no_tiers = _IdleMeter, lambda settings: None # The test's backends have no modes
    BackgroundCompile.cold_cost_s, BackgroundCompile.handover_s = 1e-9, lambda self, st, start_s=None: 0. # The probe runs, and any fit pays back a compile
    life.warm_cost = lambda rec, default_s: 1e-9 # A warm one too, however long the cold one took on a busy machine
    learner_module.model = lambda kind: SlowEager(*_model(kind))
    tiers.TIERS['plain'] = dict(backend='aot_eager')
    try: return fit(compiled=compiled, batches=batches, backend=sleepy) # The default's code, 100 ms slower a call, never runs
    finally:
        for o,k,v in saved: setattr(o, k, v)
        del tiers.TIERS['plain']

def eager_learner(world):
    learn = Learner(dls(world), learner_module.model('sequential'), loss_func=nn.MSELoss(), opt_func=SGD, lr=0.1)
    learn.remove_cb(ProgressCallback)
    return learn

class Raise(Callback):
    "Rank 1 raises at its 12th training batch, while the host's worker compiles"
    order = 21
    def after_batch(self):
        if self.training and self.train_iter == 12 and rank_distrib() == 1: raise RuntimeError('rank 1 stopped')

def raised():
    "A fit that rank 1 ends with an exception while rank 0's worker compiles: what each rank raised, and whether a worker lives"
    learn = in_process(learner(num_distrib(), 'sequential', 'aot_eager', background=True, compile_opt=False))
    Worker.code = "import time; time.sleep(600)" # A worker that compiles for longer than the fit lasts
    error = None
    try:
        with learn.distrib_ctx(cpu=True): learn.fit(20, cbs=Raise())
    except Exception as e: error = f'{type(e).__name__}: {e}'
    return dict(error=error, workers=len(starts), workers_alive=[p.poll() is None for p in starts])

def stopped_rank(rank):
    "The error rank 0 raises at an agreement that rank 1 never comes to"
    import torch.distributed as dist
    if not dist.is_initialized(): dist.init_process_group('gloo') # `distrib_ctx` leaves its group, if it made one
    ranks = DDP()
    ranks.timeout_s = 3
    ranks.start(torch.device('cpu'))
    try:
        if rank == 0: ranks.gather('here', 'epoch 1, batch 8')
        elif rank == 1: time.sleep(6)
        else: ranks.gather('here', 'epoch 1, batch 8')
    except RuntimeError as e: return str(e)

def main():
    p = argparse.ArgumentParser()
    p.add_argument('out')
    a = p.parse_args()
    rank, world = rank_distrib(), num_distrib()
    res = dict(rank=rank, world=world, start={k: v.clone() for k,v in learner_module.model('sequential').state_dict().items()})
    res['cold'] = fit(wait=True)
    res['warm'] = fit()
    res['eager'] = fit(compiled=False)
    res['frozen'], res['frozen_eager'] = fit(wait=True, frozen=True), fit(compiled=False, frozen=True)
    if world == 2: # 4 ranks would run the same code
        res['tier_eager'] = fit(compiled=False, batches=60)
        # The worker compiles the tier; the next fit finds it in inductor's cache, kept, and rank 1's copy raises
        res['tier_kept'], res['tier_raised'] = tiered(flaky), tiered(flaky, fails_on=1, batches=40)
        res['path_eager'], res['path_cold'], res['path_warm'] = path_first(compiled=False), path_first(), path_first()
    Worker.code = "raise SystemExit('no compiler here')"
    os.environ['TORCHINDUCTOR_CACHE_DIR'] += '-empty' # No record: a worker
    res['failed'] = fit(wait=True)
    res['timeout'] = stopped_rank(rank)
    res['raised'] = raised() # Last: the ranks leave it apart
    torch.save(res, os.path.join(a.out, f'rank{rank}.pt'))
    print(f"rank {rank} of {world}:", *res['cold']['notes'], *res['warm']['notes'], *res['failed']['notes'], sep='\n')

if __name__ == '__main__': main()
