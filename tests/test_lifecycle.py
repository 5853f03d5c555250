"A compiled Learner through the fastai lifecycle behaves as the eager one"
import pytest, torch
from torch import nn, Tensor
from fastai.learner import Learner, AvgSmoothLoss
from fastai.callback.core import Callback
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.channelslast import ChannelsLast
from fastai.callback.training import GradientAccumulation
from fastai.callback.tracker import SaveModelCallback, EarlyStoppingCallback
import fastai.callback.schedule # fit_one_cycle, lr_find
from fastai.torch_core import set_seed
from fastxtend_compile.optimizer import CompiledOptimizerStep
from fastai.metrics import accuracy
from fastxtend_compile import *
from conftest import two_conv_cnn, bn_cnn, body_head_splitter, digits_dls, EAGER_PRECISION, assert_fit_close

BACKEND = 'aot_eager' # Traces forward and backward like inductor without its C++ compile time; inductor runs below

def params(m): return [p.detach().cpu().clone() for p in m.parameters()] # On the CPU: fit moves the model to the GPU
def body_params(m):
    "Parameters of the body's convolutions: a frozen body still trains its BatchNorm in fastai (`train_bn=True`)"
    return [p.detach().cpu().clone() for l in m[0] if isinstance(l, nn.Conv2d) for p in l.parameters()]
def unchanged(a, b): return all(torch.equal(x, y) for x,y in zip(a, b))
def all_changed(a, b): return all(not torch.equal(x, y) for x,y in zip(a, b))

def frozen_learner(dls, **kw):
    learn = Learner(dls, bn_cnn(), splitter=body_head_splitter, **kw).compile(backend=BACKEND)
    learn.freeze()
    return learn

class RecordCompiled(Callback):
    "Record, for each training batch, whether the model ran compiled"
    order = CompilerCallback.order + 1
    def before_fit(self): self.compiled = []
    def after_batch(self):
        if self.training: self.compiled.append(is_compiled(self.learn.model))

def test_frozen_params_stay_identical_and_unfreezing_trains_all(digits):
    learn = frozen_learner(digits)
    body0, head0 = body_params(learn.model), params(learn.model[1])
    learn.fit(1, 1e-2)
    assert is_compiled(learn.model)
    assert unchanged(body0, body_params(learn.model)), "frozen body changed"
    assert all_changed(head0, params(learn.model[1])), "head did not train"
    learn.unfreeze()
    body1 = body_params(learn.model)
    learn.fit(1, 1e-2)
    assert all_changed(body1, body_params(learn.model)), "unfrozen body did not train"

def test_refreezing_trains_like_eager():
    "fastai keeps the zeroed gradients of refrozen parameters, so weight decay still moves them: compiled does the same"
    def run(dls, learn):
        learn.freeze(); learn.fit(1, 1e-2); learn.unfreeze(); learn.fit(1, 1e-2); learn.freeze(); learn.fit(1, 1e-2)
        return learn
    # The compiled optimizer step agrees with fastai's to float rounding, which three fits amplify: compare the model alone
    eager, comp = _fit_pair(lambda dls: Learner(dls, bn_cnn(), splitter=body_head_splitter), run=run, compile_opt=False)
    assert_fit_close(eager.model, comp.model)

def test_gradients_between_steps_and_after_the_fit(digits):
    class Grads(Callback):
        "The gradients fastai's `zero_grad` has left, seen before each backward"
        order = 60
        def before_fit(self): self.seen = []
        def before_backward(self): self.seen.append([p.grad for p in self.learn.model.parameters()])
    def second_fit_frozen(learn):
        learn.fit(1, 1e-2); learn.freeze(); learn.fit(1, 1e-2)
        return learn
    eager = second_fit_frozen(Learner(digits, bn_cnn(), splitter=body_head_splitter, cbs=Grads()))
    compiled = second_fit_frozen(Learner(digits, bn_cnn(), splitter=body_head_splitter, cbs=Grads()).compile(backend=BACKEND))
    frozen = [not p.requires_grad for p in compiled.model.parameters()]
    assert any(frozen) and not all(frozen)
    # Between steps fastai leaves every gradient zeroed in place, compiled or not
    assert len(eager.grads.seen) == len(compiled.grads.seen)
    for e,c in zip(eager.grads.seen[1:], compiled.grads.seen[1:]):
        assert all(g is not None and not g.any() for g in e) and all(g is not None and not g.any() for g in c)
    assert [g is None for g in compiled.grads.seen[0]] == [g is None for g in eager.grads.seen[0]]
    assert all(p.grad is not None and not p.grad.any() for p in compiled.model.parameters())

def test_freezing_inside_a_fit_trains_like_eager():
    "Parameters frozen in the middle of a fit keep zero gradients, so fastai's weight decay still moves them"
    class FreezeAfterEpoch0(Callback):
        def after_epoch(self):
            if self.epoch == 0: self.learn.freeze()
    make = lambda dls: Learner(dls, bn_cnn(), splitter=body_head_splitter, cbs=FreezeAfterEpoch0(), wd=0.5)
    eager, comp = _fit_pair(make, epochs=2, lr=1e-2, compile_opt=False)
    assert_fit_close(eager.model, comp.model)

def test_freeze_to_inside_fit(digits):
    class UnfreezeAfterEpoch0(Callback):
        def after_epoch(self):
            if self.epoch == 0: self.learn.unfreeze(); self.body = body_params(self.learn.model)
    learn = frozen_learner(digits, cbs=UnfreezeAfterEpoch0())
    body0 = body_params(learn.model)
    learn.fit(2, 1e-2)
    mid = learn.unfreeze_after_epoch0.body
    assert unchanged(body0, mid) and all_changed(mid, body_params(learn.model))
    assert any('requires_grad' in e.reason for e in learn.compiler.report.recompiles)

def test_no_global_dynamo_reset(digits, monkeypatch):
    def no_reset(): raise AssertionError("torch._dynamo.reset() called")
    monkeypatch.setattr(torch._dynamo, 'reset', no_reset)
    monkeypatch.setattr(torch.compiler, 'reset', no_reset)
    learn = frozen_learner(digits)
    learn.fit(1); learn.unfreeze(); learn.fit(1)

@pytest.mark.parametrize('compile_frozen', [False, True])
def test_fine_tune(digits, compile_frozen):
    rec = RecordCompiled()
    learn = Learner(digits, bn_cnn(), splitter=body_head_splitter, cbs=rec).compile(backend=BACKEND)
    runs, steps = [], []
    learn.add_cb(Callback(after_fit=lambda cb: (runs.append(list(rec.compiled)), steps.append(learn.opt.__dict__.get('step')))))
    p0 = params(learn.model)
    learn.fine_tune(1, freeze_epochs=1, compile_frozen=compile_frozen)
    frozen, unfrozen = runs
    assert all(frozen) if compile_frozen else not any(frozen)
    assert all(unfrozen)
    # An eager frozen fit still runs fastai's `Adam` as PyTorch's fused kernel, and compiles no step
    assert isinstance(steps[0], CompiledOptimizerStep) and steps[0].fused_only is not compile_frozen
    if not compile_frozen: assert steps[0].compiled is None
    assert not steps[1].fused_only
    assert all_changed(p0, params(learn.model))
    assert not hasattr(learn, 'compile_frozen')

def test_fine_tune_keeps_an_already_compiled_model_compiled(digits):
    rec = RecordCompiled()
    learn = Learner(digits, bn_cnn(), splitter=body_head_splitter, cbs=rec).compile(backend=BACKEND)
    learn.fit(1)
    runs = []
    learn.add_cb(Callback(after_fit=lambda cb: runs.append(list(rec.compiled))))
    learn.fine_tune(1)
    assert all(runs[0]) and all(runs[1])

def test_outputs_equal_eager_through_inference_api(digits):
    learn = Learner(digits, two_conv_cnn(), metrics=accuracy).compile(backend=BACKEND)
    learn.fit_one_cycle(1, 3e-3)
    assert is_compiled(learn.model)
    preds, targs = learn.get_preds()
    val = learn.validate()
    item = digits.valid_ds.items[0]
    pred = learn.predict(item)
    tta, _ = learn.tta(n=1)
    xb,_ = digits.valid.one_batch()
    direct = learn.model(xb)
    assert type(direct) is type(xb)
    uncompile_model(learn.model)
    e_preds, e_targs = learn.get_preds()
    torch.testing.assert_close(preds, e_preds, rtol=1e-5, atol=1e-5)
    assert torch.equal(targs, e_targs)
    assert [float(v) for v in learn.validate()] == pytest.approx([float(v) for v in val], rel=1e-5)
    e_pred = learn.predict(item)
    assert e_pred[0] == pred[0] and torch.allclose(e_pred[2], pred[2], atol=1e-5)
    torch.testing.assert_close(learn.tta(n=1)[0], tta, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(learn.model(xb).as_subclass(Tensor), direct.as_subclass(Tensor), rtol=1e-5, atol=1e-5)

def test_losses_and_metrics_receive_what_they_get_eagerly(digits):
    def seen(compiled):
        types = []
        def metric(inp, targ): types.append((type(inp), type(targ))); return (inp.argmax(1) == targ).float().mean()
        def loss(inp, targ): types.append((type(inp), type(targ))); return nn.functional.cross_entropy(inp, targ)
        learn = Learner(digits, two_conv_cnn(), loss_func=loss, metrics=metric)
        if compiled: learn.compile(backend=BACKEND)
        learn.fit(1)
        return set(types)
    assert seen(True) == seen(False)

def test_recorder_sees_what_it_sees_eagerly():
    class Seen(Callback):
        "What callbacks see of the `Recorder` while training, and the losses at each epoch's end"
        order = 60 # After the `Recorder` and `CompilerCallback`
        def before_fit(self): self.smoothers, self.epoch_losses = set(), []
        def after_batch(self):
            if self.training: self.smoothers.add((type(self.learn.recorder.smooth_loss).__name__, self.learn.smooth_loss.device.type))
        def after_epoch(self): self.epoch_losses.append(list(self.learn.recorder.losses))
    def train(compiled):
        set_seed(0)
        learn = Learner(digits_dls(), two_conv_cnn(), cbs=Seen()) # Fresh DataLoaders: the same shuffles
        if compiled: learn.compile(backend='eager', **EAGER_PRECISION) # TorchDynamo's graph run by Python: eager's losses
        learn.fit(2, 1e-3)
        return learn
    eager, compiled = train(False), train(True)
    assert eager.seen.smoothers == compiled.seen.smoothers == {('AvgSmoothLoss', 'cpu')}
    for e,c in zip(eager.seen.epoch_losses + [eager.recorder.losses], compiled.seen.epoch_losses + [compiled.recorder.losses]):
        assert len(e) == len(c) > 0 and all(type(x) is type(y) and x.ndim == 0 and x.device.type == 'cpu' for x,y in zip(c, e))
        torch.testing.assert_close(torch.stack(c), torch.stack(e), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled.smooth_loss, eager.smooth_loss, rtol=1e-5, atol=1e-6)
    assert [v[0] for v in compiled.recorder.values] == pytest.approx([v[0] for v in eager.recorder.values], rel=1e-5)

def test_a_fit_that_raises_leaves_nothing_changed(digits):
    class Boom(Callback):
        def after_batch(self):
            if self.training and self.iter == 2: raise RuntimeError('boom') # Before the `Recorder` records batch 2
    learn = Learner(digits, two_conv_cnn()).compile(backend=BACKEND)
    dynamo_cbs = torch._dynamo.callback.callback_handler
    n_start, n_end = len(dynamo_cbs.start_callbacks), len(dynamo_cbs.end_callbacks)
    with pytest.raises(RuntimeError, match='boom'): learn.fit(1, cbs=Boom())
    assert not learn.compiler.active and learn.compiler.fits == 0
    assert (len(dynamo_cbs.start_callbacks), len(dynamo_cbs.end_callbacks)) == (n_start, n_end)
    assert all(x.device.type == 'cpu' for x in learn.recorder.losses) and len(learn.recorder.losses) == 2
    learn.fit(1) # And the next fit runs as usual
    assert len(learn.recorder.losses) == len(digits.train)

def test_lr_find(digits):
    learn = Learner(digits, two_conv_cnn()).compile(backend=BACKEND)
    p0 = params(learn.model)
    res = learn.lr_find(num_it=20, show_plot=False)
    assert res.valley > 0
    assert unchanged(p0, params(learn.model)), "lr_find must restore the weights"

def test_save_load_both_directions(digits, tmp_path):
    compiled = Learner(digits, two_conv_cnn(), path=tmp_path).compile(backend=BACKEND)
    compiled.fit(1)
    f = compiled.save('compiled')
    assert not any(k.startswith('_orig_mod') for k in torch.load(f, weights_only=False)['model'])
    plain = Learner(digits, two_conv_cnn(), path=tmp_path).load('compiled')
    assert unchanged(params(compiled.model), params(plain.model))
    plain.fit(1)
    plain.save('plain')
    compiled.load('plain')
    assert unchanged(params(compiled.model), params(plain.model)) and is_compiled(compiled.model)

def test_save_load_user_wrapped_model(digits, tmp_path):
    learn = Learner(digits, torch.compile(two_conv_cnn(), backend='eager'), path=tmp_path)
    learn.fit(1)
    f = learn.save('wrapped')
    keys = list(torch.load(f, weights_only=False)['model'])
    assert keys[0] == '0.weight' and not any('_orig_mod' in k for k in keys)
    other = Learner(digits, torch.compile(two_conv_cnn(), backend='eager'), path=tmp_path).load('wrapped')
    assert unchanged(params(learn.model), params(other.model))

def test_save_model_and_early_stopping(digits, tmp_path):
    learn = Learner(digits, two_conv_cnn(), path=tmp_path, metrics=accuracy,
                    cbs=[SaveModelCallback(monitor='accuracy', fname='best'), EarlyStoppingCallback(monitor='accuracy', patience=1)])
    learn.compile(backend=BACKEND).fit(3, 3e-3)
    assert (tmp_path/'models'/'best.pth').exists() and is_compiled(learn.model)
    best = torch.load(tmp_path/'models'/'best.pth', weights_only=False)
    assert not any(k.startswith('_orig_mod') for k in best)
    assert unchanged(params(learn.model), [best[k].cpu() for k in learn.model.state_dict() if 'weight' in k or 'bias' in k])

def _fit_pair(make_learner, epochs=1, backend=BACKEND, lr=3e-3, run=None, **compile_kwargs):
    "Train the same seeded Learner (fresh DataLoaders: their shuffling RNG is seeded when created) eagerly and compiled"
    res = []
    for compiled in (False, True):
        set_seed(0, reproducible=True)
        dls = digits_dls()
        learn = make_learner(dls)
        if compiled: learn.compile(backend=backend, **EAGER_PRECISION, **compile_kwargs)
        if run is None: learn.fit(epochs, lr)
        else: run(dls, learn)
        res.append(learn)
    return res

@pytest.mark.parametrize('cb', [lambda: MixedPrecision(), lambda: MixedPrecision(amp_mode='bf16'), lambda: ChannelsLast(),
                                lambda: GradientAccumulation(128)], ids=['fp16', 'bf16', 'channels_last', 'grad_accum'])
def test_fastai_callbacks_match_eager(digits, cb):
    eager, comp = _fit_pair(lambda dls: Learner(dls, two_conv_cnn(), cbs=cb()))
    assert_fit_close(eager.model, comp.model)
    assert list(map(float, eager.recorder.values[-1])) == pytest.approx(list(map(float, comp.recorder.values[-1])), rel=1e-3)

def test_model_swapped_mid_fit_is_compiled(digits):
    class Swap(Callback):
        order = 0
        def before_epoch(self):
            if self.epoch == 1:
                self.learn.model = two_conv_cnn()
                self.learn.create_opt()
                self.new = self.learn.model
                self.p0 = params(self.new)
    learn = Learner(digits, two_conv_cnn(), cbs=Swap()).compile(backend=BACKEND)
    learn.fit(2)
    assert learn.model is learn.swap.new and is_compiled(learn.model)
    assert all_changed(learn.swap.p0, params(learn.model))

def test_layer_replaced_mid_fit_trains_the_new_layer(digits):
    class Replace(Callback):
        def before_epoch(self):
            if self.epoch == 1:
                self.learn.model[5] = nn.Linear(16*8*8, 10).to(self.dls.device)
                self.learn.create_opt()
                self.p0 = params(self.learn.model[5])
    learn = Learner(digits, two_conv_cnn(), cbs=Replace()).compile(backend=BACKEND)
    learn.fit(2, 1e-2)
    assert all_changed(learn.replace.p0, params(learn.model[5]))
    xb,_ = digits.valid.one_batch()
    out = learn.model(xb)
    uncompile_model(learn.model)
    torch.testing.assert_close(out.as_subclass(Tensor), learn.model(xb).as_subclass(Tensor), rtol=1e-5, atol=1e-5)


class Block(nn.Module):
    def __init__(self, d=32): super().__init__(); self.norm, self.lin = nn.LayerNorm(d), nn.Linear(d, d)
    def forward(self, x): return x + self.lin(self.norm(x)).relu()

def tower(n_blocks=6):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Sequential(*[Block() for _ in range(n_blocks)]), nn.Linear(32, 10))

def test_regional_compiles_one_block_for_its_twins():
    eager, comp = _fit_pair(lambda dls: Learner(dls, tower()), regional=True)
    assert all(is_compiled(b) for b in comp.model[2])
    assert_fit_close(eager.model, comp.model)

def test_regional_training_compiles_once_per_graph_kind(digits):
    class FreshBlock(Block): # Code of its own: nothing compiled earlier in this process can be reused
        def forward(self, x): return x + self.lin(self.norm(x)).relu()
    model = tower()
    model[2] = nn.Sequential(*[FreshBlock() for _ in range(6)])
    learn = Learner(digits, model).compile(backend=BACKEND, regional=True)
    learn.fit(1)
    assert all(is_compiled(b) for b in learn.model[2]) and not is_compiled(learn.model)
    train = [e for e in learn.compiler.report.events if e.during.startswith('training') and e.frame != 'optimizer step']
    assert len(train) == 1, [str(e) for e in train] # six blocks, one compile
