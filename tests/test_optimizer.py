"The compiled optimizer step: the same update and state as fastai's eager step, without recompiles"
import copy, warnings
from functools import partial
import pytest, torch
from torch import nn
from torch._dynamo.utils import counters
from fastai.optimizer import (Optimizer, OptimWrapper, SGD, RMSProp, Adam, RAdam, QHAdam, Larc, Lamb, ranger,
                              weight_decay, momentum_step, average_grad, average_sqr_grad, step_stat, adam_step)
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import MSELossFlat
from fastai.callback.core import Callback
from fastai.torch_core import params
import fastai.callback.schedule
from fastxtend_compile.optimizer import *
from fastxtend_compile.optimizer import CompiledOptimizerStep, ZeroedGrads, zeroed_grads
from fastxtend_compile.callback import CompilerCallback

from conftest import assert_close_to
# An optimizer's tensors against eager's, each compared whole (`assert_close_to`): float32 rounding of a few steps in
# another order of operations errs relative to the magnitudes summed, not to each element, which can be near zero
TOL = dict(rtol=1e-5, atol=1e-6)
# A fit's compiled optimizer step ends this close to the eager step's weights, as a share of how far eager moved each
# tensor: float32 rounding of 16 steps in another order of operations (3e-7 at most on a 2-core AMD EPYC, torch 2.14.1),
# where one step of the 16 skipped or applied twice would be about 6%
MOVED_RTOL = 1e-4

def graphs(): return counters['stats']['unique_graphs']

def make_params(seed=0):
    torch.manual_seed(seed)
    shapes = [(4, 6), (6,), (3, 2, 5), (5,), (7, 3)]
    return [torch.randn(*s, requires_grad=True) for s in shapes]

def make_grads(ps, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in ps] for _ in range(n)]

def run(opt_func, backend=None, n=10, none_at=(), schedule=True, fused=False, **kwargs):
    "`n` steps of `opt_func` on two parameter groups, eager or compiled with `backend` (fastai's `Adam` fused if `fused`)"
    ps = make_params()
    opt = opt_func([ps[:2], ps[2:]], lr=1e-2, **kwargs)
    opt.state[ps[1]]['do_wd'] = False # Like a bias with `wd_bn_bias=False`
    opt.state[ps[3]]['do_wd'] = False
    if backend: compile_optimizer(opt, backend=backend, fused=fused)
    for i,gs in enumerate(make_grads(ps, n)):
        if schedule: # Like `fit_one_cycle`: new hyper-parameters every step, discriminative LRs
            opt.set_hyper('lr', slice(1e-3 * (1 + i), 1e-2 * (1 + i)))
            if 'mom' in opt.hypers[0]: opt.set_hyper('mom', 0.95 - 0.01*i)
        for j,(p,g) in enumerate(zip(ps, gs)): p.grad = None if (i,j) in none_at else g.clone()
        opt.step()
    return opt

def assert_same(a, b):
    "Optimizer `b`'s parameters and state are eager `a`'s, within `TOL` of each tensor's norm"
    for i,((pa,_,sa,_),(pb,_,sb,_)) in enumerate(zip(a.all_params(), b.all_params())):
        assert_close_to(pb.detach(), pa.detach(), TOL, f'parameter {i}')
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], torch.Tensor) or isinstance(sb[k], torch.Tensor):
                assert_close_to(torch.as_tensor(sb[k]).to(pa.dtype), torch.as_tensor(sa[k]).to(pa.dtype), TOL, f'parameter {i}, {k}')
            else: assert sa[k] == sb[k], k

optimizers = {
    'Adam':             partial(Adam, wd=0.1),
    'Adam-l2':          partial(Adam, wd=0.1, decouple_wd=False),
    'SGD':              partial(SGD, wd=0.1),
    'SGD-mom':          partial(SGD, mom=0.9, wd=0.1),
    'SGD-mom-l2':       partial(SGD, mom=0.9, wd=0.1, decouple_wd=False),
    'RAdam':            partial(RAdam, wd=0.1),
    'RAdam-beta':       partial(RAdam, beta=2.),
    'Lamb':             partial(Lamb, wd=0.1),
    'RMSProp':          RMSProp,
    'RMSProp-mom':      partial(RMSProp, mom=0.9, wd=0.1),
    'QHAdam':           partial(QHAdam, wd=0.1),
    'Larc':             partial(Larc, wd=0.1),
    'Lars':             partial(Larc, clip=False),
    'ranger':           partial(ranger, k=3),
}

@pytest.mark.slow
@pytest.mark.parametrize('name', optimizers)
def test_same_update_and_state_as_fastai(name):
    opt_func = optimizers[name]
    # No grad for a parameter at the first step gives it its own step count in its group, as after an unfreeze
    eager, compiled = run(opt_func, none_at={(0, 0)}), run(opt_func, 'eager', none_at={(0, 0)})
    assert_same(eager, compiled)
    if 'step' in eager.state[eager.param_lists[0][0]]: assert eager.state[eager.param_lists[0][0]]['step'] == 9

@pytest.mark.parametrize('name', ['Adam', 'Adam-l2'])
def test_adam_runs_as_pytorchs_fused_kernel(name):
    before = graphs()
    eager, fused = run(optimizers[name], none_at={(0, 0)}), run(optimizers[name], 'inductor', none_at={(0, 0)}, fused=True)
    assert_same(eager, fused)
    assert fused.step.fused is (torch._fused_adam_ if name == 'Adam-l2' else torch._fused_adamw_)
    assert graphs() == before # Nothing to compile
    # An Adam-like step without fastai's damped averages is a different update: compiled
    undamped = partial(Optimizer, cbs=[weight_decay, average_grad, average_sqr_grad, step_stat, adam_step], mom=0.9,
                       sqr_mom=0.99, eps=1e-5, wd=0.1)
    assert_same(run(undamped), run(undamped, 'eager', fused=True))
    assert graphs() == before + 1

@pytest.mark.parametrize('name', ['Adam', 'SGD-mom'])
def test_fused_only_compiles_nothing(name):
    "`fused_only`, for a fit that runs eagerly: fastai's `Adam` as the fused kernel; a step it can't make, fastai's own"
    before = graphs()
    eager = run(optimizers[name], none_at={(0, 0)})
    only = run(lambda *a, **kw: compile_optimizer(optimizers[name](*a, **kw), backend='inductor', fused_only=True), none_at={(0, 0)})
    assert_same(eager, only)
    assert graphs() == before and only.step.compiled is None # Nothing compiled, not even lazily
    assert (only.step.fused is torch._fused_adamw_) == (name == 'Adam')

def test_radam_rectifies_within_the_run():
    # RAdam steps without its denominator until the variance is tractable (step 6 with sqr_mom=0.99): both paths run
    opt = run(RAdam, 'eager', n=3)
    assert [v for k,v in opt.step.scalars[0, torch.device('cpu'), torch.float32].values.items() if k[1] == 'rect'] == [0.]
    assert_same(run(RAdam, n=8), run(RAdam, 'eager', n=8))

@pytest.mark.slow
@pytest.mark.parametrize('name', ['Adam', 'SGD-mom', 'RAdam', 'Lamb'])
def test_new_hyperparameters_every_step_never_recompile(name):
    before = graphs()
    opt = run(optimizers[name], 'aot_eager', n=10)
    assert graphs() - before == 1
    assert opt.hypers[0]['lr'] == pytest.approx(1e-3 * 10)

def test_each_optimizer_has_its_own_graphs_and_recompile_limit():
    before = graphs()
    for i in range(12): # More optimizers than TorchDynamo's recompile limit (8), each with parameters of other shapes
        p = torch.zeros(i + 1, requires_grad=True)
        opt = compile_optimizer(SGD([p], lr=0.1), backend='eager')
        p.grad = torch.ones_like(p)
        opt.step()
        torch.testing.assert_close(p.detach(), torch.full_like(p, -0.1))
    assert graphs() - before == 12 # None ran eagerly for want of room in a shared cache

def test_scalars_are_0d_tensors_refilled_in_place():
    ps = make_params()
    opt = compile_optimizer(SGD(ps, lr=0.1, mom=0.9), backend='eager')
    for p in ps: p.grad = torch.ones_like(p)
    opt.step()
    scalars = opt.step.scalars[0, torch.device('cpu'), torch.float32].tensors
    before = dict(scalars)
    opt.set_hypers(lr=0.2, mom=0.8)
    opt.step()
    assert all(scalars[k] is t and t.ndim == 0 for k,t in before.items())
    # SGD's step functions: weight_decay, average_grad, momentum_step
    assert scalars[1, 'mom'].item() == pytest.approx(0.8) and scalars[2, 'neg_lr'].item() == pytest.approx(-0.2)

@pytest.mark.slow
def test_inductor():
    before = graphs()
    for name in ('Adam', 'SGD-mom'):
        assert_same(run(optimizers[name]), run(optimizers[name], 'inductor'))
    assert graphs() - before == 2

@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'compiled'])
def test_state_dict_round_trips_between_eager_and_compiled(fused):
    def steps(opt, ps, grads):
        for gs in grads:
            for p,g in zip(ps, gs): p.grad = g.clone()
            opt.step()
    ps, grads = make_params(), make_grads(make_params(), 6)
    opt = compile_optimizer(Adam([ps[:2], ps[2:]], lr=1e-2, wd=0.1), backend='eager', fused=fused)
    steps(opt, ps, grads[:3])
    sd = copy.deepcopy(opt.state_dict())
    assert sd['state'][0]['step'] == 3 and set(sd['state'][0]) == {'grad_avg', 'sqr_avg', 'step'}
    # Into an eager optimizer, and the compiled one continues from its own state: both agree
    ps2 = [p.detach().clone().requires_grad_() for p in ps]
    eager = Adam([ps2[:2], ps2[2:]], lr=1e-2, wd=0.1)
    eager.load_state_dict(copy.deepcopy(sd))
    steps(opt, ps, grads[3:]); steps(eager, ps2, grads[3:])
    assert_same(eager, opt)
    # An eager state into the compiled optimizer, loaded as a plain dict, then cleared
    opt.load_state_dict(copy.deepcopy(eager.state_dict()))
    steps(opt, ps, grads[:2]); steps(eager, ps2, grads[:2])
    assert_same(eager, opt)
    opt.clear_state(); eager.clear_state()
    steps(opt, ps, grads[2:4]); steps(eager, ps2, grads[2:4])
    assert_same(eager, opt)
    assert opt.state[ps[0]]['step'] == 2

def test_zero_grad_zeroes_in_place_as_fastai_does():
    ps = make_params()
    opt = compile_optimizer(Adam([ps[:2], ps[2:]], lr=1e-2), backend='eager')
    assert opt.zero_grad == opt.step.zero_grad
    for p in ps[:-1]: p.grad = torch.randn_like(p)
    grads = [p.grad for p in ps[:-1]]
    opt.zero_grad()
    assert all(p.grad is g and not g.any() for p,g in zip(ps, grads)) and ps[-1].grad is None
    uncompile_optimizer(opt)
    assert 'zero_grad' not in opt.__dict__ and 'step' not in opt.__dict__

def test_unknown_step_function_runs_eagerly_after_one_warning():
    def sign_step(p, lr, **kwargs): p.data.add_(p.grad.data.sign(), alpha=-lr)
    custom = lambda ps, lr, **kw: Optimizer(ps, [weight_decay, sign_step], lr=lr, wd=0.1, **kw)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        compiled = run(custom, 'eager')
    assert len(w) == 1 and 'sign_step' in str(w[0].message)
    assert_same(run(custom), compiled)

def test_what_compiles_and_what_is_left_alone():
    ps = make_params()
    wrapped = OptimWrapper(ps, torch.optim.AdamW, lr=1e-3)
    assert compile_optimizer(wrapped) is wrapped and 'step' not in wrapped.__dict__
    assert compiled_optimizer_settings(wrapped) is None
    class OwnStep(Optimizer):
        def step(self, closure=None): pass
    with pytest.warns(UserWarning, match='Not compiling the step of OwnStep'):
        own = compile_optimizer(OwnStep(ps, [momentum_step], lr=1e-3))
    assert compiled_optimizer_settings(own) is None
    look = ranger(ps, lr=1e-3)
    compile_optimizer(look, backend='eager')
    assert isinstance(look.opt.__dict__['step'], CompiledOptimizerStep)
    # The same settings keep the compiled step, others replace it; `uncompile_optimizer` goes back to eager
    opt = Adam(ps, lr=1e-3)
    step = compile_optimizer(opt, backend='eager').step
    assert compile_optimizer(opt, backend='eager').step is step
    assert compile_optimizer(opt, backend='eager', fused=False).step is not step
    assert compile_optimizer(opt, backend='aot_eager').step is not step
    assert compiled_optimizer_settings(opt) == dict(fullgraph=False, dynamic=False, backend='aot_eager', mode=None, options=None)
    with pytest.raises(ValueError, match="Unknown torch.compile backend 'inductr'"): compile_optimizer(opt, backend='inductr')
    assert compiled_optimizer_settings(uncompile_optimizer(opt)) is None and 'step' not in opt.__dict__
    with pytest.raises(NotImplementedError, match='fastai optimizers currently do not support closure'): compile_optimizer(opt, backend='eager').step(lambda: 0)

# A `Learner`, trained the same way with the eager and the compiled step

class CompileOpt(Callback):
    "What `CompilerCallback` does for the optimizer"
    def __init__(self, backend, fused=True): self.backend,self.fused = backend,fused
    def before_fit(self): compile_optimizer(self.learn.opt, backend=self.backend, fused=self.fused)

def bn_model():
    torch.manual_seed(0)
    # No bias before BatchNorm, as in fastai's layers: BatchNorm cancels it, so its gradient is float rounding noise, which
    # Adam turns into steps of up to lr either way; two summation orders of the same step would take it apart
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

def regression_dls():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = x @ torch.tensor([[1.], [-2.], [0.5], [3.]]) + 0.1 * torch.randn(96, 1, generator=g)
    return DataLoaders.from_dsets(list(zip(x[:64], y[:64])), list(zip(x[64:], y[64:])), bs=16, shuffle=False)

def train(backend, opt_func, fused=True, cbs=None):
    learn = Learner(regression_dls(), bn_model(), loss_func=MSELossFlat(), opt_func=opt_func,
                    splitter=lambda m: [params(m[:3]), params(m[3:])], cbs=cbs or (CompileOpt(backend, fused) if backend else None))
    with learn.no_logging(), learn.no_bar():
        learn.freeze()                          # Body frozen: only the head and the BatchNorm (`train_bn`) train
        learn.fit_one_cycle(1, 1e-2)
        learn.unfreeze()
        learn.fit_one_cycle(2, slice(1e-3, 1e-2)) # Discriminative LRs
        learn.freeze()                          # The body has zero grads now: fastai still steps it
        learn.fit_one_cycle(1, 1e-2, wd=0.1)
    return learn

@pytest.mark.parametrize('opt_func,fused,n_graphs', [(Adam, True, 0), (Adam, False, 3), (partial(SGD, mom=0.9), True, 3)],
                         ids=['Adam-fused', 'Adam-compiled', 'SGD'])
@pytest.mark.slow
def test_learner_trains_the_same(opt_func, fused, n_graphs):
    before, start = graphs(), list(bn_model().parameters())
    eager, compiled = train(None, opt_func), train('aot_eager', opt_func, fused)
    assert compiled_optimizer_settings(compiled.opt) is not None
    # Compiled: one graph per freeze state (frozen with no body grads, unfrozen, frozen with zero body grads)
    assert graphs() - before == n_graphs
    for s,pe,pc in zip(start, eager.model.parameters(), compiled.model.parameters()):
        assert_close_to(pc.detach(), pe.detach(), TOL, 'parameter', s.detach(), MOVED_RTOL)
    assert_same(eager.opt, compiled.opt)

# The backward writes the gradients `zero_grad` zeroed

class GradsAfterBackward(Callback):
    "After each backward: whether each gradient `zero_grad` zeroed of a parameter that trains is still that tensor, which the backward added into"
    order = CompilerCallback.order + 1
    def __init__(self): self.zeroed, self.kept = {}, []
    def after_backward(self): self.kept += [p.grad is g for p,g in self.zeroed.items() if p.requires_grad and p.grad is not None]
    def after_batch(self): self.zeroed = {p: p.grad for p in self.learn.model.parameters() if p.grad is not None}

@pytest.mark.slow
@pytest.mark.parametrize('on', [True, False], ids=['written', 'added-into'])
def test_backward_writes_the_gradients_zero_grad_zeroed(on, monkeypatch):
    "The backward writes each gradient fastai's `zero_grad` left at zero, and the fit trains as fastai's eager one does"
    monkeypatch.setattr(ZeroedGrads, 'on', on)
    spy = GradsAfterBackward()
    eager, compiled = train(None, Adam), train(None, Adam, cbs=[CompilerCallback(backend='eager', background=False), spy])
    assert zeroed_grads(compiled.opt) is not None
    # Every gradient after a backward is the one it wrote; off, each is the zeroed tensor it added into
    assert len(spy.kept) > 50 and (not any(spy.kept) if on else all(spy.kept))
    # The last fit's frozen body gets no gradient from its backward: it keeps its zeros, and fastai's Adam still steps it
    assert all(p.grad is not None and not p.grad.any() for p in compiled.model[:3].parameters() if p.ndim > 1)
    for pe,pc in zip(eager.model.parameters(), compiled.model.parameters()):
        assert_close_to(pc.detach(), pe.detach(), TOL, 'parameter')
    assert_same(eager.opt, compiled.opt)

def test_learner_saves_and_loads_the_optimizer_state(tmp_path):
    learn = Learner(regression_dls(), bn_model(), loss_func=MSELossFlat(), opt_func=Adam, path=tmp_path, cbs=CompileOpt('eager'))
    with learn.no_logging(), learn.no_bar(): learn.fit(1)
    learn.save('m', with_opt=True)
    sd = learn.opt.state_dict()
    learn2 = Learner(regression_dls(), bn_model(), loss_func=MSELossFlat(), opt_func=Adam, path=tmp_path)
    learn2.load('m', with_opt=True)
    for s1,s2 in zip(sd['state'], learn2.opt.state_dict()['state']):
        assert s1.keys() == s2.keys()
        for k in s1: torch.testing.assert_close(torch.as_tensor(s1[k]), torch.as_tensor(s2[k]))
