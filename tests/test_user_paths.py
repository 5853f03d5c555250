"What a fastai user meets, compiled as eager: fastai's own usage patterns, diagnostics that tell the truth, refusals the Learner recovers from"
import random, warnings
import numpy as np, pytest, torch
from torch import nn, Tensor
from fastai.learner import Learner
from fastai.callback.mixup import MixUp
from fastai.losses import CrossEntropyLossFlat
from fastai.callback.core import Callback
from fastai.torch_core import set_seed
from fastxtend_compile import *
from fastxtend_compile.report import CompileRecorder
from conftest import two_conv_cnn, digits_dls

BACKEND = 'aot_eager' # Traces forward and backward like inductor without its C++ compile time

def _mixup_by_hand(learn, dls):
    "fastai's MixUp documentation's pattern: a Learner as a context manager, its events called one by one"
    learn.epoch, learn.training = 0, True
    learn.dl = dls.train
    learn._split(dls.valid.one_batch()) # Not shuffled: the same batch for each Learner
    learn('before_train')
    learn('before_batch')
    return learn.xb[0]

def test_events_called_by_hand_run_as_eager(digits):
    "Events called one by one, outside a fit (no `iter` or `n_iter`), run as on an eager Learner"
    xbs = []
    for compiled in (False, True):
        set_seed(0)
        learn = Learner(digits, two_conv_cnn(), loss_func=CrossEntropyLossFlat(), cbs=MixUp())
        if compiled: learn.compile(backend=BACKEND)
        with learn: xbs.append(_mixup_by_hand(learn, digits))
    torch.testing.assert_close(xbs[1], xbs[0])

def _dropout_learner(dls):
    "A body and fastai's default `vision_learner` head: BatchNorm and dropout"
    from fastai.vision.learner import create_head
    body = nn.Sequential(nn.Conv2d(1,8,3,padding=1), nn.ReLU())
    return Learner(dls, nn.Sequential(body, create_head(8, 10)), loss_func=CrossEntropyLossFlat())

def test_debug_compile_runs_each_stage_from_eager_random_state(digits):
    "Dropout draws the same masks in the reference and at each stage: a model with dropout is ok, and eager's draws are left as they were"
    learn = _dropout_learner(digits)
    set_seed(1)
    stages = learn.debug_compile(backend='aot_eager', show=False)
    assert [s.backend for s in stages] == ['eager', 'aot_eager']
    assert all(s.ok and s.max_diff == 0 for s in stages), '\n'.join(map(str, stages))
    drawn = torch.rand(3), random.random(), np.random.rand()
    set_seed(1)
    assert torch.equal(drawn[0], torch.rand(3)) and drawn[1:] == (random.random(), np.random.rand())

class CompiledWith(Callback):
    "Record the backend the model ran compiled with at each training batch (`None`: eagerly)"
    order = CompilerCallback.order + 1
    def before_fit(self): self.backends = []
    def after_batch(self):
        if self.training: self.backends.append((compiled_settings(self.learn.model) or {}).get('backend'))

def test_a_fits_compiler_takes_over_and_hands_back(digits):
    "A `CompilerCallback` passed to a fit compiles that fit; the Learner's compiles the fits after it"
    seen = CompiledWith()
    learn = Learner(digits, two_conv_cnn(), cbs=seen).compile(backend=BACKEND)
    own = learn.compiler
    learn.fit(1)
    assert set(seen.backends) == {BACKEND}
    fits = CompilerCallback(backend='eager')
    learn.fit(1, cbs=fits)
    assert set(seen.backends) == {'eager'} and fits.report.graphs >= 1
    assert learn.compiler is own and own in learn.cbs and fits not in learn.cbs
    learn.fit(1)
    assert set(seen.backends) == {BACKEND} and is_compiled(learn.model)

def test_a_fits_compiler_alone_leaves_its_report(digits, tmp_path):
    learn = Learner(digits, two_conv_cnn(), path=tmp_path)
    learn.fit(1, cbs=CompilerCallback(backend=BACKEND))
    assert learn.compiler.report.graphs >= 1 and not is_compiled(learn.model) # Its compilation went with it
    learn.fit(1) # Eagerly: the kept callback is not in the fit
    learn.freeze_to(0)
    learn.export('plain.pkl')
    assert 'compiler' not in load_learner(tmp_path/'plain.pkl').__dict__

def test_guide_says_how_inductor_repeats_eagers_dropout():
    "The guide's reproducibility section names the setting that has inductor draw random numbers as eager does"
    import json
    from pathlib import Path
    nb = json.loads((Path(__file__).parents[1]/'nbs'/'10_guide.ipynb').read_text())
    text = '\n'.join(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'markdown')
    section = text[text.index('## Reproducibility'):].split('\n## ')[0]
    assert 'torch._inductor.config.fallback_random = True' in section and 'dropout' in section

class Branches(nn.Module):
    "Python branches on a tensor's value"
    def __init__(self): super().__init__(); self.lin = nn.Linear(64, 10)
    def forward(self, x):
        if x.mean().item() > 0.5: x = x * 2
        return self.lin(x.flatten(1))

class Logs(nn.Module):
    "Python state changed at every call"
    def __init__(self): super().__init__(); self.lin = nn.Linear(64, 10); self.log = []
    def forward(self, x):
        self.log.append(x.mean().item())
        return self.lin(x.flatten(1))

def _line(cls, code:str)->str:
    "`file:line` of `code` in `cls`'s source"
    import inspect
    lines, start = inspect.getsourcelines(cls)
    return f"{inspect.getsourcefile(cls)}:{start + next(i for i,l in enumerate(lines) if code in l)}"

def _quiet_fit(learn, n=1):
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(n)

@pytest.mark.parametrize('model,code,fix', [
    (Branches, 'if x.mean().item() > 0.5', "use `torch.where` or `torch.cond`"),
    (Logs, 'self.log.append(x.mean().item())', "Keep Python state that changes out of `forward`")])
@pytest.mark.slow
def test_fullgraph_refusal_names_the_line_and_lets_the_learner_train(digits, model, code, fix):
    learn = Learner(digits, model(), loss_func=CrossEntropyLossFlat()).compile(backend=BACKEND, fullgraph=True)
    with pytest.raises(GraphBreakError) as e: _quiet_fit(learn)
    msg = str(e.value)
    assert f"{_line(model, code)}" in msg and f"`{code}" in msg and fix in msg and 'compile with fullgraph=False' in msg, msg
    assert not any(isinstance(c, CompilerCallback) for c in learn.cbs) and not is_compiled(learn.model)
    before = learn.model.lin.weight.detach().clone()
    _quiet_fit(learn) # Eagerly
    assert not torch.equal(before, learn.model.lin.weight)
    if model is Branches: # Compiled in pieces once the user drops `fullgraph`
        learn.compile(backend=BACKEND)
        _quiet_fit(learn)
        assert is_compiled(learn.model) and learn.compiler.report.graphs >= 1

def test_a_models_own_bug_raises_eagers_error_alone(digits, capfd):
    "The model's own shape bug: eager's error, without torch's log of the trace that failed on it"
    learn = Learner(digits, nn.Sequential(nn.Flatten(), nn.Linear(63, 10)), loss_func=CrossEntropyLossFlat()).compile(backend=BACKEND)
    capfd.readouterr()
    with pytest.raises(RuntimeError, match=r'mat1 and mat2 shapes cannot be multiplied \(64x64 and 63x10\)'): _quiet_fit(learn)
    err = capfd.readouterr().err
    assert 'failed while attempting to run meta' not in err and 'Traceback' not in err, err

def test_compile_notices_name_the_backward_and_the_optimizer_step(digits):
    from fastai.optimizer import SGD
    learn = Learner(digits, two_conv_cnn(), loss_func=CrossEntropyLossFlat(), opt_func=SGD).compile(backend=BACKEND)
    shown = []
    learn.compiler.compile_recorder.notice_after = 0. # Every compile
    learn.compiler._show = shown.append
    _quiet_fit(learn)
    firsts = [s for s in shown if 'training batch 1 ' in s]
    assert firsts[0].startswith('torch.compile compiled Sequential for training batch 1'), shown
    assert sum(s.startswith('torch.compile compiled Sequential for') for s in firsts) == 1, shown
    assert any("compiled Sequential's backward for training batch 1" in s for s in firsts), shown
    assert any("compiled the optimizer step for training batch 1" in s for s in firsts), shown

@pytest.mark.parametrize('backend', ['eager', 'aot_eager'])
def test_options_to_a_backend_without_options_warn(backend):
    with pytest.warns(UserWarning, match=f"options=.* have no effect with backend='{backend}'"):
        CompilerCallback(backend=backend, options={'epilogue_fusion': True})

def test_report_numbers_batches_within_each_fit(digits):
    from conftest import bn_cnn, body_head_splitter
    learn = Learner(digits, bn_cnn(), splitter=body_head_splitter, loss_func=CrossEntropyLossFlat()).compile(backend=BACKEND)
    learn.freeze()
    _quiet_fit(learn)
    n = len(learn.compiler.report.events)
    learn.unfreeze()
    _quiet_fit(learn)
    new = [e for e in learn.compiler.report.events[n:] if e.frame == 'Sequential']
    # The unfrozen model compiles at the first batch of this fit, numbered within it; its eager step is timed after
    assert new and new[0].during == 'training batch 1', [str(e) for e in new]
    assert len(learn.compiler.report.eager_times) == CompileRecorder.eager_batches

def test_a_fit_at_another_batch_size_times_its_eager_step_again():
    "The eager step the report weighs the compiled one against is timed at the fit's own batch size"
    learn = Learner(digits_dls(), two_conv_cnn(), loss_func=CrossEntropyLossFlat()).compile(backend=BACKEND) # Its own: its batch size changes
    _quiet_fit(learn)
    r = learn.compiler.report
    first = len(r.batch_times)
    learn.dls.train.bs = 16
    _quiet_fit(learn)
    # The new size runs eagerly once and compiles when it comes again; the eager step is timed after that compile
    assert [e.during for e in r.recompiles if 'batch size' in e.reason] == ['training batch 2'], [str(e) for e in r.events]
    assert len(r.eager_times) == CompileRecorder.eager_batches and r.measured_from == first + 2

def _timed(eager:list, compiled:float, n:int=20)->CompileReport:
    return CompileReport(batch_times=[(compiled, False)]*n, eager_times=eager, epoch_steps=n, compile_seconds=1.)

def test_one_slow_eager_batch_never_makes_compiling_look_faster():
    # Two eager batches after the first, 10 ms and 73 ms (a slow one): the step is the lower, not their mean of 41.5 ms
    assert _timed([0.02, 0.010, 0.073], 0.010).payoff().startswith("did not pay: compiled step 10.0 ms against 10.0 ms eager")
    assert _timed([0.02, 0.0205, 0.0199], 0.010).payoff().startswith("paid: compiled step 10.0 ms against 19.9 ms eager (1.99×)")
    assert _timed([0.02, 0.0305, 0.0299], 0.040).payoff().startswith("did not pay")

def test_report_says_why_calls_ran_eagerly_in_the_users_terms(digits, cancer):
    r = CompileReport(eager_calls={((False, False), ((16, 1, 8, 8),)): 12}, eager_hooks='ActivationStats', eager_frozen=1)
    s = r.summary()
    assert "a one-off shape (the last, smaller batch) and not worth a graph: 12 validation or inference call(s)" in s, s
    assert "ran eagerly while hooks of ActivationStats read the model's values" in s and "1 frozen fit(s) of `fine_tune`" in s
    text = CompileReport(batch_times=[(0.01, False)]*4, data_waits=[0.05]*4, images=False).data_advice()
    assert text.startswith('the DataLoader: 83% of training time') and 'image' not in text and 'batch_tfms' not in text
    from fastxtend_compile.report import _image_batches
    assert _image_batches(digits.train) and not _image_batches(cancer.train)

def test_a_fit_run_eagerly_for_hooks_says_so(digits):
    from fastai.callback.hook import ActivationStats
    learn = Learner(digits, two_conv_cnn(), loss_func=CrossEntropyLossFlat()).compile(backend=BACKEND)
    _quiet_fit(learn)
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, cbs=ActivationStats(with_hist=False))
    assert "ran eagerly while hooks of ActivationStats read the model's values" in learn.compiler.report.summary()

def test_fine_tunes_eager_frozen_fit_is_reported(digits):
    from conftest import bn_cnn, body_head_splitter
    import fastai.callback.schedule
    learn = Learner(digits, bn_cnn(), splitter=body_head_splitter, loss_func=CrossEntropyLossFlat()).compile(backend=BACKEND)
    with learn.no_bar(), learn.no_logging(): learn.fine_tune(1)
    assert "ran eagerly: 1 frozen fit(s) of `fine_tune`" in learn.compiler.report.summary()

def _guard(file:str)->str:
    "A recompile reason as TorchDynamo gives it, for a guard on a number kept in `file`"
    return (f"0/1: self.bs == 16  # if self.bs != bs:  # {file[-20:]}:137 in _change_hidden\nUser stack trace:\n"
            f'  File "{file}", line 137, in _change_hidden\n    if self.bs != bs:')

def test_recompile_advice_is_for_the_users_code_only():
    import fastai.text.models.awdlstm as awd
    r = CompileRecorder(CompileReport())
    fastais = r._reason(_guard(awd.__file__), 'training batch 2')
    assert "in fastai's or torch's own code (awdlstm.py:137), not yours" in fastais and 'make it a tensor' not in fastais, fastais
    assert r._reason(_guard(__file__), 'training batch 2').endswith('make it a tensor')
