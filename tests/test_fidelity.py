"A compiled Learner is faithful to fastai: one graph per model, the gradients, output, hooks, exports and reports fastai users expect"
import logging, re, subprocess, sys, textwrap, threading, warnings
from pathlib import Path
import numpy as np, pandas as pd, pytest, torch
from torch import nn
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai.callback.hook import ActivationStats
from fastai.optimizer import SGD
from fastai.torch_core import set_seed
from fastai.tabular.learner import tabular_learner
from fastai.vision.data import ImageDataLoaders
from fastai.vision.learner import vision_learner
from fastai.vision.models import resnet18
import fastai.callback.schedule # fine_tune, fit_one_cycle
import fastxtend_compile
from fastxtend_compile import *
from fastxtend_compile.core import compile_settings, inner_model
from fastxtend_compile.internals import graphs_compiled, compiled_call, traced_op_error
from conftest import assert_fit_close, ragged_text_dls, two_conv_cnn, bn_cnn, body_head_splitter, digits_dls, text_dls, EAGER_PRECISION, GRAD_TOL, assert_close_to

BACKEND = 'aot_eager' # Traces forward and backward like inductor, without its C++ compile time
_library_dir = str(Path(fastxtend_compile.__file__).resolve().parent)

def frames_ok()->int: return torch._dynamo.utils.counters['frames']['ok']
def dynamo_callbacks()->tuple:
    h = torch._dynamo.callback.callback_handler
    return len(h.start_callbacks), len(h.end_callbacks)
def grad_state(model)->list: return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
def marks(model)->list: return [p.__dict__.get('_dynamo_static_input_type') for p in model.parameters()]
def quiet_fit(learn, *args, **kwargs):
    with learn.no_bar(), learn.no_logging(): learn.fit(*args, **kwargs)

# --- 1. One graph per model, whatever its top module ---------------------------------------------------------------

class TokenBag(nn.Module):
    "A small text classifier: embedding, mean over the tokens, linear (AWD_LSTM itself has graph breaks in fastai's code)"
    def __init__(self, vocab_sz, n_out=2): super().__init__(); self.emb, self.lin = nn.Embedding(vocab_sz, 16), nn.Linear(16, n_out)
    def forward(self, x): return self.lin(self.emb(x).mean(1))

def _image_dls(path:Path):
    "Small 3-channel 32px images in two class folders, written with PIL"
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in ('dark', 'light'):
        (path/c).mkdir(parents=True)
        for i in range(16):
            arr = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            if c == 'dark': arr //= 4
            Image.fromarray(arr).save(path/c/f'{i}.png')
    return ImageDataLoaders.from_folder(path, valid_pct=0.25, seed=0, bs=8, num_workers=0)

def _learner(kind, tmp_path, digits, cancer):
    if kind == 'sequential': return Learner(digits, two_conv_cnn())
    if kind == 'vision': return vision_learner(_image_dls(tmp_path/'images'), resnet18, pretrained=False)
    if kind == 'tabular': return tabular_learner(cancer, layers=[32, 16])
    dls = text_dls()
    return Learner(dls, TokenBag(len(dls.vocab[0])))

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['sequential', 'vision', 'tabular', 'text'])
def test_one_graph_per_model(kind, tmp_path, digits, cancer):
    learn = _learner(kind, tmp_path, digits, cancer).compile(backend=BACKEND)
    name = type(inner_model(learn.model)).__name__
    ok0 = frames_ok()
    quiet_fit(learn, 1)
    r = learn.compiler.report
    assert r.graph_breaks == 0 and r.fallbacks == [], r.summary()
    compiles = [e for e in r.events if e.kind == 'compile' and e.frame == name]
    assert len(compiles) == 1 and compiles[0].during == 'training batch 1', r.events
    # Training compiled the model's frame alone: no frame of fastai or torch code around or inside it
    assert {e.frame for e in r.events if e.during.startswith('training')} <= {name, 'optimizer step'}, r.events
    assert {e.frame for e in r.events} - {'optimizer step'} == {name}, r.events
    assert frames_ok() - ok0 == r.graphs, (frames_ok() - ok0, r.events)

class LengthSpy(Callback):
    "The training batches' lengths"
    def __init__(self): self.lengths = []
    def before_batch(self):
        if self.training: self.lengths.append(self.xb[0].shape[1])

def test_text_of_changing_length_compiles_one_dynamic_graph():
    dls = ragged_text_dls()
    def fit(compiled):
        set_seed(0, reproducible=True)
        learn = Learner(dls, TokenBag(len(dls.vocab[0])), cbs=LengthSpy())
        if compiled: learn.compile(backend=BACKEND)
        quiet_fit(learn, 2, 1e-2)
        return learn
    eager, learn = fit(False), fit(True)
    assert len(set(learn.length_spy.lengths)) >= 5, learn.length_spy.lengths # The batches' lengths do change
    r = learn.compiler.report
    model = [e for e in r.events if e.frame == 'TokenBag']
    # The first length compiles a static graph, the third the dynamic one that serves every length after it
    assert [e.kind for e in model] == ['compile', 'compile'] and r.fallbacks == [], r.summary()
    assert ("compiled dynamically: the training inputs of TokenBag kept changing in size (16×n; n for a size that changed), so "
            "one graph serves them all") in r.summary(), r.summary()
    assert_fit_close(eager.model, learn.model)

# --- 2. A model whose call captures nothing warns ------------------------------------------------------------------

class Skipped(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(64, 10)
    @torch._dynamo.disable
    def forward(self, x): return self.lin(x.flatten(1))

def test_model_whose_call_captures_nothing_warns(digits):
    learn = Learner(digits, Skipped()).compile(backend=BACKEND)
    with pytest.warns(UserWarning, match="torch.compile captured no graph of Skipped") as rec: quiet_fit(learn, 1)
    assert len([w for w in rec if 'captured no graph' in str(w.message)]) == 1 # Once, not at every call

# --- 3. Gradients as fastai's callbacks see them -------------------------------------------------------------------

class GradSpy(Callback):
    "The gradients each training batch's callbacks see"
    order = CompilerCallback.order + 1
    def before_fit(self): self.backward, self.step, self.batch = [], [], []
    def before_backward(self): self.backward.append(grad_state(self.learn.model))
    def after_step(self): self.step.append(grad_state(self.learn.model))
    def after_batch(self):
        if self.training: self.batch.append(grad_state(self.learn.model))

@pytest.mark.slow
@pytest.mark.parametrize('compile_opt', [True, False])
def test_gradients_as_callbacks_see_them(compile_opt):
    set_seed(0, reproducible=True)
    init = two_conv_cnn().state_dict()
    runs = []
    for compiled in (False, True):
        set_seed(1, reproducible=True)
        model = two_conv_cnn()
        model.load_state_dict(init)
        learn = Learner(digits_dls(), model, opt_func=SGD, cbs=GradSpy())
        if compiled: learn.compile(backend=BACKEND, compile_opt=compile_opt, **EAGER_PRECISION)
        quiet_fit(learn, 1, 0.1)
        runs.append(learn.grad_spy)
    eager, comp = runs
    n = len(eager.step)
    assert n > 2 and len(comp.step) == len(comp.batch) == len(comp.backward) == n
    for i,(e,c) in enumerate(zip(eager.step, comp.step)): # after_step: the gradients the step used
        assert all(g is not None for g in c), f"batch {i}: a gradient is None in after_step"
        for j,(ge,gc) in enumerate(zip(e, c)): assert_close_to(gc, ge, GRAD_TOL, f'batch {i}, gradient {j}')
    for i,c in enumerate(comp.batch): # after_batch: fastai's `zero_grad` left them zero, in place
        assert all(g is not None and not g.any() for g in c), f"batch {i}: a gradient in after_batch is None or not zero"
    assert all(g is None for g in comp.backward[0]) and all(g is None for g in eager.backward[0])
    for i,c in enumerate(comp.backward[1:], 1): # The next before_backward: still zero
        assert all(g is not None and not g.any() for g in c), f"batch {i}: a gradient in before_backward is None or not zero"

# --- 4. No warnings of our making ----------------------------------------------------------------------------------

def test_no_warnings_of_our_making():
    learn = Learner(digits_dls(), two_conv_cnn()).compile(backend=BACKEND)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        quiet_fit(learn, 1)
    ours = [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in rec
            if 'shadowing' in str(w.message) or str(Path(w.filename).resolve()).startswith(_library_dir)]
    assert ours == []

# --- 5. Output -----------------------------------------------------------------------------------------------------

def _verbose_learner(**kwargs):
    learn = Learner(digits_dls(), two_conv_cnn(), cbs=CompilerCallback(backend=BACKEND, verbose=True, **kwargs))
    learn.compiler.compile_recorder.notice_after = 0
    return learn

def threads()->set:
    "Running threads, but tqdm's monitor, which torch.fx's progress bar starts (and ends) in any compile"
    return {t for t in threading.enumerate() if type(t).__name__ != 'TMonitor'}

def ours(out:str)->list: return [l.strip() for l in out.replace('\r', '\n').splitlines() if 'torch.compile' in l]

def test_no_output_under_no_logging(capsys):
    threads0 = threads()
    learn = _verbose_learner()
    with learn.no_logging(): learn.fit(1)
    assert ours(capsys.readouterr().out) == [], "printed under learn.no_logging()"
    learn = _verbose_learner()
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    out = capsys.readouterr().out
    assert ours(out) == [] and out.strip() == '', "printed under learn.no_bar() and learn.no_logging()"
    assert threads() == threads0

def test_compile_notices_name_the_batch(capsys):
    threads0 = threads()
    learn = _verbose_learner(compile_valid=True) # The fit's validation compiled too, and announced
    with learn.no_bar(): learn.fit(1)
    out = capsys.readouterr().out
    assert re.search(r"torch.compile compiled \w+ for training batch 1 in [\d.]+s", out), out
    assert re.search(r"torch.compile compiled \w+ for validation in [\d.]+s", out), out
    assert threads() == threads0

# --- 6. Hooks ------------------------------------------------------------------------------------------------------

def test_activation_stats_runs_eagerly_then_compiles(digits):
    learn = Learner(digits, two_conv_cnn(), cbs=ActivationStats(with_hist=False)).compile(backend=BACKEND)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        quiet_fit(learn, 1)
    hooks = [str(w.message) for w in rec if 'ActivationStats registered hooks on' in str(w.message)]
    assert len(hooks) == 1 and 'runs eagerly while they are registered' in hooks[0], hooks
    r = learn.compiler.report
    assert r.fallbacks == [] and len(r.recompiles) <= 2, r.summary()
    eager = Learner(digits, two_conv_cnn(), cbs=ActivationStats(with_hist=False))
    quiet_fit(eager, 1)
    assert len(learn.activation_stats.stats) == len(eager.activation_stats.stats) > 0
    # The fit removed its hooks; without the callback, the next fit runs compiled
    learn.remove_cb(learn.activation_stats)
    n, g0 = len(r.events), graphs_compiled()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        quiet_fit(learn, 1)
    assert not [w for w in rec if 'registered hooks' in str(w.message)]
    assert any(e.kind in ('compile', 'recompile') and e.frame == 'Sequential' for e in r.events[n:]), r.events
    assert graphs_compiled() > g0 and is_compiled(learn.model)

def test_forward_hook_added_after_compiling_fires(digits):
    learn = Learner(digits, two_conv_cnn()).compile(backend=BACKEND)
    quiet_fit(learn, 1)
    xb = digits.one_batch()[0]
    calls = []
    h = learn.model[0].register_forward_hook(lambda m,i,o: calls.append(1))
    learn.model(xb)
    assert calls == [1]
    assert is_compiled(learn.model)
    h.remove()
    learn.model(xb)
    assert calls == [1]

# --- 7. Exports ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_export_during_fit_loads_with_plain_fastai(tmp_path, monkeypatch):
    class ExportMid(Callback): # Defined here, so it is pickled by value: the fresh process needn't import this file
        order = CompilerCallback.order + 1
        def after_epoch(self): self.learn.export('mid.pkl')
    seen, fastai_export = {}, Learner.export # What the model's parameters carry around the export
    def export(self, *args, **kwargs):
        seen['before'] = marks(self.model)
        fastai_export(self, *args, **kwargs)
        seen['after'] = marks(self.model)
    monkeypatch.setattr(Learner, 'export', export)
    learn = Learner(digits_dls(), two_conv_cnn(), path=tmp_path).compile(backend=BACKEND)
    quiet_fit(learn, 1, cbs=ExportMid())
    assert is_compiled(learn.model) and any(isinstance(c, CompilerCallback) for c in learn.cbs)
    # The parameters keep the marks TorchDynamo set on them
    assert any(m is not None for m in seen['before']), "TorchDynamo marked no parameter: nothing to check"
    assert seen['after'] == seen['before'] == marks(learn.model)
    raw = (tmp_path/'mid.pkl').read_bytes()
    assert b'fastxtend_compile' not in raw and b'_dynamo_static_input_type' not in raw
    script = textwrap.dedent(f"""
        import sys, warnings
        warnings.simplefilter('ignore')
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import digits_dls # the DataBlock's getters live there
        from fastai.learner import load_learner
        learn = load_learner({str(tmp_path/'mid.pkl')!r})
        assert 'fastxtend_compile' not in sys.modules
        assert getattr(learn.model, '_compiled_call_impl', None) is None
        preds = learn.get_preds(dl=learn.dls.test_dl(digits_dls().valid_ds.items[:8]))[0]
        assert preds.shape == (8, 10)
        print('ok')
    """)
    res = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith('ok'), res.stdout[-1000:] + res.stderr[-3000:]

# --- 8. Nothing left behind ----------------------------------------------------------------------------------------

class BoomAt2(Callback):
    def after_batch(self):
        if self.training and self.iter == 1: raise RuntimeError('boom')

def test_fit_scoped_compiler_raising_leaves_nothing_behind():
    n_cbs, handlers, precision = dynamo_callbacks(), list(logging.getLogger('torch._dynamo.convert_frame').handlers), torch.get_float32_matmul_precision()
    grads = []
    for compiled in (False, True):
        learn = Learner(digits_dls(), two_conv_cnn())
        cbs = [BoomAt2()] + ([CompilerCallback(backend=BACKEND)] if compiled else [])
        with pytest.raises(RuntimeError, match='boom'): quiet_fit(learn, 1, cbs=cbs)
        grads.append(grad_state(learn.model))
    eager, comp = grads
    assert [g is None for g in comp] == [g is None for g in eager]
    assert all(g is None or not g.any() for g in comp)
    assert dynamo_callbacks() == n_cbs
    assert logging.getLogger('torch._dynamo.convert_frame').handlers == handlers
    assert torch.get_float32_matmul_precision() == precision
    assert not is_compiled(learn.model) and compiled_optimizer_settings(learn.opt) is None
    assert not any(isinstance(c, CompilerCallback) for c in learn.cbs)

def test_keyboard_interrupt_in_frozen_epoch_then_fit_compiles(digits):
    class Interrupt(Callback):
        def after_batch(self):
            if self.training and self.iter == 1: raise KeyboardInterrupt
    learn = Learner(digits, bn_cnn(), splitter=body_head_splitter).compile(backend=BACKEND)
    learn.freeze()
    n_cbs = dynamo_callbacks()
    try:
        with learn.no_bar(), learn.no_logging(): learn.fine_tune(1, cbs=Interrupt())
    except KeyboardInterrupt: pass
    else: pytest.fail("KeyboardInterrupt was not raised")
    assert not is_compiled(learn.model) # compile_frozen=False: the frozen epoch ran eagerly
    assert dynamo_callbacks() == n_cbs and not learn.compiler.active and learn.compiler.fits == 0
    quiet_fit(learn, 1)
    assert is_compiled(learn.model)
    assert any(e.kind == 'compile' and e.frame == 'Sequential' for e in learn.compiler.report.events), learn.compiler.report.events

def test_a_models_own_bug_raises_eagers_error(digits):
    "A shape that doesn't fit fails TorchDynamo's trace with an error about fake tensors: the user gets eager's error"
    errors = []
    for compiled in (False, True):
        learn = Learner(digits, nn.Sequential(nn.Flatten(), nn.Linear(60, 10))) # The digits have 64 pixels
        if compiled: learn.compile(backend=BACKEND)
        with pytest.raises(RuntimeError) as e: quiet_fit(learn, 1)
        errors.append(e.value)
    eager, comp = errors
    assert type(comp) is type(eager) is RuntimeError and str(comp) == str(eager)
    assert str(comp).endswith('mat1 and mat2 shapes cannot be multiplied (64x64 and 60x10)')
    assert comp.__cause__ is None and comp.__context__ is None # Not chained to TorchDynamo's
    assert not learn.compiler.active # The fit's changes were undone, as for any error
    learn.model[1] = nn.Linear(64, 10) # Fixed (and given to a new optimizer, as fastai needs), the model trains compiled
    before = learn.model[1].weight.detach().clone()
    quiet_fit(learn, 1, reset_opt=True)
    assert not torch.equal(before, learn.model[1].weight.cpu()) and learn.compiler.report.graphs >= 1, learn.compiler.report.events

def test_a_trace_that_fails_where_eager_runs_raises_the_compilers_error():
    "Where eager runs what TorchDynamo's trace failed on, its error stands, and eager's run leaves no running statistics"
    model = compile_model(bn_cnn(), **compile_settings(backend=BACKEND))
    call, failure = compiled_call(model), traced_op_error()('the compiler failed')
    def fail(*args, **kwargs): raise failure
    call.entry = fail
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(traced_op_error()) as e: model(torch.randn(4, 1, 8, 8))
    assert e.value is failure
    assert all(torch.equal(a, b) for a,b in zip(before, model.buffers()))

@pytest.mark.slow
@pytest.mark.parametrize('how', ['instance', 'class'])
def test_removing_compiler_returns_learner_to_eager(digits, how):
    learn = Learner(digits, two_conv_cnn()).compile(backend=BACKEND)
    quiet_fit(learn, 1)
    assert is_compiled(learn.model) and compiled_optimizer_settings(learn.opt) is not None
    learn.remove_cb(learn.compiler if how == 'instance' else CompilerCallback)
    assert not any(isinstance(c, CompilerCallback) for c in learn.cbs)
    assert not is_compiled(learn.model) and compiled_optimizer_settings(learn.opt) is None
    g0 = graphs_compiled()
    quiet_fit(learn, 1)
    assert graphs_compiled() == g0 and not is_compiled(learn.model)

class Toy(nn.Module):
    "A model with two graph breaks: a `print` and data-dependent control flow"
    def __init__(self): super().__init__(); self.lin = nn.Linear(64, 10)
    def forward(self, x):
        x = x.flatten(1)
        print('toy forward')
        if x.sum() < 0: x = -x
        return self.lin(x)

class Block(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(32, 32)
    def forward(self, x):
        print('block forward')
        if x.sum() < 0: x = -x
        return torch.relu(self.lin(x))

class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(64, 32), nn.Sequential(Block(), Block(), Block()), nn.Linear(32, 10)
    def forward(self, x): return self.out(self.blocks(self.inp(x.flatten(1))))

@pytest.mark.parametrize('regional', [False, True])
def test_fullgraph_refusal_leaves_learner_eager(digits, regional):
    learn = Learner(digits, Tower() if regional else Toy()).compile(backend=BACKEND, fullgraph=True, regional=regional)
    with pytest.raises(GraphBreakError, match='fullgraph=True, but the model has a graph break'): quiet_fit(learn, 1)
    assert not any(is_compiled(m) for m in learn.model.modules())
    assert learn.opt is not None and compiled_optimizer_settings(learn.opt) is None
    assert not any(isinstance(c, CompilerCallback) for c in learn.cbs) and not hasattr(learn, 'compiler')
    g0 = graphs_compiled()
    quiet_fit(learn, 1)
    assert graphs_compiled() == g0 and len(learn.recorder.values) == 1

# --- 9. DynamoExplainCallback doesn't reset TorchDynamo --------------------------------------------------------------

def test_explain_keeps_other_learners_graphs(digits):
    a = Learner(digits, two_conv_cnn()).compile(backend=BACKEND)
    quiet_fit(a, 1)
    n = len(a.compiler.report.events)
    b = Learner(digits, two_conv_cnn(), cbs=DynamoExplainCallback(print_results=False))
    quiet_fit(b, 1)
    assert b.dynamo_explain.explain_output is not None
    g0 = graphs_compiled()
    quiet_fit(a, 1)
    assert [e for e in a.compiler.report.events[n:] if e.frame == 'Sequential'] == []
    assert graphs_compiled() == g0

def test_explain_summary_counts_the_breaks_it_lists(digits):
    learn = Learner(digits, Toy(), cbs=DynamoExplainCallback(print_results=False))
    quiet_fit(learn, 1)
    s = learn.dynamo_explain.summary()
    n = int(re.search(r"(\d+) graph break\(s\)", s)[1])
    listed = re.findall(r"^  Graph break \d+ at ", s, flags=re.M)
    assert n == len(listed) >= 2, s
    assert 'print' in s and 'x.sum() < 0' in s, s

# --- 10. Report names causes right ---------------------------------------------------------------------------------

def test_recompile_for_a_new_batch_size_is_named():
    dls = digits_dls()
    learn = Learner(dls, two_conv_cnn()).compile(backend=BACKEND)
    quiet_fit(learn, 1)
    r = learn.compiler.report
    assert {e.during for e in r.events} == {'training batch 1'}, r.events # The fit's validation runs eagerly
    n = len(r.events)
    learn.dls.train.bs = 32
    quiet_fit(learn, 1)
    new = [e for e in r.events[n:] if e.during.startswith('training')]
    assert new and new[0].kind == 'recompile', r.events[n:]
    assert new[0].reason.startswith('batch size changed from 64 to 32'), new[0]

def test_freeze_with_one_param_group_is_not_blamed():
    dls = digits_dls()
    learn = Learner(dls, two_conv_cnn()).compile(backend=BACKEND) # One parameter group: nothing to freeze
    quiet_fit(learn, 1)
    r = learn.compiler.report
    n = len(r.events)
    trains = [p.requires_grad for p in learn.model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.freeze()
    assert [p.requires_grad for p in learn.model.parameters()] == trains
    learn.dls.train.bs = 32
    quiet_fit(learn, 1)
    assert r.recompiles and r.events[n:], r.events
    assert not any('requires_grad' in e.reason for e in r.events[n:]), r.events[n:]

# --- 11. Bad input refused at construction, naming the parameter ---------------------------------------------------

def test_bad_settings_refused_naming_the_parameter(digits):
    with pytest.raises(TypeError, match=re.escape("dynamic must be True, False or None, not 'false'")): CompilerCallback(dynamic='false')
    with pytest.raises(TypeError, match=re.escape("fullgraph must be True or False, not 'false'")): CompilerCallback(fullgraph='false')
    with pytest.raises(TypeError, match=re.escape("ddp_compiled_autograd must be True or False, not 1")): CompilerCallback(ddp_compiled_autograd=1)
    for flag in ('recompile', 'verbose', 'regional', 'compile_valid', 'compile_opt'): # A string such as 'no' would read as on
        with pytest.raises(TypeError, match=re.escape(f"{flag} must be True or False, not 'no'")): CompilerCallback(**{flag: 'no'})
    with pytest.raises(TypeError, match=re.escape("compile_valid must be True or False, not None")): CompilerCallback().compile_valid = None
    with pytest.raises(TypeError, match=re.escape("break_reasons must be True or False, not 'yes'")): DynamoExplainCallback(break_reasons='yes')
    with pytest.raises(ValueError, match=re.escape("Choose ddp_compiled_autograd=True or precompile=True, not both")):
        CompilerCallback(ddp_compiled_autograd=True, precompile=True)
    with pytest.raises(ValueError, match=re.escape("ddp_compiled_autograd=True does not run with CUDA graphs (mode='reduce-overhead')")):
        CompilerCallback(ddp_compiled_autograd=True, mode='reduce-overhead')
    with pytest.raises(ValueError, match=re.escape("Unknown inductor option(s) in options: 'not_an_option'")):
        CompilerCallback(options={'not_an_option': 1})
    learn = Learner(digits, two_conv_cnn()).compile(backend=BACKEND)
    cb = learn.compiler
    for bad, error in ((dict(dynamic='false'), "dynamic must be True, False or None, not 'false'"),
                       (dict(fullgraph='false'), "fullgraph must be True or False, not 'false'"),
                       (dict(verbose='no'), "verbose must be True or False, not 'no'"),
                       (dict(ddp_compiled_autograd=None), "ddp_compiled_autograd must be True or False, not None"),
                       (dict(ddp_compiled_autograd=True, precompile=True), "Choose ddp_compiled_autograd=True or precompile=True, not both"),
                       (dict(options={'not_an_option': 1}), "Unknown inductor option(s) in options: 'not_an_option'"),
                       (dict(backend='no_such_backend'), "Unknown torch.compile backend 'no_such_backend'; choose one of: ")):
        with pytest.raises((TypeError, ValueError), match=re.escape(error)): learn.compile(**bad)
        assert learn.compiler is cb and [c for c in learn.cbs if isinstance(c, CompilerCallback)] == [cb]

# --- 12. validate() and get_preds() inside a compiled fit ----------------------------------------------------------

def test_validate_and_get_preds_inside_a_fit(digits):
    class InnerInference(Callback):
        order = CompilerCallback.order + 1
        def __init__(self): self.compiled, self.busy, self.ran = [], False, 0
        def after_batch(self):
            if self.training and not self.busy: self.compiled.append((self.learn.compiler.active, is_compiled(self.learn.model)))
        def after_epoch(self):
            if self.busy or self.epoch != 0 or self.ran: return
            self.busy = True
            try:
                self.learn.validate()
                self.learn.get_preds()
            finally: self.busy = False
            self.ran += 1
    learn = Learner(digits, two_conv_cnn()).compile(backend=BACKEND)
    n_cbs = dynamo_callbacks()
    cb = InnerInference()
    quiet_fit(learn, 2, cbs=cb)
    assert cb.ran == 1
    assert dynamo_callbacks() == n_cbs
    assert not learn.compiler.active and learn.compiler.fits == 0
    r = learn.compiler.report
    assert any(e.kind == 'compile' and e.frame == 'Sequential' and e.during == 'training batch 1' for e in r.events), r.events
    assert len(cb.compiled) == 2 * len(digits.train) and all(a and c for a,c in cb.compiled), cb.compiled
    assert len(r.batch_times) + len(r.eager_times) == 2 * len(digits.train) # The report timed every training batch

@pytest.mark.parametrize('regional', [False, True])
def test_unfreezing_a_compiled_model_trains_what_it_unfroze(regional):
    "torch 2.11 doesn't guard a parameter's `requires_grad` for a module passed as an argument: one graph per freeze state"
    class Block(nn.Module):
        def __init__(self): super().__init__(); self.lin = nn.Linear(4, 4)
        def forward(self, x): return self.lin(x).relu()
    m = nn.Sequential(Block(), Block(), nn.Linear(4, 2))
    compile_model(m, regional=regional, backend='aot_eager')
    x, graphs = torch.randn(3, 4), graphs_compiled
    g0 = graphs()
    def step(): m.zero_grad(set_to_none=True); m(x).sum().backward(); return [p.grad is not None for p in m[0].parameters()]
    for p in m[0].parameters(): p.requires_grad_(False)
    assert step() == [False, False]
    for p in m[0].parameters(): p.requires_grad_(True)
    assert step() == [True, True] # The unfrozen block gets its gradients
    for p in m[0].parameters(): p.requires_grad_(False)
    assert step() == [False, False]
    # Frozen, unfrozen: two graphs (each state once; regional: the frozen block, its trained twin, and the unfrozen one)
    assert graphs() - g0 == (3 if regional else 2)
