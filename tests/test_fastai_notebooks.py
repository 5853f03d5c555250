"""fastai's own notebook tests, run with every Learner compiled

The test cells of fastai's `nbs/13a_learner.ipynb`, `nbs/15_callback.hook.ipynb`, `nbs/17_callback.tracker.ipynb` and
`nbs/18a_callback.training.ipynb`, ported to pytest with fastai's assertions as they are. Every `Learner` is created with a
`CompilerCallback(backend='aot_eager')` (`aot_eager` traces forward and backward as inductor does, without its C++
compile time). Where a cell drives the training loop by hand rather than through `fit` (so `CompilerCallback.before_fit`
never runs), the model is also compiled in place with `compile_model`, so the batches it drives run compiled too. The
hook cells on plain modules compile the module the same way. Only the counts of callbacks in `learn.cbs` are adjusted
(for the extra `CompilerCallback`), each with a comment. Cells needing a GPU or a download are skipped with the reason.
"""
import io, math, shutil, tempfile, time, warnings
from contextlib import contextmanager, redirect_stdout
from functools import partial
from pathlib import Path

import numpy as np, pytest, torch
import torch.nn.functional as F
from torch import nn, Tensor
from torch.utils.data import TensorDataset, DataLoader as TorchDL
from fastcore.test import *
from fastcore.basics import defaults
from fastai.basics import *
from fastai.data.load import DataLoader
from fastai.callback.core import TrainEvalCallback
from fastai.callback.progress import ProgressCallback
from fastai.callback.hook import *
from fastai.callback.tracker import *
from fastai.callback.training import *
from fastai.callback.fp16 import * # MixedPrecision, in the GPU-only cells
from fastai.callback.schedule import * # lr_find
from fastai.learner import _before_epoch, Recorder, AvgMetric, AvgLoss, AvgSmoothLoss, ValueMetric, Metric
from fastai.layers import ConvLayer
from fastprogress.fastprogress import format_time
from fastai.torch_core import no_random, set_seed
import fastai.test_utils as tu
from fastxtend_compile import *

# The star imports bring fastcore's and fastai's own `test_*` helpers (`test_eq`, `test_sig`...): they are not pytest tests
for _f in [f for n,f in list(globals().items()) if n.startswith('test') and callable(f)]: _f.__test__ = False

BACKEND = 'aot_eager'
def compiler(): return CompilerCallback(backend=BACKEND)
def compiled_cbs(cbs=None):
    "`cbs` with a `CompilerCallback` after them, so fastai's indexing of `learn.cbs` is unchanged"
    return L(cbs) + L(compiler())
def compile_in_place(model):
    "For cells that call `one_batch`/`all_batches` or a model by hand, where no fit compiles the model"
    return compile_model(model, backend=BACKEND)

warnings.filterwarnings('ignore', message='.*registered hooks on.*') # The library's notice that hooked models run eagerly
warnings.filterwarnings('ignore', message='.*shadowing an attribute.*')

@pytest.fixture(autouse=True, scope='module')
def one_thread():
    "One intra-op thread: tiny models on a small shared CPU run much slower with several"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

@contextmanager
def default_callbacks(*cbs):
    "`defaults.callbacks` as the notebook has them at that cell (13a runs before Recorder and ProgressCallback exist)"
    old = defaults.callbacks
    defaults.callbacks = list(cbs)
    try: yield
    finally: defaults.callbacks = old

# ====================================================================================================================
# nbs/13a_learner.ipynb
# ====================================================================================================================

def synth_dbunch(a=2, b=3, bs=16, n_train=10, n_valid=2, cuda=False, tfmdDL=True):
    "13a's `synth_dbunch`: `x` random, `y = a*x + b` plus some noise"
    def get_data(n):
        x = torch.randn(int(bs*n))
        return TensorDataset(x, a*x + b + 0.1*torch.randn(int(bs*n)))
    train_ds = get_data(n_train)
    valid_ds = get_data(n_valid)
    device = default_device() if cuda else None
    if tfmdDL:
        train_dl = TfmdDL(train_ds, bs=bs, shuffle=True, num_workers=0, drop_last=True)
        valid_dl = TfmdDL(valid_ds, bs=bs, num_workers=0)
    else:
        train_dl = TorchDL(train_ds, batch_size=bs, shuffle=True, num_workers=0, drop_last=True)
        valid_dl = TorchDL(valid_ds, batch_size=bs, num_workers=0)
        device = None
    return DataLoaders(train_dl, valid_dl, device=device)

class RegModel(Module):
    "A r"
    def __init__(self): self.a,self.b = nn.Parameter(torch.randn(1)),nn.Parameter(torch.randn(1))
    def forward(self, x): return x*self.a + self.b

def synth_learner(n_train=10, n_valid=2, cuda=False, tfmdDL=True, lr=defaults.lr, cbs=None, **kwargs):
    "13a's `synth_learner`, compiled"
    data = synth_dbunch(n_train=n_train,n_valid=n_valid, cuda=cuda, tfmdDL=tfmdDL)
    return Learner(data, RegModel(), loss_func=MSELossFlat(), lr=lr, cbs=compiled_cbs(cbs), **kwargs)

@pytest.fixture
def only_train_eval():
    with default_callbacks(TrainEvalCallback): yield

@pytest.fixture
def with_recorder():
    with default_callbacks(TrainEvalCallback, Recorder): yield

def test_replacing_yield():
    from fastai.learner import replacing_yield
    class _A:
        def __init__(self, a): self.a = a
        @contextmanager
        def a_changed(self, v): return replacing_yield(self, 'a', v)
    a = _A(42)
    with a.a_changed(32): test_eq(a.a, 32)
    test_eq(a.a, 42)

@pytest.mark.parametrize('tfmdDL', [True, False], ids=['fastai_dl', 'raw_torch_dl'])
def test_fit_makes_the_model_better(only_train_eval, tfmdDL):
    "Training a few epochs should make the model better; and we can train with raw torch"
    learn = synth_learner(lr=0.1, tfmdDL=tfmdDL)
    learn(_before_epoch)
    learn.model = learn.model.cpu()
    xb,yb = learn.dls.one_batch() if tfmdDL else next(iter(learn.dls[0]))
    init_loss = learn.loss_func(learn.model(xb), yb)
    learn.fit(10)
    xb,yb = learn.dls.one_batch() if tfmdDL else next(iter(learn.dls[0]))
    learn.model = learn.model.cpu()
    final_loss = learn.loss_func(learn.model(xb), yb)
    assert final_loss < init_loss, (final_loss,init_loss)
    assert learn.compiler.report.graphs > 0, learn.compiler.report.summary() # The fit ran compiled

class TestTrainEvalCallback(Callback):
    __test__ = False # A fastai callback, not a pytest test class
    run_after,run_valid = TrainEvalCallback,False
    def before_fit(self):
        test_eq([self.pct_train,self.train_iter], [0., 0])
        self.old_pct_train,self.old_train_iter = self.pct_train,self.train_iter

    def before_batch(self): test_eq(next(self.parameters()).device, find_device(self.xb))

    def after_batch(self):
        assert self.training
        test_eq(self.pct_train , self.old_pct_train+1/(self.n_iter*self.n_epoch))
        test_eq(self.train_iter, self.old_train_iter+1)
        self.old_pct_train,self.old_train_iter = self.pct_train,self.train_iter

    def before_train(self):
        assert self.training and self.model.training
        test_eq(self.pct_train, self.epoch/self.n_epoch)
        self.old_pct_train = self.pct_train

    def before_validate(self):
        assert not self.training and not self.model.training

def test_train_eval_callback(only_train_eval):
    learn = synth_learner(cbs=TestTrainEvalCallback)
    learn.fit(1)
    #Check order is properly taken into account
    learn.cbs = L(reversed(learn.cbs))
    learn.fit(1)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="#cuda cell: checks the model is put on the GPU")
def test_train_eval_callback_cuda(only_train_eval):
    learn = synth_learner(cbs=TestTrainEvalCallback, cuda=True)
    learn.fit(1)
    learn = synth_learner(cbs=TestTrainEvalCallback, tfmdDL=False)
    learn.fit(1)

class _TstModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a,self.b = nn.Parameter(torch.randn(1)),nn.Parameter(torch.randn(1))
        self.tst = nn.Sequential(nn.Linear(4,5), nn.BatchNorm1d(3))
        self.tst[0].bias.data,self.tst[1].bias.data = torch.randn(5),torch.randn(3)
    def forward(self, x): return x * self.a + self.b

def test_wd_not_applied_on_bn_bias_and_one_batch(only_train_eval):
    "Check wd is not applied on bn/bias when option wd_bn_bias=False; then `one_batch` sets x, y, pred and loss"
    class _PutGrad(Callback):
        def before_step(self):
            for p in self.learn.tst.parameters():
                p.grad = torch.ones_like(p.data)

    learn = synth_learner(n_train=5, opt_func = partial(SGD, wd=1, decouple_wd=True), cbs=_PutGrad)
    learn.model = _TstModel()
    init = [p.clone() for p in learn.tst.parameters()]
    learn.fit(1, lr=1e-2)
    end = list(learn.tst.parameters())
    assert not torch.allclose(end[0]-init[0], -0.05 * torch.ones_like(end[0]))
    for i in [1,2,3]: test_close(end[i]-init[i], -0.05 * torch.ones_like(end[i]))

    b = learn.dls.one_batch()
    learn.one_batch(0, b)
    test_eq(learn.x, b[0])
    test_eq(learn.y, b[1])
    out = learn.model(learn.x)
    test_eq(learn.pred, out)
    test_eq(learn.loss, learn.loss_func(out, b[1]))

class VerboseCallback(Callback):
    "Callback that prints the name of each event called"
    def __call__(self, event_name):
        print(event_name)
        super().__call__(event_name)

class TestOneBatch(VerboseCallback):
    __test__ = False # A fastai callback, not a pytest test class
    def __init__(self, xb, yb, i):
        self.save_xb,self.save_yb,self.i = xb,yb,i
        self.old_pred,self.old_loss = None,tensor(0.)

    def before_batch(self):
        self.old_a,self.old_b = self.a.data.clone(),self.b.data.clone()
        test_eq(self.iter,    self.i)
        test_eq(self.save_xb, *self.xb)
        test_eq(self.save_yb, *self.yb)
        if hasattr(self.learn, 'pred'): test_eq(self.pred, self.old_pred)

    def after_pred(self):
        self.old_pred = self.pred
        test_eq(self.pred, self.a.data * self.x + self.b.data)
        test_eq(self.loss, self.old_loss)

    def after_loss(self):
        self.old_loss = self.loss
        test_eq(self.loss, self.loss_func(self.old_pred, self.save_yb))
        for p in self.parameters():
            if not hasattr(p, 'grad') or p.grad is not None: test_eq(p.grad, tensor([0.]))

    def before_step(self):
        self.grad_a = (2 * self.x * (self.pred.data - self.y)).mean()
        self.grad_b = 2 * (self.pred.data - self.y).mean()
        test_close(self.a.grad.data, self.grad_a)
        test_close(self.b.grad.data, self.grad_b)
        test_eq(self.a.data, self.old_a)
        test_eq(self.b.data, self.old_b)

    def after_step(self):
        test_close(self.a.data, self.old_a - self.lr * self.grad_a)
        test_close(self.b.data, self.old_b - self.lr * self.grad_b)
        self.old_a,self.old_b = self.a.data.clone(),self.b.data.clone()
        test_close(self.a.grad.data, self.grad_a)
        test_close(self.b.grad.data, self.grad_b)

    def after_batch(self):
        for p in self.parameters(): test_eq(p.grad, tensor([0.]))

# fastai 2.8 has `after_backward` between `before_backward` and `before_step` (the newer notebook's list)
batch_events = ['before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch']
valid_events = ['before_batch', 'after_pred', 'after_loss', 'after_batch']

def test_one_batch_events(only_train_eval):
    learn = synth_learner()
    b = learn.dls.one_batch()
    learn = synth_learner(cbs=TestOneBatch(*b, 42), lr=1e-2)
    compile_in_place(learn.model)
    #Remove train/eval
    learn.cbs = learn.cbs[1:]
    #Setup
    learn.loss,learn.training = tensor(0.),True
    learn.opt = SGD(learn.parameters(), lr=learn.lr)
    learn.model.train()
    test_stdout(lambda: learn.one_batch(42, b), '\n'.join(batch_events))
    test_stdout(lambda: learn.one_batch(42, b), '\n'.join(batch_events)) #Check it works for a second batch

def test_all_batches_events(only_train_eval):
    learn = synth_learner(n_train=5, cbs=VerboseCallback())
    learn.opt = SGD(learn.parameters(), lr=learn.lr)
    with redirect_stdout(io.StringIO()):
        learn(_before_epoch)
        learn.epoch,learn.dl = 0,learn.dls.train
        learn('before_train')
    test_stdout(learn.all_batches, '\n'.join(batch_events * 5))
    test_eq(learn.train_iter, 5)

    with redirect_stdout(io.StringIO()):
        learn.dl = learn.dls.valid
        learn('before_validate')
    test_stdout(learn.all_batches, '\n'.join(valid_events * 2))
    test_eq(learn.train_iter, 5)
    assert is_compiled(learn.model) # `before_fit` above compiled it at the first batch

def test_epoch_events(only_train_eval):
    learn = synth_learner(n_train=5, cbs=VerboseCallback())
    test_stdout(lambda: learn(_before_epoch), 'before_fit\nbefore_epoch')
    test_eq(learn.loss, tensor(0.))

    learn.opt = SGD(learn.parameters(), lr=learn.lr)
    learn.epoch = 0
    test_stdout(lambda: learn._do_epoch_train(), '\n'.join(['before_train'] + batch_events * 5 + ['after_train']))
    test_stdout(learn._do_epoch_validate, '\n'.join(['before_validate'] + valid_events * 2+ ['after_validate']))
    assert is_compiled(learn.model)

@pytest.mark.parametrize('opt_func,lr', [(Adam, None), (partial(OptimWrapper, opt=torch.optim.Adam), None),
                                         (partial(OptimWrapper, opt=torch.optim.Adam, lr=1), 1)],
                         ids=['fastai', 'wrapper', 'wrapper_lr'])
def test_create_opt(only_train_eval, opt_func, lr):
    learn = synth_learner(n_train=5, cbs=VerboseCallback(), opt_func=opt_func)
    assert learn.opt is None
    learn.create_opt()
    assert learn.opt is not None
    test_eq(learn.opt.hypers[0]['lr'], learn.lr if lr is None else lr)

def test_init_with_callbacks(only_train_eval):
    class TstCallback(Callback):
        def batch_begin(self): self.learn.a = self.a + 1

    tst_learn = synth_learner()
    test_eq(len(tst_learn.cbs), 1+1) # +1: CompilerCallback
    assert isinstance(tst_learn.cbs[0], TrainEvalCallback)
    assert hasattr(tst_learn, ('train_eval'))

    tst_learn = synth_learner(cbs=TstCallback())
    test_eq(len(tst_learn.cbs), 2+1) # +1: CompilerCallback
    assert isinstance(tst_learn.cbs[1], TstCallback)
    assert hasattr(tst_learn, ('tst'))

    learn = synth_learner(cbs=VerboseCallback())
    test_stdout(lambda: learn('after_fit'), 'after_fit')

def test_add_remove_callbacks(only_train_eval):
    learn = synth_learner()
    learn.add_cb(TestTrainEvalCallback())
    test_eq(len(learn.cbs), 2+1) # +1: CompilerCallback
    assert isinstance(learn.cbs[-1], TestTrainEvalCallback) # fastai's `cbs[1]`: appended after the CompilerCallback
    test_eq(learn.train_eval.learn, learn)

    learn.add_cbs([TestTrainEvalCallback(), TestTrainEvalCallback()])
    test_eq(len(learn.cbs), 4+1) # +1: CompilerCallback

    learn = synth_learner()
    test_eq(len(learn.cbs), 1+1) # +1: CompilerCallback
    with learn.added_cbs(TestTrainEvalCallback()):
        test_eq(len(learn.cbs), 2+1) # +1: CompilerCallback

    learn = synth_learner()
    learn.add_cb(TestTrainEvalCallback())
    # The notebook shows `[TrainEvalCallback, TestTrainEvalCallback]`; the CompilerCallback (order 12) runs after them
    test_eq([type(c) for c in learn.ordered_cbs('before_fit')], [TrainEvalCallback, TestTrainEvalCallback, CompilerCallback])

    learn = synth_learner()
    learn.add_cb(TestTrainEvalCallback())
    cb = learn.cbs[-1] # fastai's `cbs[1]`
    learn.remove_cb(cb)
    test_eq(len(learn.cbs), 1+1) # +1: CompilerCallback
    assert cb.learn is None
    assert not getattr(learn,'test_train_eval',None)

    learn = synth_learner()
    learn.add_cbs([TestTrainEvalCallback(), TestTrainEvalCallback()])
    learn.remove_cb(TestTrainEvalCallback)
    test_eq(len(learn.cbs), 1+1) # +1: CompilerCallback
    assert not getattr(learn,'test_train_eval',None)

    learn = synth_learner()
    learn.add_cbs([TestTrainEvalCallback() for _ in range(3)])
    learn.remove_cbs(learn.cbs[2:]) # fastai's `cbs[1:]`: all but TrainEvalCallback (and the CompilerCallback)
    test_eq(len(learn.cbs), 1+1) # +1: CompilerCallback

    learn = synth_learner()
    learn.add_cb(TestTrainEvalCallback())
    with learn.removed_cbs(learn.cbs[-1]): # fastai's `cbs[1]`
        test_eq(len(learn.cbs), 1+1) # +1: CompilerCallback
    test_eq(len(learn.cbs), 2+1) # +1: CompilerCallback

def test_show_training_loop(only_train_eval):
    learn = synth_learner()
    s = io.StringIO()
    with redirect_stdout(s): learn.show_training_loop()
    # The notebook shows its output; with the CompilerCallback it is listed where it acts
    assert ' - before_fit     : [TrainEvalCallback, CompilerCallback]' in s.getvalue(), s.getvalue()
    assert ' - after_batch    : [TrainEvalCallback, CompilerCallback]' in s.getvalue(), s.getvalue()

@pytest.mark.parametrize('with_opt', [True, False])
def test_save_load(only_train_eval, with_opt):
    with tempfile.TemporaryDirectory() as d:
        learn = synth_learner(path=d)
        learn.fit(1)
        learn.save('tmp', with_opt=with_opt)
        #Test save created a file
        assert (Path(d)/'models/tmp.pth').exists()
        #Test load did load the model
        learn1 = synth_learner(path=d)
        learn1 = learn1.load('tmp', with_opt=with_opt)
        test_eq(learn.a, learn1.a)
        test_eq(learn.b, learn1.b)
        if with_opt: test_eq(learn.opt.state_dict(), learn1.opt.state_dict())
        else: test_ne(learn.opt.state_dict(), learn1.opt.state_dict())

def test_to_detach(only_train_eval):
    "fastai 2.8's `Learner.to_detach` (the older notebook's `to_detach_from_dl(learn, ...)`)"
    learn = synth_learner()
    test_eq(learn.to_detach(Tensor([123])),Tensor([123]))
    learn.dl = learn.dls[0]
    test_eq(learn.to_detach(Tensor([123])),Tensor([123]))
    learn.dl.to_detach = lambda b,cpu,gather: b-100
    test_eq(learn.to_detach(Tensor([123.])),Tensor([23.]))

def test_metrics(only_train_eval):
    learn = synth_learner()
    tst = AvgMetric(lambda x,y: (x-y).abs().mean())
    t,u = torch.randn(100),torch.randn(100)
    tst.reset()
    for i in range(0,100,25):
        learn.pred,learn.yb = t[i:i+25],(u[i:i+25],)
        tst.accumulate(learn)
    test_close(tst.value, (t-u).abs().mean())
    #With varying batch size
    tst.reset()
    splits = [0, 30, 50, 60, 100]
    for i in range(len(splits )-1):
        learn.pred,learn.yb = t[splits[i]:splits[i+1]],(u[splits[i]:splits[i+1]],)
        tst.accumulate(learn)
    test_close(tst.value, (t-u).abs().mean())

    tst = AvgLoss()
    t = torch.randn(100)
    tst.reset()
    for i in range(0,100,25):
        learn.yb,learn.loss = t[i:i+25],t[i:i+25].mean()
        tst.accumulate(learn)
    test_close(tst.value, t.mean())
    tst.reset()
    for i in range(len(splits )-1):
        learn.yb,learn.loss = t[splits[i]:splits[i+1]],t[splits[i]:splits[i+1]].mean()
        tst.accumulate(learn)
    test_close(tst.value, t.mean())

    tst = AvgSmoothLoss()
    t = torch.randn(100)
    tst.reset()
    val = tensor(0.)
    for i in range(4):
        learn.loss = t[i*25:(i+1)*25].mean()
        tst.accumulate(learn)
        val = val*0.98 + t[i*25:(i+1)*25].mean()*(1-0.98)
        test_close(val/(1-0.98**(i+1)), tst.value)

    def metric_value_fn(): return 5e-3
    vm = ValueMetric(metric_value_fn, 'custom_value_metric')
    test_eq(vm.value, 5e-3)
    test_eq(vm.name, 'custom_value_metric')
    vm = ValueMetric(metric_value_fn)
    test_eq(vm.name, 'metric_value_fn')

def tst_metric(out, targ): return F.mse_loss(out, targ)

def test_recorder_printed_output(with_recorder):
    learn = synth_learner(n_train=5, metrics=tst_metric)
    pat = r"\[\d, \d+.\d+, \d+.\d+, \d+.\d+, '\d\d:\d\d'\]"
    test_stdout(lambda: learn.fit(1), pat, regex=True)

class TestRecorderCallback(Callback):
    __test__ = False # A fastai callback, not a pytest test class
    order=51
    def before_fit(self):
        self.train_metrics,self.add_time = self.recorder.train_metrics,self.recorder.add_time
        self.beta = self.recorder.smooth_loss.beta
        for m in self.metrics: assert isinstance(m, Metric)
        test_eq(self.recorder.smooth_loss.val, 0.)
        #To test what the recorder logs, we use a custom logger function.
        self.learn.logger = self.test_log
        self.old_smooth,self.count = tensor(0.),0

    def after_batch(self):
        if self.training:
            self.count += 1
            test_eq(len(self.recorder.lrs), self.count)
            test_eq(self.recorder.lrs[-1], self.opt.hypers[-1]['lr'])
            test_eq(len(self.recorder.losses), self.count)
            smooth = (1 - self.beta**(self.count-1)) * self.old_smooth * self.beta + self.loss * (1-self.beta)
            smooth /= 1 - self.beta**self.count
            test_close(self.recorder.losses[-1], smooth, eps=1e-4)
            test_close(self.smooth_loss, smooth, eps=1e-4)
            self.old_smooth = self.smooth_loss
        self.bs += find_bs(self.yb)
        if not self.training: test_eq(self.recorder.loss.count, self.bs)
        if self.train_metrics or not self.training:
            for m in self.metrics: test_eq(m.count, self.bs)
        self.losses.append(self.loss.detach().cpu())

    def before_epoch(self):
        if self.add_time: self.start_epoch = time.time()
        self.log = [self.epoch]

    def before_train(self):
        self.bs = 0
        self.losses = []
        for m in self.recorder._train_mets: test_eq(m.count, self.bs)

    def after_train(self):
        mean = tensor(self.losses).mean()
        self.log += [self.smooth_loss, mean] if self.train_metrics else [self.smooth_loss]
        test_close(self.log, self.recorder.log)
        self.losses = []

    def before_validate(self):
        self.bs = 0
        self.losses = []
        for m in [self.recorder.loss] + self.metrics: test_eq(m.count, self.bs)

    def test_log(self, log):
        res = tensor(self.losses).mean()
        self.log += [res, res]
        if self.add_time: self.log.append(format_time(time.time() - self.start_epoch))
        test_close(log[:-1], self.log[:-1])
        test_eq(log[-1], self.log[-1])

def test_recorder(with_recorder):
    learn = synth_learner(n_train=5, metrics = tst_metric, cbs = TestRecorderCallback)
    learn.fit(1)
    test_eq(learn.recorder.metric_names, ['epoch', 'train_loss', 'valid_loss', 'tst_metric', 'time'])

    learn = synth_learner(n_train=5, metrics = tst_metric, cbs = TestRecorderCallback)
    learn.recorder.train_metrics=True
    learn.fit(1)
    test_eq(learn.recorder.metric_names,
            ['epoch', 'train_loss', 'train_tst_metric', 'valid_loss', 'valid_tst_metric', 'time'])

    learn = synth_learner(n_train=5, metrics = tst_metric, cbs = TestRecorderCallback)
    learn.recorder.add_time=False
    learn.fit(1)
    test_eq(learn.recorder.metric_names, ['epoch', 'train_loss', 'valid_loss', 'tst_metric'])

def test_recorder_numpy_metric_and_plot(with_recorder):
    import matplotlib; matplotlib.use('Agg')
    def tst_metric_np(out, targ): return F.mse_loss(out, targ).numpy()
    learn = synth_learner(n_train=5, metrics=tst_metric_np)
    with redirect_stdout(io.StringIO()): learn.fit(1)
    learn.recorder.plot_loss(skip_start=1)

def test_validate(with_recorder):
    learn = synth_learner(n_train=5, metrics=tst_metric)
    res = learn.validate()
    test_eq(res[0], res[1])
    x,y = learn.dls.valid_ds.tensors
    test_close(res[0], F.mse_loss(learn.model(x), y), 1e-3)
    #Test other dl
    res = learn.validate(dl=learn.dls.train)
    test_eq(res[0], res[1])
    x,y = learn.dls.train_ds.tensors
    test_close(res[0], F.mse_loss(learn.model(x), y), 1e-3)

def test_get_preds(with_recorder):
    learn = synth_learner(n_train=5, metrics=tst_metric)
    preds,targs = learn.get_preds()
    x,y = learn.dls.valid_ds.tensors
    test_eq(targs, y)
    test_close(preds, learn.model(x))

    preds,targs = learn.get_preds(act = torch.sigmoid)
    test_eq(targs, y)
    test_close(preds, torch.sigmoid(learn.model(x)))

    #Test get_preds work with ds not evenly divisible by bs
    learn = synth_learner(n_train=2.5, metrics=tst_metric)
    preds,targs = learn.get_preds(ds_idx=0)
    #Also make sure this version works when drop_last of the dl would be True
    preds,targs = learn.get_preds(dl=learn.dls.train)

    #Test other dataset
    x = torch.randn(16*5)
    y = 2*x + 3 + 0.1*torch.randn(16*5)
    dl = TfmdDL(TensorDataset(x, y), bs=16)
    preds,targs = learn.get_preds(dl=dl)
    test_eq(targs, y)
    test_close(preds, learn.model(x))

    #Test with loss
    preds,targs,losses = learn.get_preds(dl=dl, with_loss=True)
    test_eq(targs, y)
    test_close(preds, learn.model(x))
    test_close(losses, F.mse_loss(preds, targs, reduction='none'))

    #Test with inputs
    inps,preds,targs = learn.get_preds(dl=dl, with_input=True)
    test_eq(inps,x)
    test_eq(targs, y)
    test_close(preds, learn.model(x))

def test_get_preds_no_target_and_tuples(with_recorder):
    #Test with no target
    learn = synth_learner(n_train=5)
    x = torch.randn(16*5)
    dl = TfmdDL(TensorDataset(x), bs=16)
    preds,targs = learn.get_preds(dl=dl)
    assert targs is None

    #Test with targets that are tuples
    def _fake_loss(x,y,z,reduction=None): return F.mse_loss(x,y)
    learn = synth_learner(n_train=5)
    x = torch.randn(16*5)
    y = 2*x + 3 + 0.1*torch.randn(16*5)
    learn.dls.n_inp=1
    learn.loss_func = _fake_loss
    dl = TfmdDL(TensorDataset(x, y, y), bs=16)
    preds,targs = learn.get_preds(dl=dl)
    test_eq(targs, [y,y])

    #Test with inputs that are tuples
    class _TupleModel(Module):
        def __init__(self, model): self.model=model
        def forward(self, x1, x2): return self.model(x1)

    learn = synth_learner(n_train=5)
    x = torch.randn(16*5)
    y = 2*x + 3 + 0.1*torch.randn(16*5)
    learn.model = _TupleModel(learn.model)
    learn.dls = DataLoaders(TfmdDL(TensorDataset(x, x, y), bs=16),TfmdDL(TensorDataset(x, x, y), bs=16))
    inps,preds,targs = learn.get_preds(ds_idx=0, with_input=True)
    test_eq(inps, [x,x])
    t = learn.get_preds(ds_idx=0, with_input=True)

def test_get_preds_activation_and_reorder(with_recorder):
    #Test auto activation function is picked
    learn = synth_learner(n_train=5)
    learn.loss_func = BCEWithLogitsLossFlat()
    x = torch.randn(16*5)
    y = 2*x + 3 + 0.1*torch.randn(16*5)
    dl = TfmdDL(TensorDataset(x, y), bs=16)
    preds,targs = learn.get_preds(dl=dl)
    test_close(preds, torch.sigmoid(learn.model(x)))

    #Test reorder is done
    learn = synth_learner(n_train=5)
    x = torch.randn(16*5)
    y = 2*x + 3 + 0.1*torch.randn(16*5)
    dl = TfmdDL(TensorDataset(x, y), bs=16, shuffle=True)
    preds,targs = learn.get_preds(dl=dl)
    test_eq(targs, y)

    inps,preds,targs = learn.get_preds(ds_idx=0, with_input=True)
    tst = learn.get_preds(ds_idx=0, with_input=True, with_decoded=True)

def test_predict(with_recorder):
    class _FakeLossFunc(Module):
        reduction = 'none'
        def forward(self, x, y): return F.mse_loss(x,y)
        def activation(self, x): return x+1
        def decodes(self, x):    return 2*x

    class _Add1(Transform):
        def encodes(self, x): return x+1
        def decodes(self, x): return x-1

    learn = synth_learner(n_train=5)
    dl = TfmdDL(Datasets(torch.arange(50), tfms = [L(), [_Add1()]]))
    learn.dls = DataLoaders(dl, dl)
    learn.loss_func = _FakeLossFunc()

    inp = tensor([2.])
    out = learn.model(inp).detach()+1  #applying model + activation
    dec = 2*out                        #decodes from loss function
    full_dec = dec-1                   #decodes from _Add1
    test_eq(learn.predict(inp), [full_dec,dec,out])
    test_eq(learn.predict(inp, with_input=True), [inp,full_dec,dec,out])

def test_no_logging_and_loss_not_reduced(with_recorder):
    learn = synth_learner(n_train=5, metrics=tst_metric)
    with learn.no_logging():
        test_stdout(lambda: learn.fit(1), '')
    test_eq(learn.logger, print)

    test_eq(learn.loss_func.reduction, 'mean')
    with learn.loss_not_reduced():
        test_eq(learn.loss_func.reduction, 'none')
        x,y = learn.dls.one_batch()
        p = learn.model(x)
        losses = learn.loss_func(p, y)
        test_eq(losses.shape, y.shape)
        test_eq(losses, F.mse_loss(p,y, reduction='none'))
    test_eq(learn.loss_func.reduction, 'mean')

class _PutGradIfTrains(Callback):
    def before_step(self):
        for p in self.learn.tst.parameters():
            if p.requires_grad: p.grad = torch.ones_like(p.data)

def _splitter(m): return [list(m.tst[0].parameters()), list(m.tst[1].parameters()), [m.a,m.b]]

def test_freeze_trains_bn_by_default(with_recorder):
    learn = synth_learner(n_train=5, opt_func = partial(SGD), cbs=_PutGradIfTrains, splitter=_splitter, lr=1e-2)
    learn.model = _TstModel()
    learn.freeze()
    init = [p.clone() for p in learn.tst.parameters()]
    with redirect_stdout(io.StringIO()): learn.fit(1, wd=0.)
    end = list(learn.tst.parameters())
    #linear was not trained
    for i in [0,1]: test_close(end[i],init[i])
    #bn was trained even frozen since `train_bn=True` by default
    for i in [2,3]: test_close(end[i]-init[i], -0.05 * torch.ones_like(end[i]))

def test_freeze_to_and_unfreeze(with_recorder):
    learn = synth_learner(n_train=5, opt_func = partial(SGD), cbs=_PutGradIfTrains, splitter=_splitter, train_bn=False, lr=1e-2)
    learn.model = _TstModel()
    learn.freeze()
    init = [p.clone() for p in learn.tst.parameters()]
    with redirect_stdout(io.StringIO()): learn.fit(1, wd=0.)
    end = list(learn.tst.parameters())
    #linear and bn were not trained
    for i in range(4): test_close(end[i],init[i])

    learn.freeze_to(-2)
    init = [p.clone() for p in learn.tst.parameters()]
    with redirect_stdout(io.StringIO()): learn.fit(1, wd=0.)
    end = list(learn.tst.parameters())
    #linear was not trained
    for i in [0,1]: test_close(end[i],init[i])
    #bn was trained
    for i in [2,3]: test_close(end[i]-init[i], -0.05 * torch.ones_like(end[i]))

    learn.unfreeze()
    init = [p.clone() for p in learn.tst.parameters()]
    with redirect_stdout(io.StringIO()): learn.fit(1, wd=0.)
    end = list(learn.tst.parameters())
    #linear and bn were trained
    for i in range(4): test_close(end[i]-init[i], -0.05 * torch.ones_like(end[i]), 1e-3)

def test_tta(with_recorder):
    learn = synth_learner()
    dl = TfmdDL(Datasets(torch.arange(50), [noop,noop]))
    learn.dls = DataLoaders(dl, dl)
    preds,targs = learn.tta()
    assert len(preds),len(targs)

# ====================================================================================================================
# nbs/15_callback.hook.ipynb, nbs/17_callback.tracker.ipynb, nbs/18a_callback.training.ipynb: `fastai.test_utils`
# ====================================================================================================================

def tu_synth_learner(n_trn=10, n_val=2, cuda=False, lr=1e-3, data=None, model=None, cbs=None, **kwargs):
    "`fastai.test_utils.synth_learner`, which these notebooks use, compiled"
    return tu.synth_learner(n_trn=n_trn, n_val=n_val, cuda=cuda, lr=lr, data=data, model=model, cbs=compiled_cbs(cbs), **kwargs)

def quiet(f, *args, **kwargs):
    "Run `f` with stdout captured (fastprogress bars and logs), returning what it printed"
    s = io.StringIO()
    with redirect_stdout(s): f(*args, **kwargs)
    return s.getvalue()

def example_forward_hook(m,i,o): print(m,i,o)

def test_hook():
    tst_model = compile_in_place(nn.Linear(5,3))
    x = torch.randn(4,5)
    hook = Hook(tst_model, lambda m,i,o: o)
    y = tst_model(x)
    test_eq(hook.stored, y)
    hook.remove()

    tst_model = compile_in_place(nn.Linear(5,10))
    x = torch.randn(4,5)
    y = tst_model(x)
    hook = Hook(tst_model, example_forward_hook)
    test_stdout(lambda: tst_model(x), f"{tst_model} ({x},) {y.detach()}")
    hook.remove()
    test_stdout(lambda: tst_model(x), "")

    tst_model = compile_in_place(nn.Linear(5,10))
    x = torch.randn(4,5)
    y = tst_model(x)
    with Hook(tst_model, example_forward_hook) as h:
        test_stdout(lambda: tst_model(x), f"{tst_model} ({x},) {y.detach()}")
    test_stdout(lambda: tst_model(x), "")

def test_hook_output():
    tst_model = compile_in_place(nn.Linear(5,10))
    x = torch.randn(4,5)
    with hook_output(tst_model) as h:
        y = tst_model(x)
        test_eq(y, h.stored)
        assert not h.stored.requires_grad

    with hook_output(tst_model, grad=True) as h:
        y = tst_model(x)
        loss = y.pow(2).mean()
        loss.backward()
        test_close(2*y / y.numel(), h.stored[0])

@pytest.mark.skipif(not torch.cuda.is_available(), reason="#cuda cell: hook_output(cpu=True) of a model on the GPU")
def test_hook_output_cuda():
    tst_model = compile_in_place(nn.Linear(5,10))
    x = torch.randn(4,5)
    with hook_output(tst_model, cpu=True) as h:
        y = tst_model.cuda()(x.cuda())
        test_eq(h.stored.device, torch.device('cpu'))

def test_hooks():
    x = torch.randn(4,5)
    layers = [nn.Linear(5,10), nn.ReLU(), nn.Linear(10,3)]
    tst_model = compile_in_place(nn.Sequential(*layers))
    hooks = Hooks(tst_model, lambda m,i,o: o)
    y = tst_model(x)
    test_eq(hooks.stored[0], layers[0](x))
    test_eq(hooks.stored[1], F.relu(layers[0](x)))
    test_eq(hooks.stored[2], y)
    hooks.remove()

    layers = [nn.Linear(5,10), nn.ReLU(), nn.Linear(10,3)]
    tst_model = compile_in_place(nn.Sequential(*layers))
    with Hooks(layers, lambda m,i,o: o) as h:
        y = tst_model(x)
        test_eq(h.stored[0], layers[0](x))
        test_eq(h.stored[1], F.relu(layers[0](x)))
        test_eq(h.stored[2], y)

def test_hook_outputs():
    layers = [nn.Linear(5,10), nn.ReLU(), nn.Linear(10,3)]
    tst_model = compile_in_place(nn.Sequential(*layers))
    x = torch.randn(4,5)
    with hook_outputs(layers) as h:
        y = tst_model(x)
        test_eq(h.stored[0], layers[0](x))
        test_eq(h.stored[1], F.relu(layers[0](x)))
        test_eq(h.stored[2], y)
        for s in h.stored: assert not s.requires_grad

    with hook_outputs(layers, grad=True) as h:
        y = tst_model(x)
        loss = y.pow(2).mean()
        loss.backward()
        g = 2*y / y.numel()
        test_close(g, h.stored[2][0])
        g = g @ layers[2].weight.data
        test_close(g, h.stored[1][0])
        g = g * (layers[0](x) > 0).float()
        test_close(g, h.stored[0][0])

def test_model_sizes_and_num_features():
    m = compile_in_place(nn.Sequential(ConvLayer(3, 16), ConvLayer(16, 32, stride=2), ConvLayer(32, 32)))
    test_eq(model_sizes(m), [[1, 16, 64, 64], [1, 32, 32, 32], [1, 32, 32, 32]])
    m = compile_in_place(nn.Sequential(nn.Conv2d(5,4,3), nn.Conv2d(4,3,3)))
    test_eq(num_features_model(m), 3)
    m = compile_in_place(nn.Sequential(ConvLayer(3, 16), ConvLayer(16, 32, stride=2), ConvLayer(32, 32)))
    test_eq(num_features_model(m), 32)

def test_has_params_and_total_params():
    assert has_params(nn.Linear(3,4))
    assert has_params(nn.LSTM(4,5,2))
    assert not has_params(nn.ReLU())
    test_eq(total_params(nn.Linear(10,32)), (32*10+32,True))
    test_eq(total_params(nn.Linear(10,32, bias=False)), (32*10,True))
    test_eq(total_params(nn.BatchNorm2d(20)), (20*2, True))
    test_eq(total_params(nn.BatchNorm2d(20, affine=False)), (0,False))
    test_eq(total_params(nn.Conv2d(16, 32, 3)), (16*32*3*3 + 32, True))
    test_eq(total_params(nn.Conv2d(16, 32, 3, bias=False)), (16*32*3*3, True))
    #First ih layer 20--10, all else 10--10. *4 for the four gates
    test_eq(total_params(nn.LSTM(20, 10, 2)), (4 * (20*10 + 10) + 3 * 4 * (10*10 + 10), True))

def test_hook_callback_forward():
    class TstCallback(HookCallback):
        def hook(self, m, i, o): return o
        def after_batch(self): test_eq(self.hooks.stored[0], self.pred)

    learn = tu_synth_learner(n_trn=5, cbs = TstCallback())
    quiet(learn.fit, 1)

def test_hook_callback_backward():
    class TstCallback(HookCallback):
        def __init__(self, modules=None, remove_end=True, detach=True, cpu=False):
            super().__init__(modules, None, remove_end, False, detach, cpu)
        def hook(self, m, i, o): return o
        def after_batch(self):
            if self.training:
                test_eq(self.hooks.stored[0][0], 2*(self.pred-self.y)/self.pred.shape[0])

    learn = tu_synth_learner(n_trn=5, cbs = TstCallback())
    quiet(learn.fit, 1)

def _m(): return nn.Sequential(nn.Linear(1,50), nn.ReLU(), nn.BatchNorm1d(50), nn.Linear(50, 1))

def test_layer_info():
    sample_input = torch.randn((16, 1))
    test_eq(layer_info(tu_synth_learner(model=_m()), sample_input), [
        ('Linear', 100, True, [1, 50], False),
        ('ReLU', '', '', [1,50], True),
        ('BatchNorm1d', 100, True, [1, 50], True),
        ('Linear', 51, True, [1, 1], False)
    ])

    # Test for Flatten
    def _tst_m(): return nn.Sequential(
        nn.Conv2d(1, 2, kernel_size=3, padding=1, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8,50),
        nn.ReLU(),
        nn.BatchNorm1d(50),
        nn.Linear(50, 1)
    )
    sample_input = torch.randn((1,1,4,4))
    test_eq(layer_info(tu_synth_learner(model=_tst_m()), sample_input), [
        ('Conv2d', 20, True, [1, 2, 2, 2], False),
        ('ReLU', '', '', [1, 2, 2, 2], True),
        ('Flatten', '', '', [1, 8], False),
        ('Linear', 450, True, [1, 50], False),
        ('ReLU', '', '', [1,50], True),
        ('BatchNorm1d', 100, True, [1, 50], True),
        ('Linear', 51, True, [1, 1], False)
    ])

    # Test for multiple inputs model
    class _2InpModel(Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(2,50), nn.ReLU(), nn.BatchNorm1d(50), nn.Linear(50, 1))
        def forward(self, *inps):
            outputs = torch.cat(inps, dim=-1)
            return self.seq(outputs)

    sample_inputs = (torch.randn(16, 1), torch.randn(16, 1))
    learn = tu_synth_learner(model=_2InpModel())
    learn.dls.n_inp = 2
    test_eq(layer_info(learn, *sample_inputs), [
        ('Linear', 150, True, [1, 50], False),
        ('ReLU', '', '', [1,50], True),
        ('BatchNorm1d', 100, True, [1, 50], True),
        ('Linear', 51, True, [1, 1], False)
    ])

def test_summary():
    learn = tu_synth_learner(model=_m())
    s = learn.summary()
    # The notebook shows the summary: its table, and `CompilerCallback` among the callbacks
    assert 'Total params: 251' in s and 'Total trainable params: 251' in s, s
    assert '  - CompilerCallback' in s, s

    # Test for multiple output
    class _NOutModel(Module):
        def __init__(self): self.lin = nn.Linear(5, 6)
        def forward(self, x1):
            x = torch.randn((10, 5))
            return x,self.lin(x)
    learn = tu_synth_learner(model = _NOutModel())
    learn.summary()

    # Test for the case (as in Book) when learn.dls.train_ds is a list not fastai.data.core.Datasets
    train_x = torch.rand((100, 4))
    train_y = torch.rand((100, 1))
    valid_x = torch.rand((100, 4))
    valid_y = torch.rand((100,1))
    dset = list(zip(train_x,train_y))
    valid_dset = list(zip(valid_x,valid_y))
    dl = DataLoader(dset, batch_size=16)
    val_dl = DataLoader(valid_dset, batch_size=16)
    dls = DataLoaders(dl, val_dl)
    simple_net = nn.Sequential(nn.Linear(4, 2), nn.ReLU(), nn.Linear(2,1))
    learn = Learner(dls, simple_net, loss_func=F.l1_loss, cbs=compiled_cbs())
    learn.summary()

@pytest.mark.skipif(not torch.cuda.is_available(), reason="#cuda cell: summary of a model on the GPU")
def test_summary_cuda():
    learn = tu_synth_learner(model=_m(), cuda=True)
    learn.summary()

def test_activation_stats():
    learn = tu_synth_learner(n_trn=5, cbs = ActivationStats(every=4))
    quiet(learn.fit, 1)
    assert len(learn.activation_stats.stats) == 2 # The notebook shows two batches' stats, 0 and 4

@pytest.mark.parametrize('include_paramless', [True, False])
def test_activation_stats_include_paramless(include_paramless):
    "create a learner, fit, then check number of layers"
    modl = nn.Sequential(nn.Linear(1,50), nn.ReLU(), nn.BatchNorm1d(50), nn.Linear(50, 1), nn.Flatten())
    learn = tu_synth_learner(model=modl, cbs=ActivationStats(every=4, include_paramless=include_paramless))
    quiet(learn.fit, 1)
    expected_stats_len = 3
    if include_paramless: expected_stats_len = 5 # includes Relu & Flatten
    test_eq(expected_stats_len, len(learn.activation_stats.modules))

@pytest.mark.parametrize('n_tr', [11, 12, 13])
def test_activation_stats_every(n_tr):
    "create a learner, fit, then check number of stats collected"
    for every in (4, 1):
        learn = tu_synth_learner(n_trn=n_tr, cbs=ActivationStats(every=every))
        quiet(learn.fit, 1)
        expected_stats_len = math.ceil(n_tr / every)
        test_eq(expected_stats_len, len(learn.activation_stats.stats))

def test_activation_stats_against_hook_callback():
    class TstCallback(HookCallback):
        def hook(self, m, i, o): return o
        def before_fit(self):
            super().before_fit()
            self.means,self.stds = [],[]

        def after_batch(self):
            if self.training:
                self.means.append(self.hooks.stored[0].mean().item())
                self.stds.append (self.hooks.stored[0].std() .item())

    learn = tu_synth_learner(n_trn=5, cbs = [TstCallback(), ActivationStats()])
    quiet(learn.fit, 1)
    test_eq(learn.activation_stats.stats.itemgot(0).itemgot("mean"), learn.tst.means)
    test_eq(learn.activation_stats.stats.itemgot(0).itemgot("std"),  learn.tst.stds)

# --- nbs/17_callback.tracker.ipynb ----------------------------------------------------------------------------------

def test_terminate_on_nan():
    learn = tu_synth_learner()
    quiet(learn.fit, 10, lr=100, cbs=TerminateOnNaNCallback())
    assert len(learn.recorder.losses) < 10 * len(learn.dls.train)
    for l in learn.recorder.losses:
        assert not torch.isinf(l) and not torch.isnan(l)

class FakeRecords(Callback):
    order=51
    def __init__(self, monitor, values): self.monitor,self.values = monitor,values
    def before_fit(self):   self.idx = list(self.recorder.metric_names[1:]).index(self.monitor)
    def after_epoch(self): self.recorder.values[-1][self.idx] = self.values[self.epoch]

class TestTracker(Callback):
    __test__ = False # A fastai callback, not a pytest test class
    order=61
    def before_fit(self): self.bests,self.news = [],[]
    def after_epoch(self):
        self.bests.append(self.tracker.best)
        self.news.append(self.tracker.new_best)

def test_tracker_callback():
    learn = tu_synth_learner(n_trn=2, cbs=TestTracker())
    cbs=[TrackerCallback(monitor='valid_loss'), FakeRecords('valid_loss', [0.2,0.1])]
    with learn.no_logging(): quiet(learn.fit, 2, cbs=cbs)
    test_eq(learn.test_tracker.bests, [0.2, 0.1])
    test_eq(learn.test_tracker.news,  [True,True])

    #With a min_delta
    cbs=[TrackerCallback(monitor='valid_loss', min_delta=0.15), FakeRecords('valid_loss', [0.2,0.1])]
    with learn.no_logging(): quiet(learn.fit, 2, cbs=cbs)
    test_eq(learn.test_tracker.bests, [0.2, 0.2])
    test_eq(learn.test_tracker.news,  [True,False])

def test_tracker_callback_metric_comp():
    #By default metrics have to be bigger at each epoch.
    learn = tu_synth_learner(n_trn=2, cbs=TestTracker(), metrics=tst_metric)
    cbs=[TrackerCallback(monitor='tst_metric'), FakeRecords('tst_metric', [0.2,0.1])]
    with learn.no_logging(): quiet(learn.fit, 2, cbs=cbs)
    test_eq(learn.test_tracker.bests, [0.2, 0.2])
    test_eq(learn.test_tracker.news,  [True,False])

    #This can be overwritten by passing `comp=np.less`.
    learn = tu_synth_learner(n_trn=2, cbs=TestTracker(), metrics=tst_metric)
    cbs=[TrackerCallback(monitor='tst_metric', comp=np.less), FakeRecords('tst_metric', [0.2,0.1])]
    with learn.no_logging(): quiet(learn.fit, 2, cbs=cbs)
    test_eq(learn.test_tracker.bests, [0.2, 0.1])
    test_eq(learn.test_tracker.news,  [True,True])

def test_tracker_callback_reset_on_fit():
    #Setting reset_on_fit=True will maintain the "best" value over subsequent calls to fit
    learn = tu_synth_learner(n_val=2, cbs=TrackerCallback(monitor='tst_metric', reset_on_fit=False), metrics=tst_metric)
    tracker_cb = learn.cbs.filter(lambda cb: isinstance(cb, TrackerCallback))[0]
    with learn.no_logging(): quiet(learn.fit, 1)
    first_best = tracker_cb.best
    with learn.no_logging(): quiet(learn.fit, 1)
    test_eq(tracker_cb.best, first_best)

def test_tracker_not_run_in_lr_find(tmp_path):
    #A tracker callback is not run during an lr_find
    learn = tu_synth_learner(n_trn=2, cbs=TrackerCallback(monitor='tst_metric'), metrics=tst_metric, path=tmp_path)
    quiet(learn.lr_find, num_it=15, show_plot=False)
    assert not hasattr(learn, 'new_best')

def test_early_stopping():
    learn = tu_synth_learner(n_trn=2, metrics=F.mse_loss)
    out = quiet(learn.fit, n_epoch=200, lr=1e-7, cbs=EarlyStoppingCallback(monitor='mse_loss', min_delta=0.1, patience=2))
    assert 'No improvement since epoch 0: early stopping' in out, out # The notebook's output
    learn.validate()

    learn = tu_synth_learner(n_trn=2)
    out = quiet(learn.fit, n_epoch=200, lr=1e-7, cbs=EarlyStoppingCallback(monitor='valid_loss', min_delta=0.1, patience=2))
    assert 'No improvement since epoch 0: early stopping' in out, out
    test_eq(len(learn.recorder.values), 3)

def test_save_model_callback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path) # The notebook writes to `Path.cwd()/'tmp'`
    learn = tu_synth_learner(n_trn=2, path=Path.cwd()/'tmp')
    quiet(learn.fit, n_epoch=2, cbs=SaveModelCallback())
    assert (Path.cwd()/'tmp/models/model.pth').exists()
    learn = tu_synth_learner(n_trn=2, path=Path.cwd()/'tmp')
    quiet(learn.fit, n_epoch=2, cbs=SaveModelCallback(fname='end',at_end=True))
    assert (Path.cwd()/'tmp/models/end.pth').exists()
    quiet(learn.fit, n_epoch=2, cbs=SaveModelCallback(every_epoch=True))
    for i in range(2): assert (Path.cwd()/f'tmp/models/model_{i}.pth').exists()
    shutil.rmtree(Path.cwd()/'tmp')
    quiet(learn.fit, n_epoch=4, cbs=SaveModelCallback(every_epoch=2))
    for i in range(4):
        if not i%2: assert (Path.cwd()/f'tmp/models/model_{i}.pth').exists()
        else:       assert not (Path.cwd()/f'tmp/models/model_{i}.pth').exists()
    shutil.rmtree(Path.cwd()/'tmp')

def test_reduce_lr_on_plateau():
    learn = tu_synth_learner(n_trn=2)
    out = quiet(learn.fit, n_epoch=4, lr=1e-7, cbs=ReduceLROnPlateau(monitor='valid_loss', min_delta=0.1, patience=2))
    assert 'Epoch 2: reducing lr to 1e-08' in out, out # The notebook's output
    test_eq(learn.opt.hypers[-1]['lr'], 1e-8)

    learn = tu_synth_learner(n_trn=2)
    out = quiet(learn.fit, n_epoch=6, lr=5e-8, cbs=ReduceLROnPlateau(monitor='valid_loss', min_delta=0.1, patience=2, min_lr=1e-8))
    assert 'Epoch 2: reducing lr to 1e-08' in out, out
    test_eq(learn.opt.hypers[-1]['lr'], 1e-8)

# --- nbs/18a_callback.training.ipynb --------------------------------------------------------------------------------

def test_short_epoch():
    learn = tu_synth_learner()
    quiet(learn.fit, 1, cbs=ShortEpochCallback())
    learn = tu_synth_learner()
    quiet(learn.fit, 1, cbs=ShortEpochCallback(short_valid=False))

class GetGrads(Callback):
    run_valid,order = False,GradientAccumulation.order+1
    def before_step(self): self.grads=to_detach(L([p.grad.clone() for p in self.model.parameters()]))

def _test_acc(bs,n,cbs=None,cuda=False):
    with no_random(99):
        db=tu.synth_dbunch(bs=bs,n_train=n,n_valid=n,cuda=cuda)
        learn = tu_synth_learner(data=db,cbs=[GetGrads]+L(cbs))
        quiet(learn.fit, 1, lr=0.01)
        train,valid = learn.recorder.values[-1]
        return train,valid,learn.get_grads.grads

def test_gradient_accumulation():
    acc_cb = GradientAccumulation(n_acc=8)

    train1,valid1,grads1 = _test_acc(8,1)
    train2,valid2,grads2 = _test_acc(1,8,acc_cb)

    #grads should be same, valid loss same, train loss different
    test_close(grads2,grads1)
    test_close(valid2, valid1)
    test_ne(train2, train1)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="#cuda cell: GradientAccumulation with MixedPrecision on the GPU")
def test_gradient_accumulation_fp16():
    acc_cb = GradientAccumulation(n_acc=8)
    fp16_cb = MixedPrecision(init_scale=1024)
    train1,valid1,grads1 = _test_acc(8,1, fp16_cb, cuda=True)
    train2,valid2,grads2 = _test_acc(1,8, [acc_cb,fp16_cb], cuda=True)
    test_close(grads2,grads1, eps=0.01)
    test_close(valid2, valid1)
    test_ne(train2, train1)

def test_gradient_accumulation_more_than_batches():
    "When the number of steps per accumulation is higher than the number of batches, the parameters don't change at all"
    learn = tu_synth_learner()
    quiet(learn.fit, 1, lr=0.01, cbs=GradientAccumulation(n_acc=1000))
    # ensure valid_loss didn't change
    assert learn.recorder.values[-1][1] == learn.recorder.values[0][1]

def test_gradient_clip():
    "The notebook's cells (lr=1.1, with and without `GradientClip`) show losses only; the clipped norm is checked here"
    class GradNorm(Callback):
        order = GradientClip.order+1
        def before_fit(self): self.norms = []
        def before_step(self): self.norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters()])).item())

    set_seed(99)
    learn = tu_synth_learner(lr=1.1, cuda=True)
    norm = GradNorm()
    quiet(learn.fit, 3, cbs=[GradientClip, norm])
    assert norm.norms and max(norm.norms) <= 1 + 1e-5, norm.norms

@pytest.mark.skipif(not torch.cuda.is_available(), reason="The notebook's cells train with MixedPrecision (fp16) on the GPU")
def test_gradient_clip_fp16():
    fp16 = MixedPrecision()
    set_seed(99)
    learn = tu_synth_learner(lr=1.1, cuda=True)
    quiet(learn.fit, 3, cbs=fp16)
    set_seed(99)
    learn = tu_synth_learner(lr=1.1, cuda=True)
    quiet(learn.fit, 3, cbs=[GradientClip,fp16])

@pytest.mark.skip(reason="#slow cells: download MNIST_TINY and a pretrained resnet18 (test_bn_freeze ports them to small local data)")
def test_bn_freeze_mnist_resnet18(): pass

def _bn_learner(cbs=None):
    "The BnFreeze cells' learner, without the download: a small BatchNorm CNN on random 1×8×8 images, frozen, `train_bn=False`"
    from conftest import bn_cnn, body_head_splitter
    with no_random(0):
        x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 2, (64,))
        dls = DataLoaders.from_dsets(TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:]), bs=16)
        learn = Learner(dls, bn_cnn(2), loss_func=nn.CrossEntropyLoss(), splitter=body_head_splitter, train_bn=False,
                        cbs=compiled_cbs(cbs))
    learn.freeze() # cnn_learner(pretrained=True) returns it frozen
    return learn

def test_bn_freeze():
    learn1 = _bn_learner()
    m = learn1.model[0][1].running_mean.clone()
    quiet(learn1.fit, 1, lr=0.02)
    test_ne(to_detach(learn1.model[0][1].running_mean), m)

    learn1 = _bn_learner(cbs=BnFreeze)
    m = learn1.model[0][1].running_mean.detach().clone()
    quiet(learn1.fit, 1, lr=0.02)
    test_eq(to_detach(learn1.model[0][1].running_mean), m)
