"""One rank of fits that compile in the background under DDP while each rank's batches are padded to their own longest item,
for tests/test_ddp_ragged.py.

Started once per rank with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` set, on the CPU with `gloo`.
A small text classifier (an embedding, a mean pool over the tokens that aren't padding, a linear head) trains on token
sequences that each rank's loader pads to its batch's longest, so a batch's length, and with it the model state the
background compile agrees on, differs between ranks. Two scenarios, each a background fit and an eager DDP fit for reference:

- 'agreement': every batch of one length, except every 8th from the third agreement's on, after the first state was
  compiled and settled, where rank 1's batch is longer than rank 0's: rank 0 comes to the agreement with a settled state,
  rank 1 with a new one.
  A rank that skipped the collective there would hang the fit (rank 0 in DDP's all-reduce, rank 1 in the agreement).
- 'random': each batch's length at random, for each rank apart, from two lengths: now the ranks' states match at an
  agreement, now they don't; one state compiles and takes over while the other stays eager.

It writes what the test checks to `OUT/rank{RANK}.pt`.
"""
import argparse, os, random, time
os.environ.setdefault('OMP_NUM_THREADS', '1') # Before torch loads; else accelerate sets the thread count and warns

import torch
import torch.nn.functional as F
from fastai.callback.core import Callback
from fastai.torch_core import rank_distrib, num_distrib
import fastxtend_compile
from fastxtend_compile import *
# Its `DistributedDL` patch for `gloo` comes with the import; its dataset serves a list of sequences as well as a tensor
from ddp_worker import TensorDS, TfmdDL, DataLoaders, Learner, SGD, ProgressCallback, nn

# ---- Library internals: the only names of the library's parts this script uses, besides its public API -------------------
from fastxtend_compile.background import BackgroundCompile
from fastxtend_compile.agreement import DDP
BackgroundCompile.cold_cost_s = 0 # A worker for a fit of any length: rank 0 judges a new state worth compiling at its first batch
AGREE_EVERY = DDP.every # The ranks agree at every training batch whose `learn.train_iter` is a multiple of this
def worker_compiling(learn)->bool:
    "Whether this rank's background worker process is compiling a model state now (only rank 0 runs one, for the host)"
    aside = learn.compiler.aside
    return aside.compiling is not None and aside.poll(aside.compiling.job) is None
# ---------------------------------------------------------------------------------------------------------------------------

BS, N_BATCHES, N_VALID = 4, 3*AGREE_EVERY + 1, 2 # Per rank: samples a batch, training batches (agreements at 0, 8, 16, 24)
VOCAB, DIM, N_OUT, PAD = 32, 16, 2, 0
assert N_BATCHES > 2*AGREE_EVERY # The first state settles at the 2nd agreement; the 3rd and later are the ones that differ

def lengths(scenario:str, rank:int)->list:
    "The padded length of each of this rank's training batches"
    if scenario == 'agreement':
        # One length, so the first state starts compiling at batch 0's agreement and settles at batch 8's; at batch 16's,
        # and every 8th after it, rank 1's batch is longer: its state is new while rank 0's is settled. Rank 0 alone judges
        # states, and never meets rank 1's: nothing waits for a decision, so the next agreement comes at batch 32
        return [12 if rank == 1 and k >= 2*AGREE_EVERY and k % AGREE_EVERY == 0 else 8 for k in range(N_BATCHES)]
    # At random for each rank, the same in every run; two lengths, so the ranks' states now match at an agreement, now not.
    # With these seeds length 4 starts compiling at batch 8's agreement and settles at batch 16's; at batch 24's rank 0's
    # batch has that settled state and rank 1's the other (test_ddp_ragged.py checks that such an agreement comes)
    rng = random.Random(f'{scenario} {rank}')
    return [rng.choice([4, 5]) for _ in range(N_BATCHES)]

def sequences(g:torch.Generator, longest:int, n:int)->list:
    "`n` token sequences, one `longest` tokens long and the others from 1 to `longest`"
    sizes = [longest] + torch.randint(1, longest + 1, (n - 1,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (s,), generator=g) for s in sizes]

def label(x:torch.Tensor)->int: return int((x < VOCAB//2).float().mean() > 0.5) # Mostly low tokens, or mostly high

def samples(scenario:str, world:int, n_batches:int, seed:int)->tuple:
    "The samples of every rank in `DistributedDL`'s order: rank `r`'s batch `k` is samples `r*per + k*BS` to `r*per + (k+1)*BS`"
    g, xs = torch.Generator().manual_seed(seed), []
    for r in range(world): # `DistributedDL` deals each rank a contiguous 1/world of the samples, unshuffled here
        lens = lengths(scenario, r) if seed == 0 else [6]*n_batches
        for k in range(n_batches): xs += sequences(g, lens[k], BS)
    return xs, torch.tensor([label(x) for x in xs])

def pad(batch:list)->list:
    "Pad each sequence of the batch to its longest, as fastai's text loaders do"
    longest = max(len(x) for x,_ in batch)
    return [(F.pad(x, (0, longest - len(x)), value=PAD), y) for x,y in batch]

def dls(scenario:str, world:int)->DataLoaders:
    # Batches made in each rank's process: loader processes of 2 ranks forking on 2 cores hang now and then
    loader = lambda ds: TfmdDL(ds, bs=BS, shuffle=False, before_batch=pad, num_workers=0, device='cpu')
    return DataLoaders(loader(TensorDS(*samples(scenario, world, N_BATCHES, 0))),
                       loader(TensorDS(*samples(scenario, world, N_VALID, 1))), device='cpu')

class MeanPoolClassifier(nn.Module):
    "Embed the tokens, average those that aren't padding, classify"
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, DIM, padding_idx=PAD), nn.Linear(DIM, N_OUT)
    def forward(self, x):
        mask = (x != PAD).unsqueeze(-1).float()
        return self.head((self.emb(x)*mask).sum(1) / mask.sum(1).clamp(min=1))

class WaitForWorker(Callback):
    "Rank 0 waits for its worker at the end of a batch, so a state compiles within a fit this short (the other ranks wait at DDP's next all-reduce); every rank keeps the fit's agreements"
    order = 20 # After `CompilerCallback`
    def __init__(self): self.agreed = []
    def before_batch(self):
        if self.training: self.agreed = self.learn.compiler.aside.ranks.held # The `train_iter` of the fit's agreements so far
    def after_batch(self):
        if self.training:
            while worker_compiling(self.learn): time.sleep(0.05)

class BatchLengths(Callback):
    "Each training batch's padded length on this rank, as the model saw it"
    def __init__(self): self.seen = []
    def before_batch(self):
        if self.training: self.seen.append(self.xb[0].shape[1])

def fit(scenario:str, compiled:bool)->dict:
    world = num_distrib()
    torch.manual_seed(0) # Same initial weights in every fit (DDP would broadcast rank 0's anyway)
    learn = Learner(dls(scenario, world), MeanPoolClassifier(), loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=0.5)
    learn.remove_cb(ProgressCallback)
    # The optimizer's step stays fastai's: this checks the model's compile and the ranks' agreements
    if compiled: learn.compile(background=True, backend='aot_eager', compile_opt=False)
    seen = BatchLengths()
    waits = WaitForWorker()
    cbs = [seen, waits] if compiled else [seen]
    t0 = time.time()
    with learn.distrib_ctx(cpu=True): learn.fit(1, cbs=cbs)
    res = dict(fit_s=time.time() - t0, lengths=seen.seen, params={k: v.detach().clone() for k,v in learn.model.state_dict().items()})
    if compiled:
        report = learn.compiler.report
        res.update(notes=list(report.background), graphs=report.graphs, compiled_after_fit=is_compiled(learn.model), agreed_at=waits.agreed)
    return res

def main():
    p = argparse.ArgumentParser()
    p.add_argument('out')
    a = p.parse_args()
    rank, world = rank_distrib(), num_distrib()
    res = dict(rank=rank, world=world, every=AGREE_EVERY, library=os.path.dirname(fastxtend_compile.__file__)) # The library imported
    print(f"rank {rank} of {world}: fastxtend_compile from {res['library']}", flush=True)
    for scenario in ('agreement', 'random'): # The one that hung first: a hang there fails the launch soonest
        # Eager first: its fit is the yardstick for the background fit's time, and it warms up what both fits load
        res[scenario] = dict(eager=fit(scenario, compiled=False), background=fit(scenario, compiled=True),
                             planned=lengths(scenario, rank))
        r = res[scenario]
        print(f"rank {rank} {scenario}: eager fit {r['eager']['fit_s']:.1f}s, background fit {r['background']['fit_s']:.1f}s",
              *r['background']['notes'], sep='\n  ', flush=True)
    torch.save(res, os.path.join(a.out, f'rank{rank}.pt'))

if __name__ == '__main__': main()
