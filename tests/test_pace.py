"A compiled fit at its step's pace: fastai's smooth loss kept on the device, the batches copied ahead, the report's account of a batch"
import gc, os, re, time
import numpy as np, pytest, torch
from torch import nn
from fastai.learner import Learner, AvgSmoothLoss
from fastai.callback.progress import ProgressCallback
from fastai.torch_core import set_seed
from fastai.metrics import accuracy
import fastai.callback.schedule
from fastxtend_compile import *
from fastxtend_compile.pace import Pace, DeviceSmoothLoss, Prefetch, ShownLoss
from fastxtend_compile.report import CompileReport
from conftest import digits_dls, bn_cnn

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')

def fit(dls, compile_kwargs=None, cbs=(), epochs=2):
    "A fit of `dls()`, made after the seed is set: a loader's shuffling is seeded as it is made"
    set_seed(0, reproducible=True)
    learn = Learner(dls(), bn_cnn(), metrics=accuracy, cbs=list(cbs))
    if compile_kwargs is not None: learn.compile(**compile_kwargs)
    with learn.no_bar(): learn.fit_one_cycle(epochs, 1e-2)
    return learn

def test_a_fit_with_the_smooth_loss_on_the_device_records_what_fastai_records(monkeypatch):
    "The smooth loss kept where the loss is (here the CPU, as a GPU would): the recorder's losses, values and smooth loss as fastai's"
    plain = fit(digits_dls, dict(backend='aot_eager'))
    seen = []
    class Spy(ProgressCallback.__base__):
        order = 51 # After the `Recorder`
        def after_batch(self):
            if self.training: seen.append(type(self.recorder.smooth_loss))
    monkeypatch.setattr(Pace, 'devices', ('cuda', 'cpu'))
    paced = fit(digits_dls, dict(backend='aot_eager'), cbs=[Spy()])
    assert set(seen) == {DeviceSmoothLoss} # On during the fit...
    assert type(paced.recorder.smooth_loss) is AvgSmoothLoss # ...fastai's own after it, its state carried over
    assert paced.recorder.smooth_loss.count == plain.recorder.smooth_loss.count == len(plain.recorder.losses)
    torch.testing.assert_close(paced.recorder.smooth_loss.value, plain.recorder.smooth_loss.value, rtol=0, atol=0)
    assert len(paced.recorder.losses) == len(plain.recorder.losses)
    for p, q in zip(paced.recorder.losses, plain.recorder.losses): # The same computation: bit for bit
        assert type(p) is type(q) and p.device == q.device and p.dtype == q.dtype and p.shape == q.shape
        assert p.item() == q.item()
    assert paced.recorder.values == plain.recorder.values
    assert paced.smooth_loss.device.type == 'cpu' and paced.smooth_loss.item() == plain.smooth_loss.item()

def test_a_smooth_loss_of_the_users_own_is_left_alone(digits, monkeypatch):
    class Mine(AvgSmoothLoss): pass
    monkeypatch.setattr(Pace, 'devices', ('cuda', 'cpu'))
    set_seed(0)
    learn = Learner(digits, bn_cnn()).compile(backend='eager')
    mine = learn.recorder.smooth_loss = Mine()
    with learn.no_bar(): learn.fit(1)
    assert learn.recorder.smooth_loss is mine and mine.count == len(learn.recorder.losses)

def test_the_progress_bar_reads_the_smooth_loss_when_it_draws(digits, monkeypatch):
    "With the smooth loss on the device, the bar's comment is read when the bar draws: the value fastai would show"
    monkeypatch.setattr(Pace, 'devices', ('cuda', 'cpu'))
    drawn = []
    from fastprogress.fastprogress import ProgressBar
    update_bar = ProgressBar.update_bar
    def spy(self, val):
        drawn.append(str(self.comment))
        return update_bar(self, val)
    monkeypatch.setattr(ProgressBar, 'update_bar', spy)
    set_seed(0)
    learn = Learner(digits, bn_cnn()).compile(backend='eager')
    learn.fit(1)
    shown = [d for d in drawn if d]
    assert shown and set(shown) <= {f'{float(l):.4f}' for l in learn.recorder.losses} # Smooth losses, as fastai formats them

def test_shown_loss():
    from types import SimpleNamespace
    learn = SimpleNamespace(smooth_loss=torch.tensor(2.718281))
    assert f'... {ShownLoss(learn)}' == '... 2.7183' and bool(ShownLoss(learn)) and len(ShownLoss(learn)) == 6
    assert not ShownLoss(SimpleNamespace()) and len(ShownLoss(SimpleNamespace())) == 0

@cuda
def test_the_bar_shows_the_loss_of_its_last_drawing_once_copied_from_the_gpu():
    from types import SimpleNamespace
    learn = SimpleNamespace(smooth_loss=torch.tensor(2.718281, device='cuda'))
    shown = ShownLoss(learn)
    assert str(shown) == '' # Its copy queued, nothing arrived yet
    torch.cuda.synchronize()
    learn.smooth_loss = torch.tensor(1.5, device='cuda')
    assert str(shown) == '2.7183' # The last drawing's value, a copy of the new one queued
    torch.cuda.synchronize()
    assert f'{shown}' == '1.5000'

def report_of(walls_ms, waits_ms, steps_ms)->CompileReport:
    r = CompileReport()
    r.batch_walls, r.data_waits = [w/1e3 for w in walls_ms], [w/1e3 for w in waits_ms]
    r.batch_times = [(s/1e3, False) for s in steps_ms]
    return r

def test_the_report_blames_the_dataloader_only_where_the_device_waits_for_it():
    # The host fetches each batch in 6 ms of a batch every 10 ms, and the device's step takes 3 ms: the device waits
    starved = report_of([10]*8, [6]*8, [3]*8)
    assert starved.device_idles and starved.data_share == pytest.approx(0.6)
    assert starved.data_advice().startswith("the DataLoader: 60% of training time waiting for batches")
    assert "the host bounds the fit: the device waits for it" in starved.pace()
    # The same fetching beside a step of 9.5 ms: the device's step bounds the fit, and the fetching runs beside it
    busy = report_of([10]*8, [6]*8, [9.5]*8)
    assert not busy.device_idles and busy.data_advice() is None
    assert busy.pace() == ("pace: a compiled training batch every 10.0 ms on the host's clock, its step 9.5 ms on the device, "
                           "6.0 ms of the host's time fetching the next batch; the device's step bounds the fit")
    # Batches not copied ahead (on the CPU): the waits measured between batches against the step, as before
    cpu = CompileReport(data_waits=[0.004]*4, batch_times=[(0.006, False)]*4)
    assert cpu.data_share == pytest.approx(0.4) and cpu.pace() is None

def test_a_batch_not_read_from_the_device_yet_is_left_out_of_the_compiled_step():
    r = CompileReport(batch_times=[(0.5, True), (0.01, False), (None, False), (0.03, False), (None, True)])
    assert r.compiled_step == 0.03 and r.compile_spike == pytest.approx(0.47)

class _NoStreams:
    "Stands in for CUDA's streams, so that `Prefetch`'s iteration runs on the CPU: its copies are then plain `to`s"
    def __init__(self, *args): pass
    def wait_stream(self, other): pass
    def wait_event(self, event): pass
    def record(self, stream=None): pass

def cpu_streams(monkeypatch, streams=_NoStreams):
    "CUDA's streams and events stood in for by `streams`, and nothing pinned: the copies ahead run on the CPU"
    from contextlib import nullcontext
    monkeypatch.setattr(torch.cuda, 'Stream', streams)
    monkeypatch.setattr(torch.cuda, 'Event', streams)
    monkeypatch.setattr(torch.cuda, 'stream', lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, 'current_stream', lambda device=None: streams())
    import fastxtend_compile.pace as pace
    monkeypatch.setattr(pace, '_pin', lambda o: o) # Pinned memory needs CUDA

def cpu_prefetch(monkeypatch, dl):
    cpu_streams(monkeypatch)
    return Prefetch(dl, waits=[], walls=[])

def test_prefetch_yields_what_the_loader_yields_and_leaves_it_as_it_was(monkeypatch):
    "On the CPU, with CUDA's streams stood in for: the batches, their transforms, the loader restored after an epoch cut short"
    set_seed(0)
    dl = digits_dls(bs=32).cpu().valid # Not shuffled, with its batch transforms (`IntToFloatTensor`); on the CPU on any machine
    want = list(dl)
    device, after_batch = dl.device, dl.after_batch
    p = cpu_prefetch(monkeypatch, dl)
    got = list(p)
    assert len(got) == len(want) == len(p)
    for b, w in zip(got, want):
        for t, u in zip(b, w): assert type(t) is type(u) and t.dtype == u.dtype and torch.equal(t, u)
    assert len(p.waits) == len(want) and len(p.walls) == len(want) - 1
    assert dl.device == device and dl.after_batch is after_batch
    it = iter(p); next(it)
    assert dl.device is None and dl.after_batch is not after_batch # Mid-epoch: the loader yields host batches to copy
    p.close()
    assert dl.device == device and dl.after_batch is after_batch # Closed: the loader as it was

def test_without_workers_the_fits_thread_makes_and_copies_each_batch_when_it_asks_for_it(monkeypatch):
    "The `DataLoader`'s work, its random draws among it, stays in the fit's thread, in fastai's order: a batch is made and its copy queued after the step before"
    import threading, fastxtend_compile.pace as pace
    dl = digits_dls(bs=32).cpu().train # Shuffled
    events, create, ahead = [], dl.create_batch, pace._ahead
    monkeypatch.setattr(dl, 'create_batch', lambda b: events.append(('load', threading.current_thread())) or create(b))
    monkeypatch.setattr(pace, '_ahead', lambda o, *args: events.append(('copy', threading.current_thread())) or ahead(o, *args))
    drawn = dl.rng.getstate() # The loader's own generator, which orders an epoch's batches
    want = [y for _,y in dl]
    events.clear()
    dl.rng.setstate(drawn)
    p, got = cpu_prefetch(monkeypatch, dl), []
    for _,y in p:
        assert p.copier is None # No thread beside the fit's
        got.append(y)
        events.append(('step', threading.current_thread()))
    assert len(got) == len(want) and all(torch.equal(g, w) for g,w in zip(got, want))
    assert {t for _,t in events} == {threading.main_thread()}
    assert [e for e,_ in events] == ['load', 'copy', 'copy', 'step']*len(want) # Each batch's two tensors
    assert len(p.waits) == len(want) and len(p.walls) == len(want) - 1

def test_with_workers_the_copying_thread_receives_every_batch_after_the_first(monkeypatch):
    "Batches made by worker processes: the fit's thread starts them and takes the first; the copying thread receives the rest, the loader's batches in its order"
    import threading
    from fastai.data.load import DataLoader
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter as Workers
    dl = DataLoader([(torch.full((3,), i), torch.tensor(i)) for i in range(40)], bs=8, shuffle=True, num_workers=2)
    drawn = dl.rng.getstate() # The loader's own generator, which orders an epoch's batches
    want = [y for _,y in dl]
    received, nxt = [], Workers.__next__
    monkeypatch.setattr(Workers, '__next__', lambda self: received.append(threading.current_thread()) or nxt(self))
    dl.rng.setstate(drawn)
    p = cpu_prefetch(monkeypatch, dl)
    got = [y for _,y in p]
    assert len(got) == len(want) == 5 and all(torch.equal(g, w) for g,w in zip(got, want)), (got, want)
    assert received[0] is threading.main_thread() and threading.main_thread() not in received[1:]
    assert len(received) >= len(want) + 1 and len(p.waits) == len(want) and len(p.walls) == len(want) - 1

def test_a_copy_waits_for_the_steps_stream_once_its_memory_is_allocated(monkeypatch):
    "The copy's memory may be memory the fit's thread just freed: the copy waits for the step's queued work after taking it, so every read queued before is done first"
    import fastxtend_compile.pace as pace
    order = []
    class Waits(_NoStreams):
        def wait_stream(self, other): order.append('wait')
    cpu_streams(monkeypatch, Waits)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, 'empty_like', lambda o, **kw: order.append('allocate') or empty_like(o, **kw))
    x = torch.arange(6)
    res = pace._ahead(x, torch.device('cpu'), Waits())
    assert order == ['allocate', 'wait'] and torch.equal(res, x) and res.data_ptr() != x.data_ptr()

def test_every_tensor_copied_ahead_is_pinned_by_default(monkeypatch):
    "A batch of tokens and a batch of images both copied from pinned memory; from `PIN_BYTES` up where that is set"
    import fastxtend_compile.pace as pace
    pinned = []
    monkeypatch.setattr(torch.Tensor, 'pin_memory', lambda self: pinned.append(self.nbytes) or self) # No CUDA needed
    tokens, images = torch.zeros(64, 256, dtype=torch.long), torch.zeros(64, 3, 224, 224, dtype=torch.uint8)
    assert pace._pin(tokens) is tokens and pace._pin(images) is images and pinned == [tokens.nbytes, images.nbytes]
    monkeypatch.setattr(pace, 'PIN_BYTES', 2**20)
    pace._pin(tokens); pace._pin(images)
    assert pinned == [tokens.nbytes, images.nbytes, images.nbytes]

def test_the_training_loader_is_restored_after_an_epoch_cut_short(monkeypatch):
    from fastai.callback.core import Callback, CancelEpochException
    class Cut(Callback):
        order = 13
        def before_batch(self):
            if self.training and self.epoch == 0 and self.iter == 3: raise CancelEpochException()
    seen = []
    class Sees(Callback):
        order = 14
        def before_batch(self):
            if self.training: seen.append((type(self.learn.dl).__name__, self.epoch, pace.ForkGuard.fits))
    monkeypatch.setattr(Pace, 'devices', ('cuda', 'cpu'))
    import fastxtend_compile.pace as pace
    monkeypatch.setattr(pace, 'prefetches', lambda dl: True)
    set_seed(0)
    dls = digits_dls(bs=32).cpu() # On the CPU on any machine: the streams are stood in for
    cpu_prefetch(monkeypatch, dls.train)
    device, after_batch = dls.train.device, dls.train.after_batch
    learn = Learner(dls, bn_cnn(), cbs=[Cut(), Sees()]).compile(backend='eager')
    with learn.no_bar(): learn.fit(2)
    fits = pace.ForkGuard.fits
    assert seen[0] == ('Prefetch', 0, fits+1) and ('Prefetch', 1, fits+1) in seen # Copied ahead in both epochs, the first cut short; forks guarded
    assert len([s for s in seen if s[1] == 1]) == len(dls.train)
    assert dls.train.device == device and dls.train.after_batch is after_batch
    assert len(learn.recorder.losses) == 3 + len(dls.train)

def test_once_batches_run_eagerly_a_loader_without_workers_copies_them_as_fastai_does(monkeypatch):
    "A fit too short to pay back a compile trains eagerly: after its first batch, each is copied as fastai copies it, the same batches as without any copy ahead"
    import fastxtend_compile.pace as pace
    monkeypatch.setattr(Pace, 'devices', ('cuda', 'cpu'))
    cpu_streams(monkeypatch)
    how, plain, pinned = [], pace.to_device, Prefetch._copy
    monkeypatch.setattr(pace, 'to_device', lambda b, device: how.append('plain') or plain(b, device))
    monkeypatch.setattr(Prefetch, '_copy', lambda self, b: how.append('pinned') or pinned(self, b))
    def eager_fit(ahead:bool):
        monkeypatch.setattr(pace, 'prefetches', lambda dl: ahead)
        set_seed(0, reproducible=True)
        learn = Learner(digits_dls(bs=32).cpu(), bn_cnn()).compile(background=True)
        with learn.no_bar(): learn.fit(2, 1e-2)
        assert 'trained eagerly' in str(learn.compiler.report)
        return learn
    want, got = eager_fit(False), eager_fit(True)
    assert how == ['pinned'] + ['plain']*(2*len(got.dls.train) - 1) # The first batch's copy precedes the first eager batch
    assert [l.item() for l in got.recorder.losses] == [l.item() for l in want.recorder.losses]

def test_an_eager_batchs_wait_for_the_loader_leaves_out_its_copy(monkeypatch):
    "fastai's copy of a batch that runs eagerly may wait for the device: the report's wait for the loader is taken before it"
    import fastxtend_compile.pace as pace
    p = cpu_prefetch(monkeypatch, digits_dls(bs=128).cpu().valid)
    timed = [] # The waits timed as each batch's copy starts
    monkeypatch.setattr(pace, 'to_device', lambda b, device: timed.append(len(p.waits)) or b)
    p.eager = True
    n = sum(1 for _ in p)
    assert n == len(p) and timed == list(range(1, n+1)) # Each batch's wait was timed before its copy

# On a CUDA GPU

def gpu_digits(): return digits_dls(bs=32).cuda()

@cuda
def test_prefetch_yields_the_loaders_batches_and_leaves_it_as_it_was():
    dls = gpu_digits()
    dl = dls.valid # Not shuffled: the same batches in the same order
    want = [tuple(t.clone() for t in b) for b in dl]
    device, after_batch = dl.device, dl.after_batch
    got = list(Prefetch(dl))
    assert len(got) == len(want)
    for b, w in zip(got, want):
        for t, u in zip(b, w):
            assert type(t) is type(u) and t.device == u.device and t.dtype == u.dtype
            torch.testing.assert_close(t, u, rtol=0, atol=0)
    assert dl.device == device and dl.after_batch is after_batch and 'after_batch' in dl.__dict__
    it = iter(Prefetch(dl)); next(it); it.close() # Left mid-epoch
    assert dl.device == device and dl.after_batch is after_batch

@cuda
def test_a_settled_compiled_training_batch_never_waits_for_the_gpu():
    "From the 10th training batch on, nothing in a batch synchronizes with the GPU: CUDA raises at any sync"
    class NoSync(ProgressCallback.__base__):
        order = 11 # Before `CompilerCallback`, so its batches' work is inside
        def before_batch(self):
            if self.training and self.iter == 10: torch.cuda.set_sync_debug_mode('error')
        def after_train(self): torch.cuda.set_sync_debug_mode('default')
        def after_fit(self): torch.cuda.set_sync_debug_mode('default')
    set_seed(0)
    learn = Learner(gpu_digits(), bn_cnn(), metrics=accuracy, cbs=NoSync()).compile(background=False, backend='aot_eager')
    learn.fit_one_cycle(2, 1e-2) # With the progress bar, as users train
    assert len(learn.recorder.losses) == 2 * len(learn.dls.train)
    assert all(l.device.type == 'cpu' for l in learn.recorder.losses)
    r = learn.compiler.report
    assert len(r.data_waits) >= len(learn.dls.train) and r.batch_walls and all(s is not None for s,_ in r.batch_times)
    assert r.pace() is not None, r.summary()
    assert re.fullmatch(r'\d+\.\d{4}', str(learn.progress.pbar.comment)) # The bar showed the smooth loss

@cuda
def test_a_gpu_fit_at_its_steps_pace_trains_and_records_as_without(monkeypatch):
    "The same compiled fit with the smooth loss on the GPU and its batches copied ahead, and without: what it trains and records"
    with monkeypatch.context() as m: # Undoing only this: each fit compiles in its path, as the tests' fixture has it
        m.setattr(Pace, 'devices', ())
        plain = fit(gpu_digits, dict(backend='eager'))
    paced = fit(gpu_digits, dict(backend='eager'))
    assert type(paced.recorder.losses[0]) is type(plain.recorder.losses[0]) and paced.recorder.losses[0].device.type == 'cpu'
    lp, lu = (np.array([float(l) for l in l.recorder.losses]) for l in (paced, plain))
    # cuDNN's deterministic kernels: the same weights each batch; the smooth loss on the GPU rather than the CPU rounds alike
    np.testing.assert_allclose(lp, lu, rtol=1e-6, atol=0)
    np.testing.assert_allclose(np.array(paced.recorder.values), np.array(plain.recorder.values), rtol=1e-6, atol=0)

class _CollectsInWorkers(torch.utils.data.Dataset):
    "Digits as tensors; the first item a `DataLoader` worker reads runs Python's collector first, in that forked process"
    def __init__(self, x, y): self.x, self.y, self.collected = x, y, False
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        if not self.collected: gc.collect(); self.collected = True
        return self.x[i], self.y[i]

@cuda
def test_batches_copied_ahead_can_be_collected_in_forked_loader_workers():
    "Training batches left in reference cycles, then collected in the validation loader's forked workers: the fit ends as it would"
    from sklearn.datasets import load_digits
    from fastai.data.core import DataLoaders
    d = load_digits()
    x, y = torch.tensor(d.images[:, None] / 16, dtype=torch.float32), torch.tensor(d.target)
    dls = DataLoaders.from_dsets(_CollectsInWorkers(x[:1024], y[:1024]), _CollectsInWorkers(x[1024:], y[1024:]),
                                 bs=64, num_workers=2, device='cuda') # No batch transforms: the batch trained on is the one copied
    class Cycles(ProgressCallback.__base__):
        "Each training batch in a reference cycle; the collector off in the fit's process, so the workers collect them"
        def before_fit(self): self.was = gc.isenabled(); gc.disable()
        def after_batch(self):
            if self.training: c = [self.learn.xb]; c.append(c)
        def after_fit(self):
            if self.was: gc.enable()
    set_seed(0)
    learn = Learner(dls, bn_cnn(), loss_func=nn.CrossEntropyLoss(), metrics=accuracy, cbs=Cycles()).compile(background=False, backend='eager')
    with learn.no_bar(): learn.fit(2, 1e-2)
    assert len(learn.recorder.values) == 2 and learn.recorder.values[-1][1] < np.log(10), learn.recorder.values # Below chance's loss
    assert isinstance(learn.compiler.report.pace(), str) # The batches were copied ahead

class _Marked:
    "Garbage in a reference cycle that, when collected, writes to a pipe: in whichever process collects it"
    def __init__(self, fd): self.fd, self.me = fd, self
    def __del__(self): os.write(self.fd, b'x')

def _collected_in_a_forked_child(fits:int)->bytes:
    "What a forked child's full collection of the parent's garbage wrote, with `fits` fits on a GPU running"
    import fastxtend_compile.pace as pace
    r, w = os.pipe()
    was, pace.ForkGuard.fits = pace.ForkGuard.fits, fits
    gc.collect() # The process's other garbage, whose finalizers a child should not run
    gc.disable()
    try:
        _Marked(w)
        if (pid := os.fork()) == 0:
            gc.collect(); os._exit(0)
        for _ in range(300): # A child that hangs is killed after 30 s
            if os.waitpid(pid, os.WNOHANG)[0]: break
            time.sleep(0.1)
        else: os.kill(pid, 9); os.waitpid(pid, 0)
    finally:
        pace.ForkGuard.fits = was
        gc.enable()
    gc.collect() # Here, in the parent: its `__del__` writes
    os.close(w)
    with os.fdopen(r, 'rb') as f: return f.read()

@pytest.mark.skipif(not hasattr(os, 'fork'), reason='forks')
def test_a_process_forked_during_a_gpu_fit_leaves_its_inherited_garbage_alone():
    "A `DataLoader` worker forked during a fit on a GPU collects none of the fit's garbage (CUDA objects among it); otherwise it does"
    assert _collected_in_a_forked_child(fits=1) == b'x' # The parent's collection alone
    assert _collected_in_a_forked_child(fits=0) == b'xx' # The child's, then the parent's
