"""fastai's training loop runs on a compiled Learner as it does eagerly

The core of this file is one differential harness: `twin_fits` runs the same seeded work on an eager Learner and on the
same Learner compiled, with a `Spy` callback that records what fastai's callbacks can see at every event of the loop
(inputs, targets, predictions, losses, gradients, parameters, optimizer hyper-parameters and state, smoothed loss,
Recorder logs, counters, training flags), and asserts that both saw the same, within a stated tolerance, and printed the
same. The tests run it over several kinds of Learner and fastai's entry points, then check the loop's contracts that a
comparison with eager alone can't show: the events and counters fastai defines, gradients in closed form, frozen
parameter groups, cancelled batches and fits, hooks, accumulation and clipping, saving and loading.
"""
import io, math, re, warnings
from contextlib import redirect_stdout
from dataclasses import dataclass
from functools import partial

import numpy as np, pytest, torch
import torch.nn.functional as F
from torch import nn, Tensor
from torch.utils.data import TensorDataset, DataLoader as TorchDataLoader
from fastai.callback.core import Callback, CancelBatchException, CancelBackwardException, CancelStepException, \
    CancelTrainException, CancelValidException, CancelFitException
from fastai.data.core import DataLoaders, TfmdDL
from fastai.learner import Learner
from fastai.losses import MSELossFlat, BCEWithLogitsLossFlat
from fastai.metrics import mae, accuracy
from fastai.optimizer import SGD, Adam, OptimWrapper
from fastai.torch_core import set_seed, find_bs, find_device, params
from fastcore.foundation import L
from fastai.callback.hook import HookCallback, ActivationStats, layer_info, model_sizes, num_features_model
from fastai.callback.schedule import * # fit_one_cycle, lr_find
from fastai.callback.tracker import TerminateOnNaNCallback, EarlyStoppingCallback, ReduceLROnPlateau, SaveModelCallback
from fastai.callback.training import ShortEpochCallback, GradientAccumulation, GradientClip, BnFreeze
from fastai.learner import Recorder
from fastai.tabular.learner import tabular_learner
from fastxtend_compile import *
from conftest import digits_dls, cancer_dls, text_dls, bn_cnn, body_head_splitter, EAGER_PRECISION, GRAD_TOL, MOVED_TOL, \
    assert_close_to

# --- Tolerances ------------------------------------------------------------------------------------------------------

# A compiled fit differs from eager only where it rounds float32 in another order: `aot_eager` runs eager's own ATen
# kernels on a traced graph whose backward may sum in another order; inductor writes fused C++ kernels of its own. Such
# rounding errs relative to the magnitudes summed, not to each result, which cancellation can bring near zero, and a
# weight's error grows with the steps that moved it. So a fit's tensors are compared whole, never element by element:
# - a weight (the records' `params`, `params_at_step` and `state`): its distance from eager's is at most `MOVED` of how
#   far eager's moved from where the fit began, and nothing where eager's didn't move;
# - any other tensor (predictions, losses, gradients, the optimizer's averages): its distance from eager's is at most
#   `rtol` of eager's norm, plus `atol` for each element in root-mean-square.
# Over this file's fits (CPU, torch 2.15 on a 2-core AMD EPYC) a weight ended at most 2.0e-6 of its path from eager's
# with `aot_eager` and 3.2e-6 with inductor, a fiftieth of `MOVED` or less; any other tensor 2.2e-6 of its norm, a ninth
# of `rtol`. One step of a fit's ten taken 1% longer put a weight 1.2e-3 to 1.6e-3 of its path from eager's: six times
# `MOVED` and more
AOT_TOL = dict(rtol=2e-5, atol=2e-6)
INDUCTOR_TOL = dict(rtol=1e-4, atol=1e-5)
MOVED = dict(aot_eager=1e-4, inductor=2e-4)
# On a CUDA GPU the compiled graph may run other kernels than eager's even with `aot_eager` (cuDNN picks its own)
if torch.cuda.is_available(): AOT_TOL, INDUCTOR_TOL, MOVED = GRAD_TOL, GRAD_TOL, dict(aot_eager=MOVED_TOL, inductor=MOVED_TOL)

# --- The spy ---------------------------------------------------------------------------------------------------------

def snap(o):
    "A copy of `o` that later events can't change: tensors detached onto the CPU (keeping their fastai type), containers copied"
    if isinstance(o, Tensor): return o.detach().cpu().clone()
    if isinstance(o, np.ndarray): return torch.from_numpy(o.copy())
    if isinstance(o, dict): return {k: snap(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, L)): return [snap(v) for v in o]
    return o

def ran_compiled(t:Tensor)->bool:
    "Whether the autograd graph behind `t` holds a compiled graph's backward (torch names its node `CompiledFunctionBackward`)"
    todo, seen = [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen: continue
        if 'CompiledFunction' in type(fn).__name__: return True
        seen.add(fn)
        todo += [f for f, _ in fn.next_functions]
    return False

def _grads(learn): return [p.grad for p in learn.model.parameters()]
def _params(learn): return list(learn.model.parameters())
def _opt_state(learn): return None if learn.opt is None else learn.opt.state_dict()

# What each event adds to the counters and flags every record has: the values fastai's callbacks read or change there
SEEN = dict(
    before_batch    = lambda l: dict(xb=l.xb, yb=l.yb, on_model_device=find_device(l.xb) == next(l.model.parameters()).device),
    after_pred      = lambda l: dict(pred=l.pred, ran_compiled=l.training and ran_compiled(l.pred)),
    after_loss      = lambda l: dict(loss=getattr(l, 'loss', None), loss_grad=getattr(l, 'loss_grad', None)),
    before_backward = lambda l: dict(loss_grad=l.loss_grad),
    after_backward  = lambda l: dict(grads=_grads(l)),
    before_step     = lambda l: dict(grads=_grads(l), hypers=[dict(h) for h in l.opt.hypers]),
    after_step      = lambda l: dict(params=_params(l), grads=_grads(l)),
    after_batch     = lambda l: dict(loss=getattr(l, 'loss', None), smooth_loss=l.smooth_loss, grads=_grads(l),
                                     losses=l.recorder.losses[-1:], lrs=l.recorder.lrs[-1:]),
    after_train     = lambda l: dict(log=l.recorder.log),
    after_validate  = lambda l: dict(log=l.recorder.log),
    after_epoch     = lambda l: dict(values=l.recorder.values[-1:]),
    after_fit       = lambda l: dict(state=l.model.state_dict(), opt_state=_opt_state(l)),
)
COUNTERS = ('epoch', 'n_epoch', 'iter', 'n_iter', 'train_iter', 'pct_train')
NOT_COMPARED = {'ran_compiled'} # Differs by design: it says which arm ran compiled

class Spy(Callback):
    "Records, at every event of every fit, what fastai's callbacks can see there"
    order = Recorder.order + 1 # After the Recorder has smoothed the loss and logged, before the progress bar and trackers
    def __init__(self): self.records = []
    def __call__(self, event_name):
        res = super().__call__(event_name)
        l = self.learn
        rec = dict(event=event_name, training=getattr(l, 'training', None), model_training=l.model.training,
                   **{k: getattr(l, k, None) for k in COUNTERS})
        rec.update(snap(SEEN.get(event_name, lambda l: {})(l)))
        self.records.append(rec)
        return res

# --- Comparing an eager and a compiled run ---------------------------------------------------------------------------

_TIME = re.compile(r'\d\d:\d\d')

def assert_same(c, e, tol:dict, where:str, start=None, moved:float=0.):
    "Compiled `c` equals eager `e`: the same structure and types, tensors and floats within `tol` (weights whose `start` is given, `moved`), everything else exactly"
    if isinstance(e, Tensor):
        assert type(c) is type(e), f"{where}: {type(c).__name__}, eager {type(e).__name__}"
        assert c.shape == e.shape, f"{where}: shape {tuple(c.shape)}, eager {tuple(e.shape)}"
        assert_close_to(c.as_subclass(Tensor), e.as_subclass(Tensor), tol, where, start, moved)
    elif isinstance(e, dict):
        assert isinstance(c, dict) and c.keys() == e.keys(), f"{where}: keys {list(c)} , eager {list(e)}"
        for k in e:
            if k not in NOT_COMPARED: assert_same(c[k], e[k], tol, f"{where}.{k}", start.get(k) if isinstance(start, dict) else None, moved)
    elif isinstance(e, (list, tuple)):
        assert isinstance(c, (list, tuple)) and len(c) == len(e), f"{where}: {c!r}, eager {e!r}"
        for i, (a, b) in enumerate(zip(c, e)): assert_same(a, b, tol, f"{where}[{i}]", start[i] if isinstance(start, list) and i < len(start) else None, moved)
    elif isinstance(e, float) and not isinstance(c, bool):
        assert isinstance(c, (float, int)) and (math.isclose(c, e, rel_tol=tol['rtol'], abs_tol=tol['atol']) or
                                                (math.isnan(c) and math.isnan(e))), f"{where}: {c!r}, eager {e!r}"
    elif isinstance(e, str) and _TIME.fullmatch(e): assert _TIME.fullmatch(c), f"{where}: {c!r}, eager {e!r}" # A time
    else: assert c == e, f"{where}: {c!r}, eager {e!r}"

_NUMBER = re.compile(r'-?\d+\.\d+(?:e[-+]?\d+)?|\bnan\b|-?\binf\b')

def _same_line(c:str, e:str, tol:dict)->bool:
    skeleton = lambda s: _NUMBER.sub('#', _TIME.sub('mm:ss', s))
    if skeleton(c) != skeleton(e): return False
    assert_same([float(n) for n in _NUMBER.findall(c)], [float(n) for n in _NUMBER.findall(e)], tol, f'printed {c!r}, eager {e!r}')
    return True

def assert_same_printed(c:str, e:str, tol:dict):
    "The compiled fit printed eager's lines, their times aside and numbers within `tol`, and besides only the library's notes of compiling"
    todo = e.splitlines()
    for line in c.splitlines():
        if todo and _same_line(line, todo[0], tol): todo.pop(0)
        else: assert 'compile' in line, f"the compiled fit printed {line!r}; eager printed:\n{e}"
    assert not todo, f"the compiled fit didn't print {todo[0]!r}; it printed:\n{c}"

def assert_same_records(c:list, e:list, tol:dict, start:dict|None=None, moved:float=0.):
    "Both fits ran the same events and saw the same values at each; the weights within `moved` of how far they moved from `start`"
    assert [r['event'] for r in c] == [r['event'] for r in e], "the compiled fit ran other events than eager"
    for i, (a, b) in enumerate(zip(c, e)):
        assert_same(a, b, tol, f"record {i} ({b['event']}, epoch {b['epoch']}, iter {b['iter']}, training {b['training']})", start, moved)

@dataclass
class Run:
    "One arm of `twin_fits`: its Learner, what the spy recorded, what it printed, what the work returned, the weights it began from"
    learn: Learner
    records: list
    printed: str
    result: object
    start: dict
    def compiled_batches(self)->list: return [r['ran_compiled'] for r in self.records if r['event'] == 'after_pred' and r['training']]

def run_arm(make, go, compile_kwargs:dict|None)->Run:
    set_seed(0) # The same model, data and splits in both arms
    learn = make()
    learn.add_cb(Spy())
    ps = snap(_params(learn))
    start = dict(params=ps, params_at_step=ps, state=snap(learn.model.state_dict()))
    if compile_kwargs is not None: learn.compile(**{**EAGER_PRECISION, **compile_kwargs})
    set_seed(1) # The same shuffles and dropout masks
    out = io.StringIO()
    with redirect_stdout(out), learn.no_bar(): result = go(learn)
    return Run(learn, learn.spy.records, out.getvalue(), snap(result), start)

def twin_fits(make, go, tol:dict=AOT_TOL, runs_compiled:bool=True, **compile_kwargs)->tuple:
    "Run `go(make())` eagerly and compiled (with `backend='aot_eager'` unless told), assert both saw and printed the same"
    eager = run_arm(make, go, None)
    compiled = run_arm(make, go, dict(backend='aot_eager') | compile_kwargs)
    assert_same_records(compiled.records, eager.records, tol, eager.start, MOVED[compile_kwargs.get('backend', 'aot_eager')])
    assert_same_printed(compiled.printed, eager.printed, tol)
    assert_same(compiled.result, eager.result, tol, 'result')
    assert not any(eager.compiled_batches())
    # The compiled arm really ran compiled: training batches' outputs come out of a compiled graph
    if runs_compiled: assert any(compiled.compiled_batches()), "no training batch of the compiled fit ran a compiled graph"
    return eager, compiled

# --- fastai's loop, as fastai defines it -----------------------------------------------------------------------------

TRAIN_BATCH = ['before_batch', 'after_pred', 'after_loss', 'before_backward', 'after_backward', 'before_step', 'after_step', 'after_batch']
VALID_BATCH = ['before_batch', 'after_pred', 'after_loss', 'after_batch']

def fit_events(n_epoch:int, n_train:int, n_valid:int)->list:
    "The events of an uninterrupted fit"
    epoch = ['before_epoch', 'before_train', *TRAIN_BATCH * n_train, 'after_train',
             'before_validate', *VALID_BATCH * n_valid, 'after_validate', 'after_epoch']
    return ['before_fit', *epoch * n_epoch, 'after_fit']

def check_loop(records:list, beta:float=0.98):
    "The counters, flags, devices, zeroed gradients and smoothed loss fastai's loop promises, at every event"
    train_iter, raw_smooth, k, valid, bs = 0, 0., 0, [], None
    for r in records:
        ev = r['event']
        if ev == 'before_fit': train_iter, raw_smooth, k = 0, 0., 0
        if ev in ('before_train', 'before_validate'): valid = []
        if ev == 'before_batch': assert r['on_model_device']; bs = find_bs(r['yb'])
        if ev in TRAIN_BATCH and r['training'] is not None:
            assert r['training'] == r['model_training'], r # The model's mode follows the loop's
        if ev == 'after_loss' and not r['training']: valid.append((r['loss'], bs))
        if ev == 'after_batch' and r['training']:
            train_iter += 1; k += 1
            assert r['train_iter'] == train_iter, r['train_iter']
            assert math.isclose(r['pct_train'], (r['epoch'] + (r['iter'] + 1) / r['n_iter']) / r['n_epoch'], rel_tol=1e-9)
            assert all(g is None or not g.any() for g in r['grads']), "gradients left after the batch"
            raw_smooth = torch.lerp(r['loss'].float(), torch.as_tensor(raw_smooth), beta)
            torch.testing.assert_close(r['smooth_loss'], raw_smooth / (1 - beta**k), rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(r['losses'][-1], r['smooth_loss'])
        if ev == 'after_validate' and valid: # The valid loss logged is the mean over items, however the batches split them
            mean = sum(l.double() * n for l, n in valid) / sum(n for _, n in valid)
            assert math.isclose(r['log'][2], mean.item(), rel_tol=1e-5), (r['log'], mean)

# --- Learners of several kinds ---------------------------------------------------------------------------------------

class LinearFit(nn.Module):
    "y = xW + b: a model whose loss gradients are known in closed form"
    def __init__(self, n_in=2): super().__init__(); self.lin = nn.Linear(n_in, 1)
    def forward(self, x): return self.lin(x)

def noisy_plane(n:int, seed:int)->TensorDataset:
    "Points on the plane y = 1.5 x₀ - 2 x₁ + 0.5, with a little noise"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.5], [-2.]]) + 0.5 + 0.1 * torch.randn(n, 1, generator=g))

def plane_dls(n_train=80, n_valid=40, bs=16, shuffle=True, torch_dl=False)->DataLoaders:
    "Five shuffled training batches; three validation batches, the last a half one, so batch sizes vary"
    train, valid = noisy_plane(n_train, 1), noisy_plane(n_valid, 2)
    if torch_dl: return DataLoaders(TorchDataLoader(train, bs, shuffle=shuffle, drop_last=True), TorchDataLoader(valid, bs))
    return DataLoaders(TfmdDL(train, bs=bs, shuffle=shuffle, drop_last=True), TfmdDL(valid, bs=bs))

def plane_learner(torch_dl=False, metrics=mae, **kwargs)->Learner:
    return Learner(plane_dls(torch_dl=torch_dl), LinearFit(), loss_func=MSELossFlat(), metrics=metrics, **kwargs)

class WordBag(nn.Module):
    "Mean of the tokens' embeddings, then a linear layer: a text classifier without recurrence"
    def __init__(self, n_vocab, n_out=2): super().__init__(); self.emb, self.out = nn.Embedding(n_vocab, 8), nn.Linear(8, n_out)
    def forward(self, x): return self.out(self.emb(x).mean(1))

def text_learner(**kwargs)->Learner:
    dls = text_dls()
    return Learner(dls, WordBag(len(dls.vocab[0])), metrics=accuracy, **kwargs)

LEARNERS = dict(
    plane = plane_learner,
    plane_torch_dataloader = partial(plane_learner, torch_dl=True), # Plain PyTorch DataLoaders: no fastai types
    digits = lambda **kw: Learner(digits_dls(bs=256), bn_cnn(), metrics=accuracy, splitter=body_head_splitter, **kw),
    # Dropout in both arms: aot_eager draws the masks from the same generator, in the same order
    cancer = lambda **kw: tabular_learner(cancer_dls(bs=128), layers=[16, 8], config=dict(ps=[0.2, 0.2]), metrics=accuracy, **kw),
    text = text_learner,
)

def fit(n_epoch, lr=1e-2, cb=None):
    "The work of a plain fit, with a fresh callback from `cb` in each arm"
    return lambda learn: learn.fit(n_epoch, lr, cbs=None if cb is None else cb())

# --- 1. The same fit, event by event ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('kind', list(LEARNERS))
def test_fit_sees_what_eager_sees(kind):
    "Every event of a compiled fit sees what eager's sees; both run fastai's events, counters and smoothed loss"
    eager, compiled = twin_fits(LEARNERS[kind], fit(2))
    for run in (eager, compiled):
        dls = run.learn.dls
        assert [r['event'] for r in run.records] == fit_events(2, len(dls.train), len(dls.valid))
        check_loop(run.records)
    assert [l[:3] for l in eager.printed.splitlines()] == ['[0,', '[1,'] # One log line per epoch

@pytest.mark.parametrize('opt_func', [partial(SGD, mom=0.9, wd=1e-2), partial(OptimWrapper, opt=torch.optim.AdamW),
                                      partial(Adam, wd=0.1, decouple_wd=False)],
                         ids=['sgd_momentum', 'torch_adamw', 'adam_l2'])
@pytest.mark.slow
def test_optimizers(opt_func):
    "fastai's optimizers and a wrapped PyTorch one step the compiled model as they step the eager one"
    eager, compiled = twin_fits(partial(plane_learner, opt_func=opt_func), fit(2))
    assert compiled.records[-1]['opt_state'] # Their state (momentum, Adam's averages) was compared at the end

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['plane', 'digits'])
def test_fit_one_cycle(kind):
    "The scheduled learning rate and momentum reach the compiled step, batch by batch"
    eager, compiled = twin_fits(LEARNERS[kind], lambda l: l.fit_one_cycle(2, 1e-2))
    lrs = [r['hypers'][-1]['lr'] for r in compiled.records if r['event'] == 'before_step']
    assert lrs[0] == pytest.approx(1e-2 / 25) and max(lrs) == pytest.approx(1e-2, rel=0.02) # Ten steps: one near the peak
    assert 0 < lrs.index(max(lrs)) < len(lrs) - 1 and lrs[-1] < max(lrs) / 10 # Up, then down

@pytest.mark.slow
@pytest.mark.parametrize('compile_frozen', [False, True])
def test_fine_tune(compile_frozen):
    "A frozen epoch then an unfrozen one, each compiled or eager as chosen, as eager fine-tunes"
    eager, compiled = twin_fits(LEARNERS['digits'], lambda l: l.fine_tune(1, 1e-2, compile_frozen=compile_frozen))
    fits = [[]]
    for r in compiled.records:
        fits[-1].append(r)
        if r['event'] == 'after_fit': fits.append([])
    frozen, unfrozen = fits[0], fits[1]
    # bn_cnn's parameters: body conv, BatchNorm weight and bias, conv weight and bias; then the head's linear layer
    frozen_steps = [r['params'] for r in frozen if r['event'] == 'after_step']
    body_convs = [0, 3, 4]
    for i in body_convs:
        assert all(torch.equal(p[i], frozen_steps[0][i]) for p in frozen_steps), f"frozen parameter {i} moved"
    assert not torch.equal(frozen_steps[0][1], frozen_steps[-1][1]) # BatchNorm trains while frozen (`train_bn`)
    last = [r['params'] for r in unfrozen if r['event'] == 'after_step'][-1]
    assert all(not torch.equal(last[i], frozen_steps[-1][i]) for i in body_convs), "unfrozen body didn't train"
    batches = [r['ran_compiled'] for r in frozen if r['event'] == 'after_pred' and r['training']]
    assert any(batches) == compile_frozen

def test_lr_find(tmp_path):
    "lr_find's mock training, its suggestion and the model it restores; then a fit from there"
    def go(learn):
        start = snap(learn.model.state_dict())
        found = learn.lr_find(num_it=20, show_plot=False)
        restored = snap(learn.model.state_dict())
        learn.fit(1, 1e-2)
        return dict(found=tuple(found), lrs=learn.recorder.lrs, start=start, restored=restored)
    eager, compiled = twin_fits(partial(plane_learner, path=tmp_path), go)
    for run in (eager, compiled):
        r = run.result
        assert all(torch.equal(r['restored'][k], v) for k, v in r['start'].items()), "lr_find didn't restore the model"
        events = [x['event'] for x in run.records]
        assert 'after_cancel_validate' in events and 'after_cancel_fit' in events # Its ways out of the loop ran
    lrs = [r['hypers'][-1]['lr'] for r in compiled.records if r['event'] == 'before_step'][:20]
    growth = (10 / 1e-7) ** (1 / 20) # From start_lr to end_lr in num_it steps, by the same factor each
    assert lrs[0] == pytest.approx(1e-7) and all(b / a == pytest.approx(growth) for a, b in zip(lrs, lrs[1:]))

# --- 2. Validation and predictions -----------------------------------------------------------------------------------

def predictions(learn):
    "What validate and get_preds give after a fit, in their several forms"
    learn.fit(1, 1e-2)
    return dict(valid=learn.validate(), train=learn.validate(dl=learn.dls.train),
                preds=learn.get_preds(with_input=True, with_loss=True, with_decoded=True),
                train_preds=learn.get_preds(ds_idx=0, act=torch.sigmoid))

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['plane', 'digits', 'cancer'])
def test_validate_and_get_preds(kind):
    "validate on either DataLoader, and get_preds with inputs, losses, decoded predictions and an activation, as eager's"
    eager, compiled = twin_fits(LEARNERS[kind], predictions)
    inputs, preds, targs, decoded, losses = compiled.result['preds']
    assert len(preds) == len(targs) == len(losses) == len(compiled.learn.dls.valid_ds)
    # The validation loss is the mean of the per-item losses
    assert math.isclose(losses.mean().item(), compiled.result['valid'][0], rel_tol=1e-5)

def test_get_preds_of_other_dataloaders():
    "Uneven, shuffled, unlabelled data, and the activation a loss function brings, as eager's model predicts them"
    def go(learn):
        learn.fit(1, 1e-2)
        x = torch.randn(70, 2)
        y = 2 * x[:, :1] - 1
        res = dict(uneven=learn.get_preds(dl=TfmdDL(TensorDataset(x, y), bs=16)), # A last batch of 6
                   shuffled=learn.get_preds(dl=TfmdDL(TensorDataset(x, y), bs=16, shuffle=True)),
                   unlabelled=learn.get_preds(dl=TfmdDL(TensorDataset(x), bs=16)))
        learn.loss_func = BCEWithLogitsLossFlat()
        res['sigmoid'] = learn.get_preds(dl=TfmdDL(TensorDataset(x, (y > 0).float()), bs=16))
        with torch.no_grad(): res['model'] = learn.model(x) # Called directly, compiled in the compiled arm
        return res, x, y
    eager, compiled = twin_fits(plane_learner, go)
    for run in (eager, compiled):
        res, x, y = run.result
        with torch.no_grad(): direct = eager.learn.model.eval()(x) # Eager's model, applied to all items at once
        for k in ('uneven', 'shuffled'):
            torch.testing.assert_close(res[k][0], direct, **AOT_TOL)
            assert torch.equal(res[k][1], y) # In the dataset's order, though shuffled
        assert res['unlabelled'][1] is None
        torch.testing.assert_close(res['sigmoid'][0], torch.sigmoid(direct), **AOT_TOL)
        torch.testing.assert_close(res['model'], direct, **AOT_TOL)

class TwoInTwoOut(nn.Module):
    "A model of two inputs, whose loss takes two targets"
    def __init__(self): super().__init__(); self.a, self.b = nn.Linear(2, 1), nn.Linear(2, 1)
    def forward(self, x1, x2): return self.a(x1) + self.b(x2)

def two_target_loss(pred, y1, y2): return F.mse_loss(pred, y1) + 0.5 * F.l1_loss(pred, y2)

def test_several_inputs_and_targets():
    "A model of two inputs and a loss of two targets: batches split and predictions gathered as eager's"
    def make():
        x1, x2, y = torch.randn(48, 2), torch.randn(48, 2), torch.randn(48, 1)
        ds = TensorDataset(x1, x2, y, y.sign())
        dls = DataLoaders(TfmdDL(ds, bs=16, shuffle=True), TfmdDL(ds, bs=16))
        dls.n_inp = 2
        return Learner(dls, TwoInTwoOut(), loss_func=two_target_loss)
    def go(learn):
        learn.fit(1, 1e-2)
        return learn.get_preds(with_input=True)
    eager, compiled = twin_fits(make, go)
    inputs, preds, targs = compiled.result
    assert len(inputs) == 2 and len(targs) == 2
    assert all(len(r['xb']) == 2 and len(r['yb']) == 2 for r in compiled.records if r['event'] == 'before_batch')

def test_predict_and_tta():
    "predict, through the loss function's activation and decodes, and tta give eager's results"
    def go(learn):
        learn.fit(1, 1e-2)
        item = learn.dls.valid_ds[3][0]
        return learn.predict(item), learn.tta(n=2)
    eager, compiled = twin_fits(LEARNERS['digits'], go)
    (label, idx, probs), (tta_preds, tta_targs) = compiled.result
    assert label == str(compiled.learn.dls.vocab[idx]) and math.isclose(probs.sum().item(), 1, rel_tol=1e-6)
    assert tta_preds.shape == (len(compiled.learn.dls.valid_ds), 10)

# --- 3. Callbacks that change the loop -------------------------------------------------------------------------------

class Meddler(Callback):
    "Changes inputs, targets, predictions and the loss to back-propagate; cancels a batch, a backward, a step, an epoch's parts, the fit"
    order = Recorder.order - 1 # Before the Spy, which so sees what the loop goes on with
    def before_batch(self):
        if (self.epoch, self.iter) == (1, 2): raise CancelTrainException()
        if (self.epoch, self.iter) == (2, 1): raise CancelFitException()
        self.learn.xb = (self.xb[0] * 2,)
        self.learn.yb = (self.yb[0] + 1,)
    def after_pred(self): self.learn.pred = self.pred * 0.5
    def after_loss(self):
        if not self.training: return
        self.learn.loss_grad = self.loss_grad * 3
        if (self.epoch, self.iter) == (0, 1): raise CancelBatchException()
    def before_backward(self):
        if (self.epoch, self.iter) == (0, 2): raise CancelBackwardException()
    def before_step(self):
        if (self.epoch, self.iter) == (0, 3): raise CancelStepException()
    def before_validate(self):
        if self.epoch == 1: raise CancelValidException()

class ParamsAtStep(Callback):
    "Adds the parameters the step starts from to the Spy's record of `before_step`"
    order = Spy.order + 1
    def before_step(self): self.spy.records[-1]['params_at_step'] = snap(_params(self.learn))

def test_callbacks_change_what_the_compiled_loop_computes():
    "What callbacks write into the Learner, and the exceptions they raise, steer the compiled fit as they steer eager's"
    make = lambda: plane_learner(opt_func=SGD, cbs=[Meddler(), ParamsAtStep()])
    eager, compiled = twin_fits(make, fit(4, 0.05))
    check_loop(compiled.records)
    events = [r['event'] for r in compiled.records]
    for cancelled in ('batch', 'backward', 'step', 'train', 'validate', 'fit'):
        assert f'after_cancel_{cancelled}' in events, cancelled
    assert events.count('before_epoch') == 3 # The fourth epoch never began
    batches = {}
    for r in compiled.records:
        if r['training'] and r['event'] in TRAIN_BATCH: batches.setdefault((r['epoch'], r['iter']), {})[r['event']] = r
    assert 'before_backward' not in batches[(0, 1)] and 'before_step' not in batches[(0, 1)] # Cancelled after its loss
    assert (2, 1) not in batches and (1, 2) not in batches
    for (epoch, i), ev in batches.items():
        if 'before_step' not in ev: continue
        grads, before, after = ev['after_backward']['grads'], ev['before_step']['params_at_step'], ev['after_step']['params']
        if (epoch, i) == (0, 2): assert not any(g.any() for g in grads) # No backward: nothing to step with
        else:
            # The gradients of the loss the callbacks made, 3 × MSE(0.5 × model(2x), y + 1), worked out by hand
            x, y, pred = ev['before_batch']['xb'][0], ev['before_batch']['yb'][0], ev['after_pred']['pred']
            dpred = 3 * 2 * (pred - y) / len(y) * 0.5 # d(loss)/d(model output)
            torch.testing.assert_close(grads[0], dpred.T @ x, **AOT_TOL)
            torch.testing.assert_close(grads[1], dpred.sum(0), **AOT_TOL)
        for p0, g, p1 in zip(before, grads, after): # Plain SGD, or no step where it was cancelled
            torch.testing.assert_close(p1, p0 if (epoch, i) == (0, 3) else p0 - 0.05 * g, **AOT_TOL)

def test_one_batch_by_hand():
    "`one_batch` driven by hand on a compiled Learner sets `x`, `y`, `pred` and `loss`, and steps as eager does"
    def go(learn):
        learn.fit(1, 1e-2) # Makes the optimizer, and compiles the model in the compiled arm
        learn.training = True
        learn.model.train()
        b = learn.dls.one_batch()
        learn.one_batch(7, b)
        with torch.no_grad(): out = learn.model(b[0])
        return dict(x=learn.x, y=learn.y, pred=learn.pred, loss=learn.loss, b=b, out=out)
    eager, compiled = twin_fits(partial(plane_learner, opt_func=SGD), go)
    r = compiled.result
    assert torch.equal(r['x'], r['b'][0]) and torch.equal(r['y'], r['b'][1])
    assert [x['event'] for x in compiled.records[-len(TRAIN_BATCH):]] == TRAIN_BATCH and compiled.records[-1]['iter'] == 7
    torch.testing.assert_close(r['loss'], F.mse_loss(r['pred'], r['y']), **AOT_TOL)

# --- 4. Freezing, weight decay, accumulation, clipping ---------------------------------------------------------------

class GradsToOnes(Callback):
    "Sets every trainable parameter's gradient to ones before the step: each then moves by exactly -lr per step"
    order = Recorder.order - 1
    def before_step(self):
        for p in self.learn.model.parameters():
            if p.requires_grad: p.grad = torch.ones_like(p)

def three_groups(m): return [params(m[0]), params(m[1]), params(m[2])]

def grouped_learner(**kwargs):
    "Linear, BatchNorm, linear: one parameter group each"
    return Learner(plane_dls(), nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)), loss_func=MSELossFlat(),
                   splitter=three_groups, opt_func=SGD, cbs=GradsToOnes(), **kwargs)

@pytest.mark.slow
@pytest.mark.parametrize('train_bn', [True, False])
def test_freeze_freeze_to_unfreeze(train_bn):
    "freeze, freeze_to and unfreeze choose the parameter groups a compiled fit trains, BatchNorm's as `train_bn` says"
    def go(learn):
        moved = []
        for change in (learn.freeze, partial(learn.freeze_to, -2), learn.unfreeze):
            change()
            start = [p.detach().clone() for p in learn.model.parameters()]
            learn.fit(1, 1e-2, wd=0.)
            moved.append([(p.detach() - s) for p, s in zip(learn.model.parameters(), start)])
        return moved
    eager, compiled = twin_fits(partial(grouped_learner, train_bn=train_bn), go)
    n_steps = len(compiled.learn.dls.train)
    # Groups trained: frozen → the last (and BatchNorm's if train_bn); freeze_to(-2) → the last two; unfrozen → all
    trains = [[False, train_bn, True], [False, True, True], [True, True, True]]
    for moved, groups in zip(compiled.result, trains):
        for delta, trained in zip(moved, [g for g in groups for _ in range(2)]): # A weight and a bias in each group
            torch.testing.assert_close(delta, torch.full_like(delta, -1e-2 * n_steps) if trained else torch.zeros_like(delta),
                                       rtol=1e-5, atol=1e-6)

def test_weight_decay_spares_biases_and_batchnorm():
    "With `wd_bn_bias=False`, decoupled weight decay shrinks only the weights of linear layers"
    def go(learn):
        start = [p.detach().clone() for p in learn.model.parameters()]
        learn.fit(1, 1e-2, wd=1.)
        return [p.detach() - s for p, s in zip(learn.model.parameters(), start)]
    eager, compiled = twin_fits(grouped_learner, go)
    n_steps = len(compiled.learn.dls.train)
    names = [n for n, _ in compiled.learn.model.named_parameters()]
    for name, delta in zip(names, compiled.result):
        plain = torch.full_like(delta, -1e-2 * n_steps)
        if name in ('0.weight', '2.weight'): assert not torch.allclose(delta, plain, rtol=1e-3), name # Decayed too
        else: torch.testing.assert_close(delta, plain, rtol=1e-5, atol=1e-6, msg=name)

@pytest.mark.slow
def test_gradient_accumulation():
    "Two batches of 16 accumulated step as one batch of 32 does; more items than the fit has leave the model as it was"
    ordered = lambda bs: lambda: Learner(plane_dls(n_train=64, bs=bs, shuffle=False), LinearFit(), loss_func=MSELossFlat(), opt_func=SGD)
    _, accumulated = twin_fits(ordered(16), fit(2, 0.1, partial(GradientAccumulation, n_acc=32)))
    _, whole = twin_fits(ordered(32), fit(2, 0.1))
    assert [r['event'] for r in accumulated.records].count('after_step') == 4 # Every second batch of four, two epochs
    assert_same(accumulated.records[-1]['state'], whole.records[-1]['state'], AOT_TOL, 'accumulated, against whole batches')
    _, never = twin_fits(ordered(16), fit(1, 0.1, partial(GradientAccumulation, n_acc=10_000)))
    assert 'after_step' not in [r['event'] for r in never.records]
    init = snap(run_arm(ordered(16), lambda l: None, None).learn.model.state_dict())
    assert_same(never.records[-1]['state'], init, dict(rtol=0, atol=0), 'after no step')

def test_gradient_clip():
    "GradientClip scales the compiled backward's gradients to its norm before the step"
    # With SGD: Adam divides by a gradient's running root mean square, and would turn the rounding of a tiny gradient
    # into a whole step of its weight
    eager, compiled = twin_fits(partial(LEARNERS['digits'], opt_func=SGD), fit(1, 0.5, partial(GradientClip, max_norm=0.1)))
    norm = lambda grads: torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    raw = [norm(r['grads']) for r in compiled.records if r['event'] == 'after_backward']
    clipped = [norm(r['grads']) for r in compiled.records if r['event'] == 'before_step']
    assert max(raw) > 0.1 and max(clipped) <= 0.1 * (1 + 1e-5), (raw, clipped)

@pytest.mark.slow
def test_bn_freeze():
    "A frozen body's BatchNorm keeps its running statistics under `BnFreeze` (and updates them without it)"
    def make(): return LEARNERS['digits'](train_bn=False)
    def go(cb):
        def run(learn):
            learn.freeze()
            start = learn.model[0][1].running_mean.clone()
            learn.fit(1, 1e-2, cbs=cb())
            return start, learn.model[0][1].running_mean
        return run
    for cb, kept in ((BnFreeze, True), (lambda: None, False)):
        _, compiled = twin_fits(make, go(cb))
        start, end = compiled.result
        assert torch.equal(start, end) == kept

# --- 5. Hooks --------------------------------------------------------------------------------------------------------

class KeepHooked(HookCallback):
    "What its hooks stored, at each training batch"
    def __init__(self, **kwargs): super().__init__(**kwargs); self.seen = []
    def hook(self, m, i, o): return o
    def after_batch(self):
        if self.training: self.seen.append(snap(self.hooks.stored))

@pytest.mark.slow
def test_hooks_see_what_eager_hooks_see():
    "Forward and backward hooks and ActivationStats during a compiled fit; the fit after them runs compiled again"
    def go(learn):
        head = learn.model[1][2]
        fwd, bwd, stats = KeepHooked(modules=[head]), KeepHooked(modules=[head], is_forward=False), ActivationStats(every=2)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore') # The library's notice that hooked models run eagerly
            learn.fit(1, 1e-2, cbs=[fwd, bwd, stats])
        learn.fit(1, 1e-2)
        return fwd.seen, bwd.seen, stats.stats
    eager, compiled = twin_fits(LEARNERS['digits'], go)
    fwd, bwd, stats = compiled.result
    n_train = len(compiled.learn.dls.train)
    preds = [r['pred'] for r in compiled.records if r['event'] == 'after_pred' and r['training']][:n_train]
    ys = [r['yb'][0] for r in compiled.records if r['event'] == 'before_batch' and r['training']][:n_train]
    for out, grad_out, pred, y in zip(fwd, bwd, preds, ys):
        torch.testing.assert_close(out[0], pred.as_subclass(Tensor), **AOT_TOL) # The head's output is the prediction
        # Cross-entropy's gradient with respect to the logits: (softmax - one-hot) / batch size
        expected = (pred.as_subclass(Tensor).softmax(1) - F.one_hot(y.as_subclass(Tensor), 10)) / len(y)
        torch.testing.assert_close(grad_out[0][0], expected, **AOT_TOL)
    assert len(fwd) == len(bwd) == n_train and len(stats) == math.ceil(n_train / 2) # Every second batch
    second_fit = compiled.compiled_batches()[n_train:]
    assert any(second_fit), "the fit after the hooks were removed ran eagerly"

# --- 6. Trackers, cancelled fits, saving and loading -----------------------------------------------------------------

def test_terminate_on_nan():
    "A diverging fit ends with CancelFitException at its first non-finite loss, as eager's does"
    eager, compiled = twin_fits(partial(plane_learner, opt_func=SGD), fit(5, 1e15, TerminateOnNaNCallback))
    events = [r['event'] for r in compiled.records]
    assert events[-2:] == ['after_cancel_fit', 'after_fit'] and events.count('before_epoch') < 5
    losses = [r['loss'] for r in compiled.records if r['event'] == 'after_loss' and r['training']]
    assert all(torch.isfinite(l) for l in losses[:-1]) and not torch.isfinite(losses[-1])

def test_early_stopping():
    "EarlyStoppingCallback stops a compiled fit that doesn't improve at the epoch eager's stops, and says so"
    eager, compiled = twin_fits(plane_learner, fit(50, 1e-7, partial(EarlyStoppingCallback, monitor='valid_loss', min_delta=0.1, patience=2)))
    assert 'No improvement since epoch 0: early stopping' in compiled.printed
    assert [r['event'] for r in compiled.records].count('after_epoch') == 3

@pytest.mark.slow
def test_reduce_lr_on_plateau_reaches_the_compiled_step():
    "The learning rate a tracker lowers mid-fit is the one the compiled optimizer steps with"
    cb = lambda: ReduceLROnPlateau(monitor='valid_loss', min_delta=10, patience=1, factor=10)
    eager, compiled = twin_fits(partial(plane_learner, opt_func=SGD), lambda l: l.fit(4, 0.05, cbs=cb()))
    assert 'Epoch 1: reducing lr to 0.005' in compiled.printed and 'Epoch 2: reducing lr to 0.0005' in compiled.printed
    lrs = [r['hypers'][-1]['lr'] for r in compiled.records if r['event'] == 'before_step']
    n = len(compiled.learn.dls.train)
    assert lrs[2*n:3*n] == [pytest.approx(5e-3)] * n

@pytest.mark.filterwarnings("ignore:Saved file doesn't contain an optimizer state")
def test_save_model_callback(tmp_path):
    "SaveModelCallback saves the compiled model at each epoch, the last as the fit ended it, in files an eager Learner loads"
    def go(learn):
        learn.fit(3, 1e-2, cbs=SaveModelCallback(every_epoch=True))
        return sorted(p.name for p in (tmp_path/'models').iterdir())
    eager, compiled = twin_fits(partial(plane_learner, path=tmp_path), go)
    assert compiled.result == ['model_0.pth', 'model_1.pth', 'model_2.pth']
    reader = plane_learner(path=tmp_path).load('model_2')
    assert_same(snap(reader.model.state_dict()), compiled.records[-1]['state'], dict(rtol=0, atol=0), 'loaded')

@pytest.mark.parametrize('with_opt', [True, False])
def test_save_and_load_between_eager_and_compiled(tmp_path, with_opt):
    "A compiled Learner saves the plain model's state (and its optimizer's), which eager and compiled Learners load exactly"
    def go(learn):
        learn.fit(1, 1e-2)
        learn.save('fitted', with_opt=with_opt)
        return torch.load(tmp_path/'models'/'fitted.pth', weights_only=False)
    eager, compiled = twin_fits(partial(plane_learner, path=tmp_path), go)
    saved = compiled.result if with_opt else dict(model=compiled.result)
    assert list(saved['model']) == ['lin.weight', 'lin.bias'] # The plain model's names, nothing of the compiler's
    for reader_compiled in (False, True): # The compiled Learner's file, loaded into an eager and a compiled Learner
        reader = plane_learner(path=tmp_path)
        if reader_compiled: reader.compile(backend='aot_eager')
        reader.create_opt()
        reader.load('fitted', with_opt=with_opt)
        assert_same(snap(reader.model.state_dict()), compiled.records[-1]['state'], dict(rtol=0, atol=0), 'loaded')
        if with_opt: assert_same(snap(reader.opt.state_dict()), compiled.records[-1]['opt_state'], dict(rtol=0, atol=0), 'opt')
        else: assert not reader.opt.state_dict()['state'][0] # A fresh optimizer's: nothing was saved

def test_short_epochs():
    "ShortEpochCallback cancels training, then validation, part way"
    eager, compiled = twin_fits(LEARNERS['digits'], fit(2, 1e-2, partial(ShortEpochCallback, pct=0.5)))
    events = [r['event'] for r in compiled.records]
    assert events.count('after_cancel_train') == events.count('after_cancel_validate') == 2

# --- 7. The Learner around the compiled model ------------------------------------------------------------------------

def test_recorder_names_metrics_and_plots():
    "Train metrics, a metric returning NumPy, no time column: names and values as eager's; no_logging prints nothing"
    import matplotlib; matplotlib.use('Agg')
    def np_mse(pred, targ): return F.mse_loss(pred, targ).detach().numpy()
    def go(learn):
        learn.recorder.train_metrics, learn.recorder.add_time = True, False
        learn.fit(2, 1e-2)
        with learn.no_logging():
            quiet = io.StringIO()
            with redirect_stdout(quiet): learn.fit(1, 1e-2)
        learn.recorder.plot_loss(skip_start=1)
        return learn.recorder.metric_names, learn.recorder.values, quiet.getvalue()
    eager, compiled = twin_fits(partial(plane_learner, metrics=[mae, np_mse]), go)
    names, values, quiet = compiled.result
    assert names == ['epoch', 'train_loss', 'train_mae', 'train_np_mse', 'valid_loss', 'valid_mae', 'valid_np_mse']
    assert quiet == '' and len(values) == 1 # The last fit's epoch

def compiler_cbs(learn): return [cb for cb in learn.cbs if isinstance(cb, CompilerCallback)]

def test_compiler_among_the_callbacks():
    "Compiling twice keeps one CompilerCallback, run by its order; removed for a while, the Learner fits eagerly"
    learn = plane_learner(cbs=Spy())
    learn.compile(backend='aot_eager').compile(backend='aot_eager')
    assert len(compiler_cbs(learn)) == 1
    learn.cbs = L(reversed(learn.cbs)) # Listed backwards: run by their order still
    names = [type(cb).__name__ for cb in learn.ordered_cbs('before_fit')]
    assert names.index('TrainEvalCallback') < names.index('CompilerCallback') < names.index('Recorder'), names
    out = io.StringIO()
    with redirect_stdout(out): learn.show_training_loop()
    assert re.search(r'before_fit\s*: \[TrainEvalCallback, [^]]*CompilerCallback', out.getvalue()), out.getvalue()
    spy = learn.spy
    with learn.no_bar(), learn.no_logging():
        with learn.removed_cbs(compiler_cbs(learn)): learn.fit(1)
        assert not any(r['ran_compiled'] for r in spy.records if r['event'] == 'after_pred')
        spy.records.clear()
        learn.fit(1)
    assert any(r['ran_compiled'] for r in spy.records if r['event'] == 'after_pred')

@pytest.mark.filterwarnings('ignore:.*registered hooks') # The library's notice that hooked models run eagerly
def test_summary_and_layer_info():
    "The summary, layer info and sizes of a compiled model are eager's; the summary lists the CompilerCallback"
    def go(learn):
        learn.fit(1, 1e-2)
        x = learn.dls.one_batch()[0][:1]
        return (learn.summary().split('Callbacks:')[0], layer_info(learn, x), model_sizes(learn.model, size=(8, 8)),
                num_features_model(learn.model))
    eager, compiled = twin_fits(LEARNERS['digits'], go) # The same table, layers and sizes
    assert 'Total params: 5,146' in compiled.result[0] and compiled.result[3] == 10
    listed = lambda run: run.learn.summary().split('Callbacks:')[1].splitlines()
    assert '  - CompilerCallback' in listed(compiled) and set(listed(eager)) <= set(listed(compiled))

# --- 8. inductor ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['plane', 'cancer'])
def test_inductor_fit_one_cycle(kind):
    "inductor's own kernels, through fit_one_cycle, get and print what eager does within `INDUCTOR_TOL`"
    make = LEARNERS[kind] if kind == 'plane' else lambda: tabular_learner(cancer_dls(bs=128), layers=[16, 8], metrics=accuracy)
    twin_fits(make, lambda l: l.fit_one_cycle(2, 1e-2), tol=INDUCTOR_TOL, backend='inductor')
