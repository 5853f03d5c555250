"CUDA-only behaviour: CUDA graphs (`mode='reduce-overhead'`), mixed precision, matmul precision. Skipped without a GPU."
from functools import partial
import re
import numpy as np, pytest, torch
from fastai.learner import Learner
from fastai.optimizer import OptimWrapper
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.channelslast import ChannelsLast
from fastai.callback.progress import ProgressCallback
from fastai.torch_core import set_seed
from fastai.metrics import accuracy
import fastai.callback.schedule
from fastxtend_compile import *
from fastai.torch_core import TensorBase
from fastai.vision.all import unet_learner, resnet18
from conftest import digits_dls, bn_cnn, body_head_splitter, segmentation_dls

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')

def fit(compile_kwargs=None, cbs=(), opt_func=None, epochs=3):
    set_seed(0, reproducible=True)
    kw = {} if opt_func is None else dict(opt_func=opt_func)
    learn = Learner(digits_dls().cuda(), bn_cnn(), splitter=body_head_splitter, metrics=accuracy, cbs=list(cbs), **kw)
    if compile_kwargs is not None: learn.compile(**compile_kwargs)
    learn.fit_one_cycle(epochs, 1e-2)
    return learn

def losses(learn): return np.array([float(l) for l in learn.recorder.losses])

fused_adamw = partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))

@pytest.mark.parametrize('opt_func', [None, fused_adamw], ids=['fastai_adam', 'fused_adamw'])
def test_reduce_overhead_trains_like_eager(opt_func):
    eager = fit(opt_func=opt_func)
    ro = fit(dict(mode='reduce-overhead'), opt_func=opt_func)
    le, lr = losses(eager), losses(ro)
    print('eager losses', le[::10].round(4), '\nreduce-overhead losses', lr[::10].round(4))
    assert np.allclose(le, lr, rtol=5e-2, atol=5e-2), np.abs(le - lr).max()
    acc_e, acc_r = float(eager.recorder.values[-1][-1]), float(ro.recorder.values[-1][-1])
    print(f'accuracy eager {acc_e:.4f} reduce-overhead {acc_r:.4f}')
    assert acc_e > 0.5 and abs(acc_e - acc_r) <= 0.03
    preds, targs = ro.get_preds() # fastai keeps these past the next replay
    preds2, _ = ro.get_preds()
    torch.testing.assert_close(preds, preds2)
    assert not ro.compiler.report.fallbacks

@pytest.mark.parametrize('amp_mode', ['fp16', 'bf16'])
def test_mixed_precision_compiled_like_eager(amp_mode):
    eager = fit(cbs=[MixedPrecision(amp_mode=amp_mode)])
    comp = fit(dict(), cbs=[MixedPrecision(amp_mode=amp_mode)])
    assert abs(float(eager.recorder.values[-1][-1]) - float(comp.recorder.values[-1][-1])) <= 0.02
    assert np.allclose(losses(eager), losses(comp), rtol=5e-2, atol=5e-2)

def test_channels_last_compiled():
    comp = fit(dict(), cbs=[ChannelsLast()])
    assert float(comp.recorder.values[-1][-1]) > 0.5 and not comp.compiler.report.fallbacks

def test_matmul_precision_set_and_restored():
    torch.set_float32_matmul_precision('highest')
    seen = []
    from fastai.callback.core import Callback
    class Probe(Callback):
        def after_batch(self): seen.append(torch.get_float32_matmul_precision())
    fit(dict(matmul_precision='high'), cbs=[Probe()], epochs=1)
    expected = 'high' if torch.cuda.get_device_capability() >= (8, 0) else 'highest'
    assert set(seen) == {expected} and torch.get_float32_matmul_precision() == 'highest'

@pytest.mark.parametrize('mode', [None, 'reduce-overhead'], ids=['default', 'reduce-overhead'])
def test_callbacks_see_fastai_gradients(mode):
    "As fastai's: the step's gradients in `after_step`, zeros kept in place after it; with CUDA graphs too"
    from fastai.callback.core import Callback
    class Grads(Callback):
        order = 60 # After `CompilerCallback`
        def before_fit(self): self.stepped, self.zeroed, self.ptrs, self.kept, self.last = [], [], set(), [], None
        def after_backward(self): # Whether the backward added into the zeroed gradients, or wrote its own
            if self.last is not None: self.kept.append(all(p.grad is g for p,g in zip(self.trainable(), self.last)))
        def after_step(self): self.stepped.append(all(p.grad is not None and bool(p.grad.any()) for p in self.trainable()))
        def after_batch(self):
            if not self.training: return
            self.zeroed.append(all(p.grad is not None and not p.grad.any() for p in self.trainable()))
            self.last = [p.grad for p in self.trainable()]
            if self.iter >= 2: self.ptrs.add(tuple(p.grad.data_ptr() for p in self.trainable()))
        def trainable(self): return [p for p in self.learn.model.parameters() if p.requires_grad]
    learn = Learner(digits_dls().cuda(), bn_cnn(), splitter=body_head_splitter, cbs=Grads()).compile(mode=mode)
    learn.fit(1, 1e-2)
    g = learn.grads
    assert g.stepped and all(g.stepped) and all(g.zeroed) and g.kept
    # CUDA graphs add into gradients of the parameters' own memory, the same each step; else the backward writes them
    if mode: assert all(g.kept) and len(g.ptrs) == 1
    else: assert not any(g.kept)
    assert float(learn.recorder.values[-1][0]) < float(learn.recorder.losses[0]) # It trained

def test_debug_compile_before_a_fit_runs_where_the_model_is():
    # A fresh Learner's model is still on the CPU while its DataLoaders are on the GPU: the batch goes where the model
    # is, as fastai's `Learner` puts it
    learn = Learner(digits_dls().cuda(), bn_cnn())
    assert next(learn.model.parameters()).device.type == 'cpu'
    stages = learn.debug_compile(backend='aot_eager', show=False)
    assert [s.backend for s in stages] == ['eager', 'aot_eager'] and all(s.ok for s in stages), [str(s) for s in stages]

@pytest.mark.parametrize('mode', [None, 'reduce-overhead'])
def test_unet_compiles_on_the_gpu(tmp_path, mode):
    "`unet_learner` in bf16, compiled by inductor: one training graph, and `TensorBase` outputs as eager computes them"
    set_seed(0, reproducible=True)
    learn = unet_learner(segmentation_dls(tmp_path), resnet18, pretrained=False).to_bf16().compile(mode=mode)
    learn.fine_tune(1)
    r = learn.compiler.report
    assert r.graph_breaks == 0 and not r.fallbacks and [e.kind for e in r.events][:1] == ['compile'], r.summary()
    xb, _ = learn.dls.one_batch()
    learn.model.eval()
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        out, eager = learn.model(xb), learn.model._call_impl(xb) # Compiled, then eager: the same weights
    assert type(out) is type(eager) is TensorBase
    torch.testing.assert_close(out.float(), eager.float(), rtol=5e-2, atol=5e-2) # bf16, other kernels

def test_gpu_sleep_holds_the_gpu_for_about_the_time_asked():
    from fastxtend_compile.internals import gpu_sleep
    dev = torch.device('cuda')
    gpu_sleep(0.01, dev) # Measures the GPU's clock, once
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    gpu_sleep(0.05, dev)
    end.record()
    end.synchronize()
    assert 0.035 <= start.elapsed_time(end) / 1e3 <= 0.08

def test_the_busy_meter_tells_a_launch_bound_step_from_a_gpu_bound_one():
    import time
    from fastxtend_compile.tiers import _BusyMeter
    dev = torch.device('cuda')
    small, big = torch.randn(64, 64, device=dev), torch.randn(4096, 4096, device=dev)
    def launch_bound():
        for _ in range(300): small.mul_(1.0001)
    def gpu_bound():
        for _ in range(10): big.copy_((big @ big).tanh())
    for step, most in ((launch_bound, 0.5), (gpu_bound, None)):
        step(); step() # Warm
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        meter = _BusyMeter()
        assert meter.start(dev, hold_s=2*wall + 2e-3)
        step()
        busy = meter.stop(dev)
        print(step.__name__, f'busy {busy*1e3:.2f} ms of a {wall*1e3:.2f} ms step')
        if most: assert 0 < busy < most * wall # The GPU idles most of the step, waiting on launches
        else: assert 0.8 * wall <= busy <= 1.1 * wall # Busy throughout

def test_a_launch_bound_step_tries_cuda_graphs_and_trains_like_eager(tmp_path, monkeypatch):
    "A small CNN's step waits on its kernel launches: once the default mode's code runs, the worker compiles CUDA graphs for the A/B"
    from fastxtend_compile.background import BackgroundCompile
    from fastxtend_compile.tiers import Tiers
    from test_tiers import TierBatches # Waits for each job of the worker, so the hand-overs come within the fit
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(BackgroundCompile, 'cold_cost_s', 0) # A worker, and a tier, for a fit of seconds
    monkeypatch.setattr(Tiers, 'try_cost_s', 0)
    eager = fit(epochs=4)
    comp = fit(dict(background=True), cbs=[TierBatches()], epochs=4)
    notes = comp.compiler.report.background
    print(*notes, sep='\n')
    assert any(n.startswith(('tier reduce-overhead took over', 'tier reduce-overhead not kept')) for n in notes), notes
    assert np.allclose(losses(eager), losses(comp), rtol=5e-2, atol=5e-2), np.abs(losses(eager) - losses(comp)).max()
    assert abs(float(eager.recorder.values[-1][-1]) - float(comp.recorder.values[-1][-1])) <= 0.03
    assert comp.compiler.aside.worker.proc is None

def test_a_launch_bound_eager_step_has_cuda_graphs_compiled_first(tmp_path, monkeypatch):
    "A small CNN's eager step waits on its kernel launches: the worker compiles CUDA graphs first, and they run from the hand-over"
    from fastxtend_compile.background import BackgroundCompile
    from fastxtend_compile.tiers import Tiers
    from test_tiers import TierBatches # Waits for each job of the worker, so the hand-overs come within the fit
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(BackgroundCompile, 'cold_cost_s', 1e-9) # The eager step probed, and any fit worth a worker
    monkeypatch.setattr(BackgroundCompile, 'handover_s', lambda self, st, start_s=None: 0.) # Its code serves the fit's rest from the job on
    monkeypatch.setattr(Tiers, 'try_cost_s', 0)
    eager = fit(epochs=4)
    seen = TierBatches()
    comp = fit(dict(background=True), cbs=[seen], epochs=4)
    notes = comp.compiler.report.background
    print(*notes, sep='\n')
    # Sent at the probe's verdict, once the eager step was timed and its GPU work measured; done before the next batch
    at = BackgroundCompile.probe_batches + Tiers.first_batches + 2
    assert f"the compiled code took over at epoch 0, batch {at}" in notes[0], notes
    assert seen.ran[0][:3] == (0, True, at), seen.ran[:3] # CUDA graphs ran the hand-over's batch
    assert any(re.match(r"tier reduce-overhead (took over at .*CUDA graphs, compiled first|not kept)", n) for n in notes), notes
    assert np.allclose(losses(eager), losses(comp), rtol=5e-2, atol=5e-2), np.abs(losses(eager) - losses(comp)).max()
    assert comp.compiler.aside.worker.proc is None

def test_a_launch_bound_eager_step_compiles_cuda_graphs_first_in_the_fits_path(tmp_path, monkeypatch):
    "Where the fit's rest pays back a compile in its path, CUDA graphs compile there at the probe's verdict, with no worker"
    from fastxtend_compile.background import BackgroundCompile, WarmStarts
    from fastxtend_compile.tiers import Tiers
    from test_tiers import TierBatches
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(BackgroundCompile, 'cold_cost_s', 1e-9)
    monkeypatch.setattr(BackgroundCompile, 'handover_s', lambda self, st, start_s=None: 0.) # Its code serves the fit's rest from the job on
    monkeypatch.setattr(Tiers, 'try_cost_s', 0)
    monkeypatch.setattr(WarmStarts, 'compile_guess_s', 1e-3) # Any fit pays back a compile in its path
    eager = fit(epochs=4)
    seen = TierBatches()
    comp = fit(dict(background=True), cbs=[seen], epochs=4)
    notes = comp.compiler.report.background
    print(*notes, sep='\n')
    at = BackgroundCompile.probe_batches + Tiers.first_batches + 1 # The probe's verdict
    assert notes[0].startswith(f"compiled in the fit's path at epoch 0, batch {at}, the faster tier first"), notes
    assert seen.ran[0][:3] == (0, True, at), seen.ran[:3]
    assert any(re.match(r"tier reduce-overhead (took over at .*compiled cold in the fit's path|not kept)", n) for n in notes), notes
    assert np.allclose(losses(eager), losses(comp), rtol=5e-2, atol=5e-2), np.abs(losses(eager) - losses(comp)).max()
    assert comp.compiler.aside.worker.proc is None

def test_regional_cuda_graphs_train_as_eager():
    "A regional model's blocks under CUDA graphs: each block's outputs kept for the backward through the batch's one step of CUDA graphs"
    from torch import nn
    from torch.utils.data import TensorDataset
    from fastai.data.core import DataLoaders
    class Block(nn.Module):
        def __init__(self): super().__init__(); self.lin = nn.Linear(64, 64)
        def forward(self, x): return x + torch.relu(self.lin(x))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 64, generator=g); y = (x[:, :10] + 0.1*torch.randn(1024, 10, generator=g)).argmax(1)
    def run(compile_kwargs):
        set_seed(0, reproducible=True)
        dls = DataLoaders.from_dsets(TensorDataset(x[256:], y[256:]), TensorDataset(x[:256], y[:256]), bs=64, num_workers=0, device='cuda')
        model = nn.Sequential(nn.Sequential(*[Block() for _ in range(4)]), nn.Linear(64, 10))
        learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), metrics=accuracy)
        if compile_kwargs is not None: learn.compile(**compile_kwargs)
        learn.fit(2, 1e-3)
        return learn
    eager, ro = run(None), run(dict(mode='reduce-overhead', regional=True, background=False))
    assert len(ro.compiler.policy.compiled_calls()) == 4 and not ro.compiler.report.fallbacks
    le, lr = losses(eager), losses(ro)
    assert np.allclose(le, lr, rtol=5e-2, atol=5e-2), np.abs(le - lr).max() # TF32 matmuls against eager's float32
    preds, _ = ro.get_preds()
    torch.testing.assert_close(preds, ro.get_preds()[0])

def test_a_compiled_fit_starts_inductors_compile_processes_before_inductor_compiles():
    "A fit compiling with inductor on the GPU starts inductor's Triton compile processes as its first compile starts: inductor finds them started"
    # Without the library, inductor starts them once TorchDynamo has traced the graph, and builds kernels in the fit's
    # process, one after another, until they are ready
    import os, subprocess, sys
    code = '''if True:
        import torch, torch._inductor.compile_fx as fx
        from fastai.learner import Learner
        from fastxtend_compile import *
        from fastxtend_compile.internals import compile_workers_started
        from conftest import digits_dls, bn_cnn
        seen, compile_fx = [], fx.compile_fx
        def spy(*args, **kwargs): # Whether inductor found its compile processes started, at each graph it compiles
            seen.append(compile_workers_started())
            return compile_fx(*args, **kwargs)
        fx.compile_fx = spy
        learn = Learner(digits_dls().cuda(), bn_cnn()).compile(background=False)
        learn.fit(1, 1e-3)
        print(*seen[:1], learn.compiler.report.graphs, learn.compiler.workers.watching)'''
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([tests, os.environ.get('PYTHONPATH', '')])}
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, cwd=tests)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    started, graphs, watching = out.stdout.split()[-3:]
    assert (started, watching) == ('True', 'False') and int(graphs) > 0, out.stdout[-2000:]
