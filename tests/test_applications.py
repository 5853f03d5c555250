"Every fastai application's batches reach the compiled model as plain tensors; real data trains as well as eager"
import subprocess, sys, textwrap, cloudpickle
import numpy as np, pytest, torch
from torch import nn
from fastai.learner import Learner
from fastai.torch_core import set_seed, TensorBase
from fastai.metrics import accuracy
from fastai.tabular.learner import tabular_learner
import fastai.callback.schedule
from fastxtend_compile import *
from fastxtend_compile.internals import compiled_call
from fastai.layers import ToTensorBase
from fastai.vision.all import unet_learner, resnet18
from conftest import two_conv_cnn, digits_dls, cancer_dls, text_dls, ragged_text_dls, segmentation_dls, assert_fit_close, EAGER_PRECISION, payoff_says

def compile_counts(learn):
    r = learn.compiler.report
    return r.graph_breaks, len(r.recompiles), len(r.fallbacks)

class MLP(nn.Module):
    "An MLP over the flattened 8x8 digits"
    def __init__(self): super().__init__(); self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    def forward(self, x): return self.layers(x)

@pytest.mark.slow
@pytest.mark.parametrize('model', [two_conv_cnn, MLP], ids=['cnn', 'mlp'])
def test_vision_no_graph_breaks(model, monkeypatch):
    payoff_says(monkeypatch, False)
    dls = digits_dls()
    learn = Learner(dls, model(), metrics=accuracy).compile(backend='aot_eager')
    learn.fit(2)
    breaks, recompiles, fallbacks = compile_counts(learn)
    assert (breaks, fallbacks) == (0, 0)
    # One graph, for training (fastai's `Adam` runs PyTorch's fused kernel, uncompiled): the fit's validation runs eagerly
    r = learn.compiler.report
    assert [e.kind for e in r.events] == ['compile'] and r.eager_valid == 2*len(dls.valid) and not r.eager_calls
    # `validate` alone, whose batches wouldn't pay back an evaluation graph: they run eagerly too
    learn.validate()
    assert [e.kind for e in r.events] == ['compile'] and r.eager_eval == len(dls.valid)
    learn.compiler.compile_valid = True # Asked for, it compiles, without gradients; its smaller last batch runs eagerly
    learn.validate()
    assert [e.kind for e in r.events] == ['compile', 'recompile'] and r.eager_valid == 2*len(dls.valid)
    assert len({e.frame for e in r.events}) == 1 # the model: `Sequential`, or the `forward` of a model class
    last = len(dls.valid_ds) % dls.valid.bs
    assert last and r.eager_calls == {((False, False), ((last, 1, 8, 8),)): 1}

def test_tabular_no_graph_breaks(cancer):
    learn = tabular_learner(cancer, layers=[32, 16], metrics=accuracy).compile(backend='aot_eager')
    xb = cancer.one_batch()
    assert [type(t) for t in xb[:2]] == [torch.Tensor, torch.Tensor] # fastai's tabular batches are plain tensors
    learn.fit(2)
    breaks, recompiles, fallbacks = compile_counts(learn)
    assert (breaks, fallbacks) == (0, 0) and recompiles <= 2

def test_text_batches_are_plain_inside_the_model():
    dls = text_dls()
    xb,_ = dls.one_batch()
    assert isinstance(xb, TensorBase) # fastai's TensorText
    seen = []
    class Embed(nn.Module):
        def __init__(self): super().__init__(); self.emb, self.lin = nn.Embedding(len(dls.vocab[0]), 8), nn.Linear(8, 2)
        def forward(self, x): return self.lin(self.emb(x).mean(1))
    learn = Learner(dls, Embed(), metrics=accuracy).compile(backend='aot_eager', compile_valid=True) # `get_preds` compiled too
    learn.fit(1)
    assert learn.compiler.report.graph_breaks == 0 and not learn.compiler.report.fallbacks
    call = compiled_call(learn.model) # What the compiled code is called with, during inference
    compiled = call.entry
    call.entry = lambda module, *args, **kwargs: (seen.extend(map(type, args)), compiled(module, *args, **kwargs))[1]
    preds = learn.get_preds()[0] # fastai's `CastToTensor` hands the model plain tensors in its loops...
    assert preds.shape[1] == 2
    assert seen and set(seen) == {torch.Tensor}
    seen.clear()
    out = learn.model(xb) # ...and so does the compiled call when it's given a typed batch directly
    assert set(seen) == {torch.Tensor} and type(out) is type(xb)

def test_awd_lstm_compiles_around_its_lstms():
    "fastai's AWD_LSTM classifier: its LSTMs run eagerly, with a handful of graphs around them and no graph break or fallback"
    from fastai.text.learner import text_classifier_learner
    from fastai.text.models.awdlstm import AWD_LSTM
    dls = ragged_text_dls()
    def fit(compiled):
        set_seed(0, reproducible=True)
        learn = text_classifier_learner(dls, AWD_LSTM, pretrained=False, config=dict(emb_sz=32, n_hid=48, n_layers=2))
        if compiled: learn.compile(backend='aot_eager')
        with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
        return learn
    eager, learn = fit(False), fit(True)
    r = learn.compiler.report
    assert r.graph_breaks == 0 and r.fallbacks == [] and len([e for e in r.events if e.frame != 'optimizer step']) <= 8, r.summary()
    assert ("ran eagerly: the model's LSTM layers, which TorchDynamo doesn't trace (it would break the graph at each); "
            "compiled around them: EmbeddingDropout, PoolingLinearClassifier") in r.summary(), r.summary()
    assert_fit_close(eager.model, learn.model)

@pytest.mark.slow
def test_unet_fine_tunes_as_one_graph_with_eager_types(tmp_path):
    "`unet_learner`'s `DynamicUnet` casts its output to `TensorBase` (`ToTensorBase`): compiled, it trains and predicts as eager"
    learns = []
    for compiled in (False, True):
        set_seed(0, reproducible=True)
        dls = segmentation_dls(tmp_path) # Of its own: a DataLoader's shuffling draws from a generator it keeps
        learn = unet_learner(dls, resnet18, pretrained=False, path=tmp_path)
        # fastai's own `Adam` step in both: its fused kernel rounds apart from it, and through the loss's jump as the encoder
        # unfreezes, Adam's first steps turn that rounding into whole steps (a quarter of the encoder's update, on a CPU)
        if compiled: learn.compile(backend='aot_eager', compile_opt=False, **EAGER_PRECISION)
        else: start = [p.detach().clone() for p in learn.model.parameters()] # The same seeded weights in both
        learn.fine_tune(1)
        learns.append(learn)
    eager, learn = learns
    r = learn.compiler.report
    assert (r.graph_breaks, r.fallbacks) == (0, []) and [e.kind for e in r.events] == ['compile'] # The frozen epoch ran eagerly
    # On a GPU the encoder's weights, unfrozen for 4 steps at lr 2e-5, are a few Adam steps from where they started, and
    # Adam turns the other kernels' rounding into whole steps (2% of one BatchNorm bias's norm, H200): the predictions tell
    if not torch.cuda.is_available(): assert_fit_close(eager.model, learn.model, start)
    (p_eager, _), (p, _) = eager.get_preds(), learn.get_preds()
    assert type(p) is type(p_eager) is TensorBase # Not a `TensorImage`, which fastai would decode as an image
    # Probabilities, from weights that drift as above: 5e-5 apart on the CPU
    torch.testing.assert_close(p.softmax(1), p_eager.softmax(1), rtol=0, atol=1e-2 if torch.cuda.is_available() else 1e-3)
    cast = learn.model.layers[-1]
    assert isinstance(cast, ToTensorBase) and cast.tensor_cls is TensorBase # As before the compiled calls
    learn.export('unet.pkl')
    mask = load_learner(tmp_path/'unet.pkl').predict(dls.valid_ds.items[0])[0]
    assert mask.shape == (32, 32) and set(mask.unique().tolist()) <= {0, 1}

@pytest.mark.parametrize('make_learner', [lambda: Learner(digits_dls(), two_conv_cnn(), metrics=accuracy),
                                          lambda: tabular_learner(cancer_dls(), layers=[64, 32], metrics=accuracy)],
                         ids=['digits', 'breast_cancer_tabular'])
@pytest.mark.slow
def test_compiled_accuracy_matches_eager(make_learner):
    "Real data through a DataBlock: compiled training (inductor) reaches the eager accuracy within 1 point, same seed"
    accs = []
    for compiled in (False, True):
        set_seed(42, reproducible=True)
        learn = make_learner()
        if compiled: learn.compile()
        learn.fit_one_cycle(3, 1e-2)
        accs.append(float(learn.validate()[1]))
    assert accs[0] > 0.9
    assert abs(accs[0] - accs[1]) <= 0.01, accs

@pytest.mark.slow
def test_export_loads_in_fresh_process_without_this_library(tmp_path):
    dls = digits_dls()
    learn = Learner(dls, two_conv_cnn(), path=tmp_path, metrics=accuracy).compile(backend='aot_eager', **EAGER_PRECISION)
    learn.fit(1)
    item = dls.valid_ds.items[:8]
    expected = learn.get_preds(dl=dls.test_dl(item))[0]
    learn.export('export.pkl')
    assert any(isinstance(cb, CompilerCallback) for cb in learn.cbs) and is_compiled(learn.model) # Learner untouched
    raw = (tmp_path/'export.pkl').read_bytes()
    assert b'fastxtend_compile' not in raw and b'torch._dynamo' not in raw and b'_orig_mod' not in raw
    np.save(tmp_path/'expected.npy', expected.numpy())
    script = textwrap.dedent(f"""
        import sys, numpy as np, torch, warnings
        warnings.simplefilter('ignore')
        sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})
        from conftest import digits_dls # the dataset helpers; the getters the DataBlock pickled live there
        from fastai.learner import load_learner
        learn = load_learner({str(tmp_path/'export.pkl')!r})
        assert 'fastxtend_compile' not in sys.modules
        assert learn.model._compiled_call_impl is None # torch's `Module.__getstate__` drops it
        assert not any('Compiler' in type(cb).__name__ for cb in learn.cbs)
        dls = digits_dls()
        preds = learn.get_preds(dl=learn.dls.test_dl(dls.valid_ds.items[:8]))[0]
        np.testing.assert_allclose(preds.numpy(), np.load({str(tmp_path/'expected.npy')!r}), rtol=1e-5, atol=1e-6)
        print('ok')
    """)
    res = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith('ok'), res.stderr[-3000:]

def test_load_learner_removes_compiler_callback(tmp_path):
    learn = Learner(digits_dls(), two_conv_cnn(), path=tmp_path).compile(backend='aot_eager')
    learn.fit(1)
    torch.save(learn, tmp_path/'with_cb.pkl', pickle_module=cloudpickle) # what fastxtend's export could leave behind
    loaded = load_learner(tmp_path/'with_cb.pkl')
    assert not any(isinstance(cb, CompilerCallback) for cb in loaded.cbs) and not is_compiled(loaded.model)

def test_unet_explains_as_one_graph(tmp_path):
    "`DynamoExplainCallback` traces `DynamicUnet` as the compiled call runs it, its `ToTensorBase` passing the tensor through"
    cb = DynamoExplainCallback(print_results=False)
    learn = unet_learner(segmentation_dls(tmp_path), resnet18, pretrained=False, cbs=cb)
    learn.fit(1)
    assert (cb.explain_output.graph_count, cb.explain_output.graph_break_count) == (1, 0)
    assert learn.model.layers[-1].tensor_cls is TensorBase
