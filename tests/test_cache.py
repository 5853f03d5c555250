"Portable warm start: a compile cache saved in one process serves a fresh process with an empty inductor cache"
import json, os, subprocess, sys, textwrap, warnings, zipfile
import pytest, torch
from torch import nn
from fastai.learner import Learner
from fastai.data.core import DataLoaders
from fastxtend_compile import *
from fastxtend_compile.cache import model_fingerprint
from fastxtend_compile.internals import precompile_supported, caching_precompile, precompile_guard_logger

# What each worker starts with: its role and path, and the same seeded data
DATA = textwrap.dedent('''
    import json, sys, warnings
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    from fastcore.foundation import L
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders
    from fastai.torch_core import set_seed, params
    from fastxtend_compile import *
    role, path = sys.argv[1], sys.argv[2]
    set_seed(0) # Before the DataLoaders: they draw the seed of their shuffling
    g = torch.Generator().manual_seed(0)
    X = torch.randn(320, 8, generator=g); y = (X[:, :4].sum(1) > 0).long()
    dls = DataLoaders.from_dsets(TensorDataset(X[:256], y[:256]), TensorDataset(X[256:], y[256:]), bs=32)
    torch.manual_seed(0)
''')

# Each role runs in a process of its own with an empty TORCHINDUCTOR_CACHE_DIR: `train` compiles cold and saves the
# weights and the compile cache; `warm` loads both, predicts and trains, compiling from the cache
WORKER = DATA + textwrap.dedent('''
    warnings.simplefilter('ignore')
    from torch._dynamo.utils import counters
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), path=path).compile(compile_valid=True) # Evaluation compiled too
    loaded = None
    if role == 'train': # The fit compiles the training graph and the evaluation one, which `get_preds` runs
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
        preds = learn.get_preds(ds_idx=1, with_input=False)[0]
        learn.save('tiny'); learn.save_compile_cache('tiny')
    else:
        learn.load('tiny')
        loaded = learn.load_compile_cache('tiny')
        preds = learn.get_preds(ds_idx=1, with_input=False)[0] # Compiled: the evaluation graph
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2) # And the training graph
    print(json.dumps(dict(loaded=loaded, compile_s=learn.compiler.report.compile_seconds, preds=preds.tolist(),
                          hits=counters['inductor']['fxgraph_cache_hit'], misses=counters['inductor']['fxgraph_cache_miss'])))
''')

def _run(role, path, tmp, worker=WORKER):
    cache = tmp/f'inductor-{role}'
    cache.mkdir()
    env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': str(cache)}
    out = subprocess.run([sys.executable, '-c', worker, role, str(path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), 'stderr': out.stderr}

@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    "A tiny model trained in a process of its own, its weights and compile cache saved in `path/models`"
    tmp = tmp_path_factory.mktemp('cache')
    path = tmp/'learner'
    res = _run('train', path, tmp)
    return path, tmp, res

@pytest.mark.slow
def test_warm_start_in_a_fresh_process(trained):
    path, tmp, cold = trained
    assert cold['misses'] > 0 # Compiled cold
    warm = _run('warm', path, tmp)
    assert warm['loaded'] is True
    assert warm['hits'] > 0 and warm['misses'] == 0, warm # Every graph from the cache, in an empty inductor cache
    # Faster, though how much depends on torch: torch 2.11 probes the CPU's vector instructions in subprocesses in every
    # process, warm or not, where torch 2.15 keeps the answer in the cache (a tenth of the cold compile then)
    assert warm['compile_s'] < cold['compile_s'], (warm['compile_s'], cold['compile_s'])
    torch.testing.assert_close(torch.tensor(warm['preds']), torch.tensor(cold['preds'])) # The same weights predict the same

def _learner(path, model=None, **compile_kwargs):
    from torch.utils.data import TensorDataset
    X = torch.randn(64, 8); y = (X.sum(1) > 0).long()
    dls = DataLoaders.from_dsets(TensorDataset(X[:48], y[:48]), TensorDataset(X[48:], y[48:]), bs=16)
    return Learner(dls, model or nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), loss_func=nn.CrossEntropyLoss(), path=path)

def _load(learn, file):
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        res = learn.load_compile_cache(file)
    return res, [str(w.message) for w in ws if 'compile cache' in str(w.message)]

def _cold(path, why): return [f"Not using the compile cache {path}: {why}. The model will compile cold."]

def _trains(learn):
    "Training goes on after a cache that didn't fit"
    learn.compile(backend='eager')
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert len(learn.recorder.values) == 1

@pytest.mark.slow
def test_saved_header(trained):
    path = trained[0]
    with zipfile.ZipFile(path/'models'/'tiny.compile') as z:
        header = json.loads(z.read('header.json'))
        names = z.namelist()
    assert header['torch'] == torch.__version__ and header['device'].startswith('CPU ') and header['cuda'] is None
    assert header['model'] == model_fingerprint(_learner(path).model)
    assert header['settings'].startswith("backend='inductor', dynamic=False, fullgraph=False, mode=None")
    assert 'mega-cache.bin' in names and any(n.endswith('.so') for n in names) # The C++ kernels the Mega-Cache leaves out

@pytest.mark.slow
def test_other_model(trained):
    path = trained[0]
    learn = _learner(path, nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)))
    saved, here = model_fingerprint(_learner(path).model), model_fingerprint(learn.model)
    assert saved != here
    assert _load(learn, 'tiny') == (False, _cold(path/'models'/'tiny.compile', f'model differs (saved {saved}, here {here})'))
    _trains(learn)

def _copy(src, dest, **changes):
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dest, 'w') as out:
        for n in z.namelist():
            out.writestr(n, json.dumps({**json.loads(z.read(n)), **changes}) if n == 'header.json' else z.read(n))

@pytest.mark.parametrize('key,saved,what', [('torch', '2.10.0', 'torch differs'), ('device', 'NVIDIA H100 80GB HBM3 (compute capability 9.0)', 'device differs'),
                                            ('format', 2, 'file format differs')])
@pytest.mark.slow
def test_other_torch_or_device(trained, key, saved, what):
    path = trained[0]
    models = path/'models'
    _copy(models/'tiny.compile', models/f'other-{key}.compile', **{key: saved})
    learn = _learner(path)
    here = {'torch': torch.__version__, 'device': f"CPU {__import__('platform').machine()} {torch.backends.cpu.get_cpu_capability()}", 'format': 1}[key]
    assert _load(learn, f'other-{key}') == (False, _cold(models/f'other-{key}.compile', f'{what} (saved {saved}, here {here})'))
    _trains(learn)

@pytest.mark.slow
def test_other_settings(trained):
    path = trained[0]
    learn = _learner(path).compile(dynamic=True)
    res, msgs = _load(learn, 'tiny')
    assert res is False and len(msgs) == 1
    assert msgs[0].startswith(f"Not using the compile cache {path/'models'/'tiny.compile'}: compile settings differ (saved backend='inductor', dynamic=False")
    assert msgs[0].endswith("). The model will compile cold.")

def test_corrupt_or_missing_file(tmp_path):
    models = tmp_path/'models'
    models.mkdir()
    (models/'junk.compile').write_bytes(b'\x00' * 100)
    learn = _learner(tmp_path)
    assert _load(learn, 'junk') == (False, _cold(models/'junk.compile', 'it could not be read (BadZipFile: File is not a zip file)'))
    assert _load(learn, 'none') == (False, _cold(models/'none.compile', 'there is no such file'))
    with zipfile.ZipFile(models/'no-header.compile', 'w') as z: z.writestr('mega-cache.bin', b'')
    assert _load(learn, 'no-header') == (False, _cold(models/'no-header.compile',
        "it could not be read (KeyError: \"There is no item named 'header.json' in the archive\")"))
    _trains(learn)

@pytest.mark.slow
def test_corrupt_artifacts(trained):
    path = trained[0]
    models = path/'models'
    with zipfile.ZipFile(models/'tiny.compile') as z, zipfile.ZipFile(models/'bad-mega.compile', 'w') as out:
        for n in z.namelist(): out.writestr(n, b'garbage' if n == 'mega-cache.bin' else z.read(n))
    learn = _learner(path)
    assert _load(learn, 'bad-mega') == (False, _cold(models/'bad-mega.compile', 'torch could not read the compiled code in it'))
    _trains(learn)

def test_nothing_to_save(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, 'save_cache_artifacts', lambda: None)
    learn = _learner(tmp_path)
    with pytest.warns(UserWarning, match='Not saving a compile cache: nothing compiled in this process is cached'):
        assert learn.save_compile_cache('x') is None
    assert not (tmp_path/'models'/'x.compile').exists()

# `precompile=True`: `cold` compiles a body/head model frozen, then unfrozen (its parameters have gradients by then), and
# saves the compile cache; `warm`, in a fresh process with an empty inductor cache, loads it and trains the same way
PRECOMPILE_WORKER = DATA + textwrap.dedent('''
    import re
    # Notes about the Python running the test, not about compiling: Python 3.12+ on forking a process with threads (inductor's
    # compile workers), torch on Python 3.13.0's slower guards
    RUNTIME_NOTE = re.compile(r'use of fork\\(\\) may lead to deadlocks|Guards may run slower on Python 3\\.13\\.0')
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 2))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), path=path, splitter=lambda m: L(m[0], m[1]).map(params))
    learn.compile(precompile=True)
    loaded = learn.load_compile_cache('pre') if role == 'warm' else None
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging():
            learn.freeze(); learn.fit(1, 1e-2)
            learn.unfreeze(); learn.fit(1, 1e-2)
            learn.compiler.compile_valid = True # Too few batches to pay back a graph: compiled as asked
            preds = learn.get_preds(ds_idx=1)[0] # The evaluation graph: code of its own beside the unfrozen training graph's
    if role == 'cold': learn.save_compile_cache('pre')
    r = learn.compiler.report
    print(json.dumps(dict(loaded=loaded, graphs=r.graphs, precompiled=r.precompiled, summary=r.summary(), preds=preds.tolist(),
                          warnings=[str(w.message) for w in ws if not RUNTIME_NOTE.search(str(w.message))],
                          weights=[p.tolist() for p in learn.model.parameters()])))
''')

@pytest.mark.skipif(not precompile_supported(), reason='torch before 2.15 cannot load precompiled code of a model with gradients')
def test_precompiled_warm_start_traces_nothing(tmp_path):
    path = tmp_path/'learner'
    cold = _run('cold', path, tmp_path, PRECOMPILE_WORKER)
    assert (cold['graphs'], cold['precompiled']) == (3, 0), cold['summary'] # A training graph per freeze state, an evaluation one
    warm = _run('warm', path, tmp_path, PRECOMPILE_WORKER)
    assert warm['loaded'] is True
    # Both freeze states' code loaded precompiled (the unfrozen one's with the evaluation graph): nothing traced, nothing
    # compiled, and no warning that it captured nothing
    assert (warm['graphs'], warm['precompiled']) == (0, 2), warm['summary']
    assert 'loaded precompiled: 2 compiled function(s) from the compile cache, not traced again' in warm['summary']
    assert warm['warnings'] == cold['warnings'] == []
    for run in (cold, warm): assert 'is dropped with caching_precompile' not in run['stderr'] # TorchDynamo's notes, kept quiet
    # The same training, step for step: the frozen graph left the body alone, the unfrozen one trained it
    for a,b in zip(cold['weights'] + [cold['preds']], warm['weights'] + [warm['preds']]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=0)

def test_precompile_is_on_only_during_a_fit(tmp_path):
    "TorchDynamo's setting and its quieted logger are put back after a fit, and after one that raises"
    from fastai.callback.core import Callback
    class Boom(Callback):
        def after_batch(self):
            if self.training and self.iter == 1: raise RuntimeError('boom')
    seen = []
    class Sees(Callback):
        def after_batch(self): seen.append(caching_precompile())
    filters = list(precompile_guard_logger.filters)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn = _learner(tmp_path).compile(precompile=True)
    on = not [w for w in ws if 'precompile=True needs torch 2.15' in str(w.message)]
    assert on == precompile_supported() and learn.compiler.precompile.on == on
    with learn.no_bar(), learn.no_logging():
        learn.fit(1, cbs=Sees())
        with pytest.raises(RuntimeError, match='boom'): learn.fit(1, cbs=Boom())
    assert set(seen) == {on}
    assert not caching_precompile() and precompile_guard_logger.filters == filters

@pytest.mark.skipif(not precompile_supported(), reason='torch before 2.15 cannot load precompiled code of a model with gradients')
def test_precompile_is_left_out_under_ddp():
    from fastxtend_compile.callback import _Precompile
    p, model = _Precompile(True, 'inductor'), nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="precompile=True is left out under DistributedDataParallel, where this library doesn't support it yet"):
        p.set(model, ddp=True)
    assert not p.on and not caching_precompile()
    p.set(model) # For good, with a note once
    assert not caching_precompile()

@pytest.mark.skipif(not precompile_supported(), reason='torch before 2.15 cannot load precompiled code of a model with gradients')
def test_precompile_is_left_out_for_a_class_defined_in_a_function(tmp_path):
    "TorchDynamo can't save the code of such a model and would keep its graph out of the compile cache: it compiles as without `precompile`"
    from fastai.callback.core import Callback
    def build():
        class Local(nn.Module):
            def __init__(self): super().__init__(); self.lin = nn.Linear(8, 2)
            def forward(self, x): return self.lin(x)
        return Local()
    seen = []
    class Sees(Callback):
        def after_batch(self): seen.append(caching_precompile())
    learn = _learner(tmp_path, build()).compile(precompile=True)
    with pytest.warns(UserWarning) as ws, learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=Sees())
    assert [str(w.message) for w in ws if 'precompile' in str(w.message)] == [
        "precompile=True is left out for this model: TorchDynamo can't save the code of "
        "`test_precompile_is_left_out_for_a_class_defined_in_a_function.<locals>.build.<locals>.Local`, a class defined inside a "
        "function (define it at the top level of a module). The model compiles as without it"]
    assert set(seen) == {False} and not learn.compiler.precompile.on and learn.compiler.report.graphs == 1

def test_warm_records_travel_with_the_cache(tmp_path, monkeypatch):
    "Which model states the cache holds, and their compile times, go with it: a new machine starts them warm too"
    from fastxtend_compile.background import WarmRecords
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path/'here'))
    learn = _learner(tmp_path/'learner').compile(backend='inductor')
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    fitted = {f.name for f in WarmRecords.root().glob('*.json')} # The fit's compile in its path is a record too
    assert fitted and all('path_s' in json.loads((WarmRecords.root()/n).read_text()) for n in fitted), fitted
    (WarmRecords.root()/'0123-4567.json').write_text('{"cold_s": 20.5, "warm_s": 2.5}')
    file = learn.save_compile_cache('records')
    with zipfile.ZipFile(file) as z: assert 'warm/0123-4567.json' in z.namelist()
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path/'there')) # Another machine's empty cache
    assert learn.load_compile_cache('records') is True
    assert json.loads((tmp_path/'there'/WarmRecords.folder/'0123-4567.json').read_text()) == {'cold_s': 20.5, 'warm_s': 2.5}
    assert {f.name for f in (tmp_path/'there'/WarmRecords.folder).glob('*.json')} == fitted | {'0123-4567.json'}
