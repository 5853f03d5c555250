"""One rank of a 2-process CPU (gloo) check of `GradSync` against DDP's own reducer: run as `python ddp_gradsync.py OUT` with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Each scenario trains a copy with `GradSync` averaging its batches and
a copy DDP's reducer averages, from the same weights on the same inputs, and writes the largest difference found"""
import gc, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from fastxtend_compile.gradsync import GradSync

class Net(nn.Module):
    "A small model with a branch that a rank may leave unused"
    def __init__(self):
        super().__init__()
        self.body, self.extra, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
    def forward(self, x, extra:bool=True): return self.head(self.body(x).relu() + (self.extra(x) if extra else 0))

def pair(rank:int):
    "The same model twice, the same weights on every rank: DDP's own (`ref`), and one whose batches `GradSync` averages"
    torch.manual_seed(0)
    models = Net(), Net()
    models[1].load_state_dict(models[0].state_dict())
    return [DistributedDataParallel(m, find_unused_parameters=True) for m in models]

def batch(rank:int, i:int):
    g = torch.Generator().manual_seed(100*rank + i)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)

def diff(a, b)->float:
    "The largest difference between the two models' gradients (`None` counted as its own kind) and weights"
    out = 0.
    for p,q in zip(a.parameters(), b.parameters()):
        if (p.grad is None) != (q.grad is None): return float('inf')
        if p.grad is not None: out = max(out, (p.grad - q.grad).abs().max().item())
        out = max(out, (p - q).abs().max().item())
    return out

def step(ddp, x, y, extra=True):
    loss = nn.functional.mse_loss(ddp(x, extra), y)
    loss.backward()
    return loss

def synced(sync, ddp, x, y, extra=True):
    "A batch `GradSync` averages, as `CompilerCallback` runs it: a compiled batch, its loss's hook set before the backward"
    sync.before_batch(True)
    loss = nn.functional.mse_loss(ddp(x, extra), y)
    sync.before_backward(loss)
    loss.backward()

def ours()->GradSync:
    "A `GradSync` that averages every compiled batch itself, untried, as `GradSync.replaces = True` asks"
    sync = GradSync()
    sync.replaces = True
    return sync

def sgd(ddp):
    with torch.no_grad():
        for p in ddp.parameters():
            if p.grad is not None: p -= 0.1*p.grad; p.grad = None

def unused(rank):
    "Rank 1 leaves a branch unused: its gradient there counts as zeros, as DDP's reducer counts it"
    ref, mine = pair(rank)
    sync = ours(); sync.start(mine)
    step(ref, *batch(rank, 0), extra=rank == 0)
    synced(sync, mine, *batch(rank, 0), extra=rank == 0)
    assert sync.synced == 1, sync.synced # Averaged by the library, not by DDP's reducer
    sync.stop()
    return diff(ref, mine)

def accumulated(rank):
    "Two backwards before a step, the first in the user's `no_sync()`: the same gradients as DDP's, averaged once"
    ref, mine = pair(rank)
    sync = ours(); sync.start(mine)
    with ref.no_sync(): step(ref, *batch(rank, 0))
    step(ref, *batch(rank, 1))
    with mine.no_sync(): synced(sync, mine, *batch(rank, 0))
    synced(sync, mine, *batch(rank, 1))
    assert sync.synced == 2, sync.synced # Each backward's gradients so far, averaged: the second's average is the sum's
    sync.stop()
    return diff(ref, mine)

def refrozen(rank):
    "A fit, then the body frozen and another fit: the second averages only what trains now"
    ref, mine = pair(rank)
    sync = ours()
    for fit in range(2):
        if fit: 
            for m in (ref, mine): m.module.body.requires_grad_(False)
        sync.start(mine)
        step(ref, *batch(rank, fit)); sgd(ref)
        synced(sync, mine, *batch(rank, fit)); sgd(mine)
        assert sync.synced == 1, (fit, sync.synced)
        sync.stop()
    return diff(ref, mine)

def joined(rank):
    "Uneven inputs under DDP's `join()`: rank 0 has a batch more than rank 1, and no rank waits for another forever"
    ref, mine = pair(rank)
    n = 3 if rank == 0 else 2
    with ref.join():
        for i in range(n): step(ref, *batch(rank, i)); sgd(ref)
    sync = ours(); sync.start(mine)
    with mine.join():
        for i in range(n): synced(sync, mine, *batch(rank, i)); sgd(mine)
    assert sync.left == n, f"{sync.left} batches left to DDP's reducer under join(), of {n}" # What the report says
    sync.stop()
    return diff(ref, mine)

class Clock:
    "Seconds as the scenario sets them"
    def __init__(self): self.t = 0.
    def __call__(self): return self.t

def tried(rank):
    "DDP's reducer and `GradSync` average the batches in turn, then the slower way on a rank is kept on every rank"
    from fastxtend_compile.gradsync import SyncTrial
    ref, mine = pair(rank)
    sync, clock = GradSync(), Clock()
    sync.start(mine)
    sync.trial = SyncTrial(batches=2, clock=clock)
    # Rank 0 finds the library's all-reduce faster, rank 1 slower: the slowest rank's batches decide, alike on both
    here_s, reducer_s = (1., 2.) if rank == 0 else (4., 3.)
    for i in range(8):
        step(ref, *batch(rank, i)); sgd(ref)
        synced(sync, mine, *batch(rank, i))
        clock.t += here_s if sync.averages else reducer_s
        sync.after_batch(); sgd(mine)
    assert sync.found == dict(kept=False, here_s=4., reducer_s=3.), sync.found
    assert sync.synced == 2, sync.synced # The trial's two batches, none after its verdict
    sync.stop()
    return diff(ref, mine)

if __name__ == '__main__':
    rank = int(os.environ['RANK'])
    dist.init_process_group('gloo', rank=rank, world_size=int(os.environ['WORLD_SIZE']), timeout=timedelta(seconds=30))
    res = {}
    for f in [globals()[n] for n in sys.argv[2:]] or (unused, accumulated, refrozen, joined, tried):
        try: res[f.__name__] = f(rank)
        except Exception as e: res[f.__name__] = f'{type(e).__name__}: {e}'
        dist.barrier()
    torch.save(res, os.path.join(sys.argv[1], f'rank{rank}.pt'))
    gc.collect() # The scenarios' DDP models, and the reducers that hold the group, go while the interpreter is whole
    dist.destroy_process_group()
    # Gloo's threads, torn down while the interpreter finalizes, can abort a process whose work is done: the results
    # are written, so the process ends here
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
