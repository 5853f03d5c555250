"The public API: names, signatures, defaults, and the errors bad input gets"
import inspect, re, pytest, torch
from torch import nn
from fastai.learner import Learner
from fastai.torch_core import TensorImage
from fastai.test_utils import synth_learner
import fastxtend_compile
from fastxtend_compile import *
from fastxtend_compile.core import compile_settings
from conftest import two_conv_cnn

def defaults(f): return {k: v.default for k,v in inspect.signature(f).parameters.items() if k not in ('self', 'kwargs')}

compile_defaults = dict(fullgraph=False, dynamic=False, backend='inductor', mode=None, options=None,
                        matmul_precision='high', recompile=False, verbose=False, regional=False, compile_valid=False, compile_opt=True,
                        ddp_compiled_autograd=False, precompile=False, background=None)

public_api = ['CompileMode', 'MatMulPrecision', 'CompilerCallback', 'DynamoExplainCallback', 'load_learner', # fastxtend's
    'GraphBreakError', 'compile_model', 'uncompile_model', 'is_compiled', 'compiled_settings', # Compiling a model
    'CompileReport', 'CompileEvent', # The report
    'compile_optimizer', 'uncompile_optimizer', 'compiled_optimizer_settings', 'step_rules', 'StepRule', # The optimizer step
    'explain_summary', 'CompileStage'] # The explain tools

def test_public_api_is_these_names():
    assert sorted(fastxtend_compile.__all__) == sorted(public_api)
    ns = {}
    exec('from fastxtend_compile import *', ns)
    assert sorted(k for k in ns if not k.startswith('__')) == sorted(public_api)

def test_star_import_gives_the_api():
    ns = {}
    exec('from fastxtend_compile import *', ns)
    for name in ('CompileMode', 'MatMulPrecision', 'CompilerCallback', 'DynamoExplainCallback', 'load_learner', 'CompileReport'):
        assert name in ns, name
    assert not {'core', 'internals', 'callback', 'own_function', 'set_compiled_call'} & set(ns) # The public API only
    for meth in ('compile', 'export', 'freeze_to', 'fine_tune', 'debug_compile', 'save', 'load', 'fit', 'remove_cb',
                 'save_compile_cache', 'load_compile_cache'):
        assert 'fastxtend_compile' in getattr(Learner, meth).__code__.co_filename, meth # Ours, patched over fastai's

def test_signatures_and_defaults():
    assert defaults(CompilerCallback) == compile_defaults
    assert defaults(Learner.compile) == compile_defaults
    assert defaults(DynamoExplainCallback) == dict(print_results=True, out_guards=False, ops_per_graph=False, break_reasons=False)
    ft = defaults(Learner.fine_tune)
    assert ft['compile_frozen'] is False and ft['freeze_epochs'] == 1 and ft['base_lr'] == 2e-3 and ft['lr_mult'] == 100
    assert 'pct_start' in ft and 'cbs' in ft # fit_one_cycle's arguments still delegated
    assert list(inspect.signature(load_learner).parameters)[:3] == ['fname', 'cpu', 'pickle_module']
    assert defaults(load_learner)['cpu'] is True

def test_enums():
    assert [m.value for m in CompileMode] == ['default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs']
    assert [m.value for m in MatMulPrecision] == ['highest', 'high', 'medium']
    assert CompileMode('max-autotune') is CompileMode.maxautotune and MatMulPrecision.high == 'high'
    with pytest.raises(ValueError, match=r"'max_autotune' is not a valid CompileMode; choose one of: 'default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs'"):
        CompileMode('max_autotune')
    with pytest.raises(ValueError, match=r"'hi' is not a valid MatMulPrecision; choose one of: 'highest', 'high', 'medium'"):
        MatMulPrecision('hi')

@pytest.mark.parametrize('kwargs,message', [
    (dict(mode='fastest'), "'fastest' is not a valid CompileMode; choose one of"),
    (dict(matmul_precision='low'), "'low' is not a valid MatMulPrecision; choose one of"),
    (dict(backend='inductr'), "Unknown torch.compile backend 'inductr'; choose one of: "),
    (dict(mode='max-autotune', options={'epilogue_fusion': True}), "Pass either `mode` or `options` to torch.compile, not both"),
    (dict(precompile=True, backend='aot_eager'), "precompile=True needs backend='inductor', not 'aot_eager': TorchDynamo saves its precompiled code only with inductor's"),
    (dict(precompile=True, ddp_compiled_autograd=True), "Choose ddp_compiled_autograd=True or precompile=True, not both"),
])
def test_bad_arguments_refused_before_anything_changes(kwargs, message):
    learn = synth_learner()
    with pytest.raises(ValueError, match=re.escape(message)): CompilerCallback(**kwargs)
    with pytest.raises(ValueError, match=re.escape(message)): learn.compile(**kwargs)
    assert not any(isinstance(cb, CompilerCallback) for cb in learn.cbs)
    learn.fit(1)
    assert not is_compiled(learn.model)

def test_unknown_backend_lists_backends():
    with pytest.raises(ValueError) as e: CompilerCallback(backend='nope')
    for b in torch._dynamo.list_backends(): assert b in str(e.value)

def test_members_and_strings_accepted():
    cb = CompilerCallback(mode=CompileMode.maxautotune_nocudagraphs, matmul_precision=MatMulPrecision.medium, backend='aot_eager')
    assert cb.settings['mode'] == 'max-autotune-no-cudagraphs' and cb.matmul_precision == 'medium'
    assert CompilerCallback(mode='reduce-overhead').settings['mode'] == 'reduce-overhead'

def test_an_event_without_a_method_returns_at_once_and_one_with_runs_as_fastai_runs_it():
    "fastai would look a missing method up through the `Learner`; this callback answers at once, and runs its own"
    class Untouchable:
        def __getattr__(self, k): raise AssertionError(f"asked the Learner for {k!r}")
    cb = CompilerCallback()
    cb.learn = Untouchable()
    assert cb('after_pred') is None and cb('after_loss') is None and cb('after_cancel_batch') is None
    cb, learn = CompilerCallback(), synth_learner()
    cb.learn, learn.training = learn, True
    cb.compile_recorder.part = 'backward'
    assert cb('after_backward') is None and cb.compile_recorder.part == '' # Its own method ran

def test_compile_chains_and_replaces():
    learn = synth_learner()
    assert learn.compile(backend='eager') is learn
    learn.compile(backend='aot_eager', dynamic=True)
    cbs = [cb for cb in learn.cbs if isinstance(cb, CompilerCallback)]
    assert len(cbs) == 1 and learn.compiler is cbs[0] and cbs[0].settings['dynamic'] is True

@pytest.mark.slow
@pytest.mark.parametrize('backend', ['eager', 'aot_eager', 'inductor'])
def test_fastai_tensors_compile_and_match_eager(backend):
    "The issue's two-conv CNN on a `TensorImage` fails under plain torch.compile; compiled here it equals eager"
    torch.manual_seed(0)
    model, xb = two_conv_cnn(), TensorImage(torch.randn(64,1,8,8))
    expected = model(xb)
    compile_model(model, **compile_settings(backend=backend))
    out = model(xb)
    assert type(out) is TensorImage and type(expected) is TensorImage
    torch.testing.assert_close(out.as_subclass(torch.Tensor), expected.as_subclass(torch.Tensor), rtol=1e-5, atol=1e-5)
    assert list(model.state_dict()) == ['0.weight', '0.bias', '2.weight', '2.bias', '5.weight', '5.bias']
    assert isinstance(model[0], nn.Conv2d)

def test_user_compiled_model_is_accepted(digits):
    learn = Learner(digits, torch.compile(two_conv_cnn(), backend='eager'), cbs=CompilerCallback(backend='aot_eager'))
    learn.fit(1)
    assert isinstance(learn.model, nn.Sequential) and compiled_settings(learn.model)['backend'] == 'aot_eager'

def test_matmul_precision_untouched_on_cpu(digits):
    before = torch.get_float32_matmul_precision()
    learn = Learner(digits, two_conv_cnn()).compile(backend='eager', matmul_precision='medium')
    learn.fit(1)
    assert torch.get_float32_matmul_precision() == before
