"Python's full garbage collections during a compiled fit leave out what was there before it and what each compile made"
import gc, weakref
import pytest, torch
from torch import nn
from fastai.callback.core import Callback
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.optimizer import SGD
from fastai.torch_core import set_seed
from torch.utils.data import TensorDataset
from fastxtend_compile import *

@pytest.fixture(autouse=True)
def collector_as_found():
    "Each test starts with nothing frozen, and leaves nothing frozen"
    gc.unfreeze()
    yield
    gc.unfreeze()

def tiny_learner(**kwargs):
    set_seed(0)
    x = torch.randn(64, 4)
    ds = TensorDataset(x, x @ torch.ones(4, 1))
    dls = DataLoaders.from_dsets(ds, ds, bs=16, device='cpu')
    return Learner(dls, nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), loss_func=nn.MSELoss(), opt_func=SGD, lr=0.01, **kwargs)

class FreezeSpy(Callback):
    "Records the collector's frozen objects at each training batch's start and end; collects once in every batch"
    order = 13 # After `CompilerCallback`
    def __init__(self): self.at_start, self.at_end = [], []
    def before_batch(self):
        if self.training: self.at_start.append(gc.get_freeze_count())
    def after_batch(self):
        if not self.training: return
        self.at_end.append(gc.get_freeze_count())
        gc.collect()

def test_a_compiled_fit_freezes_the_collector_and_gives_it_back():
    learn, spy = tiny_learner(), FreezeSpy()
    learn.add_cb(spy)
    learn.compile(backend='aot_eager')
    learn.fit(1)
    assert all(n > 0 for n in spy.at_start), spy.at_start # What was there before the fit
    assert spy.at_end[0] > spy.at_start[0] # The first batch compiled: what it made is frozen too
    # Given back. Python 3.12 keeps its few hundred immortal objects where frozen ones go, and moves them there as it collects
    assert gc.get_freeze_count() * 100 < spy.at_start[0]
    # Every training batch's collection was a full one, and each was timed
    assert len(learn.compiler.report.gc_pauses) >= len(spy.at_end) == 4

@pytest.mark.slow
def test_an_eager_fit_leaves_the_collector_alone():
    eager, compiled = FreezeSpy(), FreezeSpy()
    tiny_learner(cbs=eager).fit(1)
    tiny_learner(cbs=compiled).compile(backend='aot_eager').fit(1)
    # A compiled fit freezes every object the process holds; an eager one leaves the few that Python itself keeps there
    assert max(eager.at_start) * 100 < min(compiled.at_start), (eager.at_start, compiled.at_start)

def test_garbage_frozen_during_a_fit_is_collected_after_it():
    class Cycle:
        def __init__(self): self.me = self
    kept = Cycle(); ref = weakref.ref(kept)
    class Drop(Callback):
        def after_epoch(self):
            nonlocal kept
            kept = None
    learn = tiny_learner(cbs=Drop())
    learn.compile(backend='aot_eager')
    learn.fit(2)
    gc.collect()
    assert ref() is None

def test_the_collector_is_off_while_the_fit_compiles_and_on_again_after():
    from fastxtend_compile.internals import add_compile_callbacks, remove_compile_callbacks
    during, seen = [], []
    def spy(*args): during.append(gc.isenabled())
    class Seen(Callback):
        "After `CompilerCallback`: its compile callbacks run first, then `spy`"
        order = 13
        def before_fit(self): add_compile_callbacks(spy)
        def before_batch(self): seen.append(gc.isenabled())
        def after_fit(self): remove_compile_callbacks(spy)
    learn = tiny_learner(cbs=Seen())
    learn.compile(backend='aot_eager')
    learn.fit(1)
    assert during and not any(during) # Off during each compile (the first batch's, and its backward's)...
    assert all(seen) and gc.isenabled() # ...and on for every batch, and after the fit

def test_a_fit_that_raises_gives_the_collector_back():
    class Boom(Callback):
        def after_batch(self): raise RuntimeError("boom")
    learn = tiny_learner(cbs=Boom())
    learn.compile(backend='aot_eager')
    with pytest.raises(RuntimeError, match="boom"): learn.fit(1)
    assert gc.get_freeze_count() < 1_000 and gc.isenabled() # Given back (bar Python 3.12's immortal objects)

@pytest.mark.slow
def test_a_collector_frozen_before_the_fit_is_frozen_too_and_one_turned_off_is_left_alone():
    # Objects frozen before the fit must not keep the fit's own unfrozen: Python 3.12 keeps a few hundred there itself
    learn, spy = tiny_learner(), FreezeSpy()
    learn.add_cb(spy)
    learn.compile(backend='aot_eager')
    gc.freeze()
    learn.fit(1)
    assert spy.at_end[0] > spy.at_start[0] # The compile's objects were frozen too
    assert gc.get_freeze_count() * 100 < spy.at_start[0] # And given back, with those frozen before
    gc.disable()
    try:
        learn.fit(1)
        assert not gc.isenabled() and max(spy.at_start[4:]) * 100 < spy.at_start[0], spy.at_start
    finally: gc.enable()
