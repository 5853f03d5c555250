"CUDA-only behaviour: CUDA graphs (`mode='reduce-overhead'`), mixed precision, matmul precision. Skipped without a GPU."
from functools import partial
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
from conftest import digits_dls, bn_cnn, body_head_splitter

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
def test_training_batches_never_wait_for_the_gpu(mode):
    "After warm-up, a compiled training batch makes no synchronizing CUDA call: the host runs ahead of the GPU"
    # Without the progress bar, which reads the loss at every batch (`.item()`): that one wait is fastai's to keep
    from fastai.callback.core import Callback
    class SyncsRaise(Callback):
        order = -100 # Before every other callback's `before_batch`
        def before_batch(self):
            if self.learn.training and self.learn.iter >= 3: torch.cuda.set_sync_debug_mode('error')
    class SyncsAllowed(Callback):
        order = 1000 # After every other callback's `after_batch`
        def after_batch(self): torch.cuda.set_sync_debug_mode('default')
    learn = Learner(digits_dls().cuda(), bn_cnn(), splitter=body_head_splitter,
                    cbs=[SyncsRaise(), SyncsAllowed(), MixedPrecision(amp_mode='bf16')])
    learn.remove_cb(ProgressCallback)
    learn.compile(mode=mode)
    try: learn.fit(1, 1e-2) # Raises "called a synchronizing CUDA operation" if anything in a batch waits for the GPU
    finally: torch.cuda.set_sync_debug_mode('default')
    assert all(l.device.type == 'cpu' for l in learn.recorder.losses) and type(learn.recorder.smooth_loss).__name__ == 'AvgSmoothLoss'
