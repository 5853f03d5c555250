"""Compile only what pays, and say whether it paid: one-off shapes run eagerly, the eager step is measured, the
DataLoader's share of a step is shown"""
from functools import partial
import numpy as np, pytest, torch
from PIL import Image
from torch._dynamo.utils import counters
import fastcore.test as fct
from fastai.learner import Learner
from fastai.torch_core import set_seed
from fastai.optimizer import SGD
from fastai.metrics import accuracy
from fastai.test_utils import synth_learner
from fastai.vision.data import ImageDataLoaders
from fastai.vision.augment import Resize, aug_transforms
from fastai.vision.learner import vision_learner
from torchvision.models import resnet18
from torchvision.models.resnet import BasicBlock
import fastai.callback.schedule
from fastxtend_compile import *
from fastxtend_compile.core import repeated_blocks
from fastxtend_compile.report import plain_reason
from conftest import two_conv_cnn, digits_dls, payoff_says

def image_folder(path, n=200, size=40, seed=0):
    "Two classes of JPEG files, one brighter than the other"
    rng = np.random.default_rng(seed)
    for i in range(n):
        label = ('dark', 'bright')[i % 2]
        (path/label).mkdir(exist_ok=True)
        Image.fromarray((rng.integers(0, 128, (size, size, 3)) + 96*(i % 2)).astype(np.uint8)).save(path/label/f'{i}.jpg')
    return path

@pytest.fixture(scope='module')
def images(tmp_path_factory): return image_folder(tmp_path_factory.mktemp('images'))

def image_learner(path, **kwargs):
    dls = ImageDataLoaders.from_folder(path, valid_pct=0.2, seed=0, item_tfms=Resize(32), batch_tfms=aug_transforms(),
                                       bs=16, num_workers=0)
    return vision_learner(dls, resnet18, pretrained=False, metrics=accuracy).compile(backend='aot_eager', **kwargs)

@pytest.mark.slow
@pytest.mark.parametrize('compile_frozen,compile_valid', [(False, False), (True, False), (True, True)])
def test_fine_tune_compiles_a_graph_per_phase_and_freeze_state(images, compile_frozen, compile_valid, monkeypatch):
    payoff_says(monkeypatch, False)
    learn = image_learner(images, compile_valid=compile_valid)
    n_valid, bs = len(learn.dls.valid_ds), learn.dls.valid.bs
    assert n_valid % bs # The last validation batch is smaller
    with learn.no_bar(), learn.no_logging(): learn.fine_tune(2, compile_frozen=compile_frozen)
    r = learn.compiler.report
    model = [e for e in r.events if e.frame == 'Sequential']
    states = 2 if compile_frozen else 1 # Frozen epochs run eagerly unless `compile_frozen`
    phases = [True, False] if compile_valid else [True] # A training graph, and an evaluation one if validation compiles
    assert len(model) == r.graphs == len(phases)*states and not r.fallbacks, r
    assert [e.during.startswith('training') for e in model] == phases*states
    if compile_frozen: assert [e.reason for e in model[len(phases):]] == [plain_reason('requires_grad mismatch')]*len(phases)
    epochs = 2 + compile_frozen # Validations of compiled fits
    assert r.num_workers == 0 and r.epoch_steps == len(learn.dls.train) # What the payoff and the DataLoader advice read
    if compile_valid: # The smaller last batch ran eagerly in each compiled validation
        assert r.eager_calls == {((False, False), ((n_valid % bs, 3, 32, 32),)): epochs} and not r.eager_valid
    else:
        assert not r.eager_calls and r.eager_valid == epochs*len(learn.dls.valid)
        assert f"ran eagerly, validation within the fit: {r.eager_valid} batch(es)" in r.summary()

@pytest.mark.slow
def test_regional_compiles_a_vision_learners_residual_blocks_once_per_shape_and_phase(images, monkeypatch):
    "vision_learner's model is `Sequential(body, head)`: `regional=True` compiles ResNet-18's residual blocks, not the two halves"
    payoff_says(monkeypatch, False)
    learn = image_learner(images, regional=True)
    blocks = [m for m in learn.model.modules() if isinstance(m, BasicBlock)]
    assert repeated_blocks(learn.model) == blocks
    with learn.no_bar(), learn.no_logging(): learn.fine_tune(1)
    assert all(is_compiled(b) for b in blocks) and not any(is_compiled(m) for m in (learn.model, *learn.model))
    r = learn.compiler.report
    # 8 blocks of 7 parameter shapes (4 stages; stages 2-4 open with a downsampling block): a training graph for each
    # shape, twins of the same shape sharing theirs; the fit's validation runs eagerly
    assert r.graphs == 7 and not r.recompiles and not r.fallbacks, r
    # `validate` alone runs eagerly, its few batches not worth compiling for; asked to, it compiles a graph for each shape
    with learn.no_bar(): learn.validate()
    assert r.graphs == 7 and r.eager_eval == len(learn.dls.valid)
    learn.compiler.compile_valid = True
    with learn.no_bar(): learn.validate()
    assert r.graphs == 14 and len(r.recompiles) == 7 and not r.fallbacks, r
    assert {e.frame for e in r.events} == {'BasicBlock'}
    assert f"recompile of BasicBlock during evaluation outside a fit, 7 times, {sum(e.seconds for e in r.recompiles):.2f}s in all: " in r.summary()
    # The smaller last validation batch ran eagerly through every block: one line for the blocks' input shapes
    once = [l for l in r.summary().splitlines() if 'a shape seen once' in l]
    assert len(once) == 1 and len(r.eager_calls) > 1 and "validation or inference call(s) with each of the inputs " in once[0], once

@pytest.mark.slow
def test_a_one_off_shape_runs_eagerly_and_compiles_when_seen_again(images, monkeypatch):
    payoff_says(monkeypatch, False)
    learn = image_learner(images)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    graphs = lambda: counters['stats']['unique_graphs']
    g, item = graphs(), learn.dls.valid_ds.items[0]
    # A batch of one that doesn't pay back an evaluation graph runs eagerly
    with learn.no_bar(): preds = [learn.predict(item) for _ in range(2)]
    assert graphs() == g and learn.compiler.report.eager_eval == 2
    fct.test_close(preds[0][2], preds[1][2])
    # With evaluation compiled: the last batch of its DataLoader, a one-off, runs eagerly though no evaluation graph exists yet
    learn.compiler.compile_valid = True
    with learn.no_bar(): pred = learn.predict(item)
    assert graphs() == g and learn.compiler.report.eager_calls[(False, False), ((1, 3, 32, 32),)] == 1
    fct.test_close(pred[2], preds[0][2])
    with learn.no_bar(): learn.validate() # Compiles the evaluation graph
    g = graphs()
    x, m = torch.randn(3, 3, 32, 32, device=learn.dls.device), learn.model.eval()
    with torch.no_grad():
        out = m(x) # Called directly with a new shape: eager the first time...
        assert graphs() == g
        fct.test_close(m(x), out, eps=1e-4) # ...compiled when seen again
    assert graphs() == g + 1

@pytest.mark.slow
def test_dynamic_shapes_never_run_eagerly(images):
    learn = image_learner(images, dynamic=True)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert learn.compiler.report.eager_calls == {}

def test_eager_step_measured_once_per_freeze_state_without_changing_training():
    learners = []
    for compiled in (False, True):
        set_seed(0, reproducible=True) # The same weights, and DataLoaders shuffling the same
        l = Learner(digits_dls().cpu(), two_conv_cnn(), opt_func=partial(SGD, mom=0.9)) # On the CPU: deterministic
        if compiled: l.compile(backend='aot_eager')
        with l.no_bar(), l.no_logging(): l.fit(1, 0.05)
        learners.append(l)
    eager, learn = learners
    r = learn.compiler.report
    assert len(r.eager_times) == 3 and r.measured_from == 1 and r.eager_step is not None and r.compiled_step is not None
    for a,b in zip(eager.model.parameters(), learn.model.parameters()): fct.test_close(a, b, eps=1e-4)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert len(r.eager_times) == 3 # Not measured again...
    learn.compiler.after_freeze()
    assert r.eager_times == [] # ...until the step changes

def test_short_fits_are_not_measured():
    learn = synth_learner(n_trn=5).compile(backend='aot_eager') # 5 batches an epoch: too few to hide 3 eager ones
    with learn.no_bar(), learn.no_logging(): learn.fit(2)
    r = learn.compiler.report
    assert r.eager_times == [] and r.payoff() == "payoff: not measured (the fit ran too few compiled training batches)"

def test_payoff_and_data_advice_read_the_measurements():
    r = CompileReport(compile_seconds=10., batch_times=[(5., True)] + [(0.01, False)]*9, eager_times=[1., 0.02, 0.02],
                      epoch_steps=100, num_workers=0)
    assert r.payoff() == "paid: compiled step 10.0 ms against 20.0 ms eager (2.00×); the 10.0s of compiling pay back after 10.0 epoch(s)"
    assert r.data_advice() is None # Nothing waited for data
    r.data_waits = [0.03]*4
    assert r.data_share == pytest.approx(0.75)
    assert r.data_advice().startswith("the DataLoader: 75% of training time waiting for batches (num_workers=0), so a faster step helps little")
    r.eager_times = [1., 0.0102] # Within `MARGIN` (3%): not measurably faster
    assert r.payoff() == "did not pay: compiled step 10.0 ms against 10.2 ms eager: the compiled model is not measurably faster here"
    r.eager_times = [1., 0.0104] # 4% saved: the margin the tiers' A/B keeps a tier by
    assert r.payoff().startswith("paid: compiled step 10.0 ms against 10.4 ms eager (1.04×)")
    assert r.payoff() in r.summary() and r.data_advice() in r.summary()

def test_a_graph_pays_back_where_the_measured_saving_covers_the_measured_compile():
    r = CompileReport()
    assert r.compile_spike is None and not r.pays_back(10**9) # Nothing measured: nothing is expected to pay
    r.eager_eval, r.eager_valid = 3, 15
    assert ("ran eagerly, evaluation outside a fit (`get_preds`, `validate`): 3 batch(es), too few to pay back compiling their "
            "graph (no compiled step measured against an eager one yet); `compile_valid=True` compiles it") in r.summary()
    assert ("\n  ran eagerly, validation within the fit: 15 batch(es), too few to pay back compiling their graph (no compiled "
            "step measured against an eager one yet); `compile_valid=True` compiles it\n") in r.summary()
    # The slowest compiling batch took 5s, 4.99s more than a compiled step, which saves 10 ms on the eager step: the median
    # eager batch after the first, as the payoff rule takes it
    r = CompileReport(batch_times=[(5., True), (1., True)] + [(0.01, False)]*9, eager_times=[1., 0.019, 0.5, 0.02])
    assert r.compile_spike == pytest.approx(4.99) and r.step_saving == pytest.approx(0.01)
    assert r.pays_back(550) and not r.pays_back(450)
    # Compiled cold by a worker beside the fit, the fit's path pays its warm compile: `WARM_SHARE` (15%) of the 4.99s. And
    # the steps the worker slows: beside the fit 1.3s, each step 1.3 times as long, it costs them 0.3s, an evaluation's
    # three times over in the training step's ratio (`FORWARD_SHARE`)
    assert r.pays_back(75, beside_s=0.) and not r.pays_back(74, beside_s=0.) and not r.pays_back(450)
    assert r.pays_back(165, beside_s=1.3) and not r.pays_back(164, beside_s=1.3)
    r.eager_lr_find, r.eager_valid = 20, 15
    assert ("ran eagerly, `lr_find`: 20 batch(es), too few to pay back compiling their graph (a compiled step saves 10.0 ms "
            "against 5.0s to compile)") in r.summary()
    assert ("\n  ran eagerly, validation within the fit: 15 batch(es), too few to pay back compiling their graph (a compiled "
            "step saves 10.0 ms against 5.0s to compile); `compile_valid=True` compiles it\n") in r.summary()
    r.valid_wait_s = 29.6 # Judged with a worker beside the fit: its wait, and the steps it slows, weighed too
    assert ("validation within the fit: 15 batch(es), too few to pay back compiling their graph (a compiled step saves 10.0 ms "
            "against 5.0s to compile; a worker beside the fit would hand it over after about 30s, the fit's steps slower until "
            "then); `compile_valid=True` compiles it\n") in r.summary()
    # Where the eager step is within `MARGIN` (3%) of the compiled step, nothing is saved: not "0.3 ms"
    r = CompileReport(batch_times=[(5., True), (1., True)] + [(0.01, False)]*9, eager_times=[1., 0.0103, 0.5, 0.0102], eager_valid=15)
    assert r.step_saving == 0 and ("validation within the fit: 15 batch(es), too few to pay back compiling their graph (a compiled "
                                   "step saves nothing measurable against 5.0s to compile)") in r.summary()

def test_lr_find_and_evaluation_outside_a_fit_run_eagerly_until_their_graph_would_pay_back(monkeypatch):
    learn = Learner(digits_dls(), two_conv_cnn()).compile(backend='aot_eager')
    graphs, r = lambda: counters['stats']['unique_graphs'], learn.compiler.report
    g = graphs()
    with learn.no_bar(), learn.no_logging(): learn.lr_find(num_it=12, show_plot=False) # Before any fit: nothing measured
    n = r.eager_lr_find
    assert graphs() == g and n == len(learn.recorder.lrs) > 0 and not r.batch_times and not r.eager_times
    # Where batches wouldn't pay back a graph, whatever a loaded machine's timings: the fit's validation runs eagerly...
    payoff_says(monkeypatch, False)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert graphs() == g + 1 and r.compiled_step is not None # The training graph
    with learn.no_bar(): learn.validate()
    assert graphs() == g + 1 and r.eager_eval == len(learn.dls.valid) # ...`validate` runs eagerly
    payoff_says(monkeypatch, True) # Where they would...
    with learn.no_bar(): learn.validate()
    assert graphs() == g + 2 and r.eager_eval == len(learn.dls.valid) # ...the evaluation graph compiles
    with learn.no_bar(), learn.no_logging(): learn.lr_find(num_it=5, show_plot=False) # Its training graph is compiled already
    assert graphs() == g + 2 and r.eager_lr_find == n

@pytest.mark.slow
@pytest.mark.parametrize('pays', [True, False])
def test_a_fits_validation_compiles_where_the_fits_validation_batches_left_pay_back(pays, monkeypatch):
    asked = []
    monkeypatch.setattr(CompileReport, 'pays_back', lambda self, n, beside_s=None: asked.append(n) or pays)
    learn = Learner(digits_dls(), two_conv_cnn()).compile(backend='aot_eager')
    with learn.no_bar(), learn.no_logging(): learn.fit(2)
    r, n = learn.compiler.report, len(learn.dls.valid)
    during = [e.during.split(' ')[0] for e in r.events]
    if pays: # Judged at the first validation, 2 epochs' batches left; the second runs the graph the first compiled
        assert asked == [2*n] and during == ['training', 'validation'] and not r.eager_valid
        assert 'validation within the fit' not in r.summary()
    else: # Judged again at each validation, with one epoch's batches left at the second
        assert asked == [2*n, n] and during == ['training'] and r.eager_valid == 2*n
        saves = f"{r.step_saving*1e3:.1f} ms" # As measured on this machine; the report never says a step saves 0.0 ms
        if saves == '0.0 ms': saves = 'nothing measurable'
        assert (f"\n  ran eagerly, validation within the fit: {2*n} batch(es), too few to pay back compiling their graph (a "
                f"compiled step saves {saves} against {r.compile_spike:.1f}s to compile); `compile_valid=True` "
                "compiles it\n") in r.summary()

def test_a_faster_step_that_has_not_paid_back_its_compile_is_not_told_it_paid():
    "The compiled step is faster, but the fits trained too few epochs to make up the compile: not 'paid'"
    r = CompileReport(compile_seconds=10., batch_times=[(5., True)] + [(0.01, False)]*9, eager_times=[1., 0.02, 0.02],
                      epoch_steps=100, fit_steps=300, fit_epochs=3)
    assert r.payoff() == ("faster, not paid back yet: compiled step 10.0 ms against 20.0 ms eager (2.00×); the 10.0s of compiling "
                          "pay back after 10.0 epoch(s), more than the 3 trained")
    r.fit_steps = 1200 # Twelve epochs: paid
    assert r.payoff().startswith("paid: compiled step 10.0 ms against 20.0 ms eager (2.00×)")

def test_the_report_counts_the_epochs_its_fits_trained():
    dls = digits_dls() # Its own: its batch size changes
    learn = Learner(dls, two_conv_cnn()).compile(backend='aot_eager', background=False)
    steps = len(dls.train)
    with learn.no_bar(), learn.no_logging(): learn.fit(2); learn.fit(1)
    dls.train.bs = 32 # Epochs of another length: the epochs trained still count as such
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    r = learn.compiler.report
    assert r.fit_steps == 3*steps + len(dls.train) and len(dls.train) != steps and r.fit_epochs == 4
    # An evaluation outside a fit trains nothing, and `lr_find` puts the weights back: neither counts
    with learn.no_bar(), learn.no_logging(): learn.get_preds(); learn.validate(); learn.lr_find(num_it=5, show_plot=False)
    assert (r.fit_steps, r.fit_epochs) == (3*steps + len(dls.train), 4)
