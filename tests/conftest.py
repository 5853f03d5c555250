"Small real datasets (scikit-learn, no downloads) and models for the tests"
import os, warnings
# Inductor checks that the C++ compiler builds each vector ISA the CPU reports, once per cache folder: 12 s of g++ on a
# 2-core machine, which every test process with a fresh cache (a worker, a DDP rank, a cold role) paid again. Tests
# take the CPU's own report, as inductor does once the check has passed; their processes inherit it
os.environ.setdefault('TORCHINDUCTOR_VEC_ISA_OK', '1')
# One intra-op thread in every test process, workers and ranks included: the models are tiny, and where a test run's
# processes share two cores, more threads only spin
os.environ.setdefault('OMP_NUM_THREADS', '1')
import atexit, shutil, tempfile
# One inductor cache for the test run, fresh at its start and removed at its end: every test that doesn't ask for a cold
# cache (and sets its own) compiles a kernel another test built once. A run never depends on what an earlier run left
if 'TORCHINDUCTOR_CACHE_DIR' not in os.environ:
    os.environ['TORCHINDUCTOR_CACHE_DIR'] = tempfile.mkdtemp(prefix='fxc-tests-inductor-')
    atexit.register(shutil.rmtree, os.environ['TORCHINDUCTOR_CACHE_DIR'], ignore_errors=True)
import numpy as np, pytest, torch
from torch import nn
from fastai.vision.all import *
from fastai.tabular.all import *
torch.set_num_threads(1) # Where torch was imported before this file

warnings.filterwarnings('ignore', message='.*load_learner.*insecure.*')

def pytest_addoption(parser):
    parser.addoption('--slow', action='store_true', help="run the slow tests too (marked `slow`): every test, as CI runs them")

def pytest_configure(config):
    config.addinivalue_line('markers', "slow: a test of processes, cold compiles or many fits; `pytest --slow` runs it")
    config.addinivalue_line('markers', "worker_priority: the worker runs below the fit's CPU priority, as the library starts it")
    config.addinivalue_line('markers', "background_default: fits compile in the background on the device types the library's default picks")

def pytest_collection_modifyitems(config, items):
    "Leave the slow tests out unless `--slow` asks for them, or a marker expression (`-m slow`) picks the tests"
    if config.getoption('--slow') or config.option.markexpr: return
    slow = [i for i in items if 'slow' in i.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if 'slow' not in i.keywords]

@pytest.fixture(autouse=True)
def compile_in_the_fits_path(monkeypatch, request):
    "Compiled fits are checked against eager ones: on a GPU too, compiled in the fit's path unless a test asks for `background`"
    # Imported here, not at the top: a test's child process imports this file without the library
    from fastxtend_compile.background import BackgroundCompile
    from fastxtend_compile.worker import Worker
    if 'background_default' not in request.keywords: monkeypatch.setattr(BackgroundCompile, 'default_on', ())
    # A worker runs at the fit's own priority in tests: beside another test run on two cores, one 10 steps below got a
    # tenth of a core (a start-up of 3s took 40-50s). One test keeps the library's priority, which it checks
    if 'worker_priority' not in request.keywords: monkeypatch.setattr(Worker, 'nice', 0)

class ItemsOnce(TfmdDL):
    "A `TfmdDL` that makes each item once and then reuses it: for data whose item transforms always give the same item"
    # Making an item of the digits (an image through PIL, its label through `Categorize`, each a tensor subclass) costs more
    # host time than the tests' models do: without this, 40% of the default set's CPU time went to the epochs' items
    def __init__(self, *args, **kwargs):
        self.made = {} # Before `TfmdDL.__init__`, which makes an item
        super().__init__(*args, **kwargs)

    def do_item(self, s):
        key = (s, getattr(self.dataset, 'split_idx', None)) # `tta` makes the items of another split from the same dataset
        if key not in self.made: self.made[key] = super().do_item(s)
        return self.made[key]

def digits_dls(bs=64, seed=42):
    "scikit-learn's 8x8 digits as a fastai image task through a `DataBlock`, each item made once (`ItemsOnce`)"
    from sklearn.datasets import load_digits
    d = load_digits()
    imgs, labels = (d.images * 255 / 16).astype(np.uint8), d.target
    dblock = DataBlock(blocks=(ImageBlock(cls=PILImageBW), CategoryBlock),
                       get_x=lambda i: PILImageBW.create(imgs[i]), get_y=lambda i: labels[i],
                       splitter=RandomSplitter(0.2, seed=seed))
    return dblock.dataloaders(range(len(imgs)), bs=bs, num_workers=0, dl_type=ItemsOnce)

def cancer_dls(bs=64, seed=42):
    "scikit-learn's breast cancer data as a fastai tabular task"
    from sklearn.datasets import load_breast_cancer
    df = load_breast_cancer(as_frame=True).frame
    df['size_bin'] = pd.cut(df['mean radius'], 4, labels=False).astype(str)
    conts = [c for c in df.columns if c not in ('target', 'size_bin')]
    return TabularDataLoaders.from_df(df, procs=[Categorify, Normalize], cat_names=['size_bin'], cont_names=conts,
                                      y_names='target', y_block=CategoryBlock(), valid_idx=list(range(0, len(df), 5)),
                                      bs=bs, num_workers=0)

def text_dls():
    "A tiny synthetic sentiment task through fastai's `TextDataLoaders`"
    pytest.importorskip('spacy', reason="fastai's default tokenizer needs spaCy")
    from fastai.text.data import TextDataLoaders
    rng = np.random.default_rng(0)
    good, bad = ['great', 'good', 'fine', 'lovely'], ['awful', 'bad', 'poor', 'sad']
    texts = [' '.join(rng.choice(good if i%2 else bad, 6)) for i in range(96)]
    df = pd.DataFrame(dict(text=texts, label=['pos' if i%2 else 'neg' for i in range(96)]))
    return TextDataLoaders.from_df(df, text_col='text', label_col='label', valid_pct=0.25, seed=0, bs=16, seq_len=16, num_workers=0)

def ragged_text_dls():
    "Sentences of 3 to 30 words through fastai's `TextDataLoaders`, which pads each batch to its longest: lengths change"
    from fastai.text.data import TextDataLoaders
    from fastai.text.core import BaseTokenizer
    rng = np.random.default_rng(0)
    good, bad = ['great', 'good', 'fine', 'lovely'], ['awful', 'bad', 'poor', 'sad']
    texts = [' '.join(rng.choice(good if i%2 else bad, rng.integers(3, 31))) for i in range(160)]
    df = pd.DataFrame(dict(text=texts, label=['pos' if i%2 else 'neg' for i in range(160)]))
    return TextDataLoaders.from_df(df, text_col='text', label_col='label', valid_pct=0.25, seed=0, bs=16,
                                   tok_tfm=BaseTokenizer(), num_workers=0)

def segmentation_dls(path, n=24, size=32, bs=4):
    "Images with a bright square on noise and their masks, written as PNG files with PIL, through `SegmentationDataLoaders`"
    from PIL import Image
    (path/'images').mkdir(parents=True, exist_ok=True); (path/'masks').mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        mask = np.zeros((size, size), np.uint8)
        x, y = rng.integers(2, size//2, 2)
        mask[y:y+size//3, x:x+size//3] = 1
        img = (rng.normal(100, 20, (size, size, 3)) + mask[..., None]*80).clip(0, 255).astype(np.uint8)
        Image.fromarray(img).save(path/'images'/f'{i}.png'); Image.fromarray(mask).save(path/'masks'/f'{i}.png')
    return SegmentationDataLoaders.from_label_func(path, get_image_files(path/'images'), lambda o: path/'masks'/o.name,
                                                   codes=['background', 'square'], valid_pct=0.25, seed=0, bs=bs, num_workers=0)

def two_conv_cnn(n_out=10):
    "A plain two-conv CNN for 1×8×8 images"
    return nn.Sequential(nn.Conv2d(1,16,3,padding=1), nn.ReLU(), nn.Conv2d(16,16,3,padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16*8*8, n_out))

def bn_cnn(n_out=10):
    "A body/head CNN with BatchNorm, split so it can be frozen"
    # No bias before BatchNorm, as in fastai's `ConvLayer`: BatchNorm cancels it, so its gradient is rounding noise, exactly
    # zero on some GPUs, and Adam leaves it unchanged (which tests that check every parameter trained would take for a bug)
    body = nn.Sequential(nn.Conv2d(1,16,3,padding=1,bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16,32,3,stride=2,padding=1), nn.ReLU())
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, n_out))
    return nn.Sequential(body, head)

def body_head_splitter(m): return L(m[0], m[1]).map(params)

# What an eager Learner computes with: a compiled fit sets TF32 matmuls ('high') on a CUDA GPU, ~1e-3 from these
EAGER_PRECISION = dict(matmul_precision='highest')
# How close a compiled fit ends to the same seeded eager one, each tensor compared whole. On the CPU: float rounding. On
# a CUDA GPU the compiled graph runs other kernels than eager (BatchNorm's, the optimizer's fused step), and Adam turns
# their rounding of a gradient near zero into a whole step of one weight (one element of 4,608 2.4e-3 from eager's after
# two epochs at lr 1e-2, H200, torch 2.11): there each tensor is within 1% of its norm. A frozen or skipped update still
# shows, as two epochs of lr 1e-2 move a tensor by far more
FIT_TOL = dict(rtol=1e-4, atol=1e-4)
FIT_NORM_TOL = 1e-2

# Adam moves a weight whose gradient is rounding noise by up to a whole step either way, and a deep model has many such
# weights: after `unet_learner`'s `fine_tune(1)` (aot_eager, torch 2.15, CPU) 112 of one decoder conv's 131,072 weights
# were up to one step (1.9e-3) from eager's, though the first gradients were equal. There each tensor's distance from
# eager's is measured against how far eager moved it: 1.8% at most; one skipped step of eight would be ~12%, no update 100%
MOVED_TOL = 0.05

def payoff_says(monkeypatch, pays:bool=False):
    "The payoff rule answers `pays` for any batches, whatever this machine's timings say"
    from fastxtend_compile.report import CompileReport
    monkeypatch.setattr(CompileReport, 'pays_back', lambda self, *a, **k: pays)

def assert_fit_close(eager:nn.Module, compiled:nn.Module, start:list|None=None):
    "The parameters of a compiled fit are those of the same seeded eager fit, each within `FIT_TOL` (CPU) or `FIT_NORM_TOL` (GPU) of its norm"
    # Given the parameters both fits `start`ed from, each ends within `MOVED_TOL` of how far eager moved it instead
    tol = dict(rtol=FIT_NORM_TOL, atol=0.) if torch.cuda.is_available() else FIT_TOL
    for i, ((name, a), b) in enumerate(zip(eager.named_parameters(), compiled.parameters())):
        assert_close_to(b.detach().float().cpu(), a.detach().float().cpu(), tol, name,
                        None if start is None else start[i].detach().float().cpu(), MOVED_TOL)

# Gradients drift with the weights: after a few SGD steps at lr 0.1, the compiled convolutions' gradients are up to 4e-4
# from eager's on an H200 (torch 2.11)
GRAD_TOL = dict(rtol=1e-2, atol=1e-3) if torch.cuda.is_available() else dict(rtol=1e-4, atol=1e-5)

# A tensor of a compiled fit against eager's, compared whole: its rounding errs relative to the magnitudes summed, not
# to each element, which cancellation can bring near zero
def assert_close_to(c:torch.Tensor, e:torch.Tensor, tol:dict, where:str, start:torch.Tensor|None=None, moved:float=0.):
    "Compiled `c` is eager `e` within `moved` of how far `e` moved from `start`, or without `start` within `tol` of `e`'s norm"
    if not e.is_floating_point(): return torch.testing.assert_close(c, e, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
    odd = ~e.isfinite() # NaN and infinities: the same as eager's, where eager's are
    assert torch.equal(~c.isfinite(), odd) and torch.equal(c[odd].nan_to_num(), e[odd].nan_to_num()), f"{where}: {c}, eager {e}"
    c, e = c.double().masked_fill(odd, 0), e.double().masked_fill(odd, 0)
    err = (c - e).norm().item()
    if start is None or start.shape != e.shape: bound, scale = tol['rtol'] * e.norm().item() + tol['atol'] * e.numel()**0.5, "eager's norm"
    else: bound, scale = moved * (e - start.double().masked_fill(odd, 0)).norm().item(), "how far eager's moved"
    assert err <= bound, f"{where}: {err:.3g} from eager's, where {scale} allows {bound:.3g}"

@pytest.fixture(scope='session')
def digits(): return digits_dls()

@pytest.fixture(scope='session')
def cancer(): return cancer_dls()
