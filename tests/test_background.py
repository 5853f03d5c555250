"Compiling outside the fit's path: the fit trains eagerly while a worker process compiles, then the compiled code takes over"
import glob, json, os, re, shutil, subprocess, sys, tempfile, time
import pytest, torch
from torch import nn
from fastai.learner import Learner
from fastai.callback.core import Callback, CancelFitException
from fastai.torch_core import set_seed
from fastxtend_compile import *
from fastxtend_compile.background import BackgroundCompile, WarmRecords, _step
from fastxtend_compile.worker import Worker
from fastxtend_compile.state import state_key, Stage
from fastxtend_compile.payoff import MARGIN, SAVING, WARM_SHARE
from conftest import two_conv_cnn, digits_dls, EAGER_PRECISION, assert_fit_close, assert_close_to, FIT_TOL, payoff_says

def _leftovers()->list: return glob.glob(os.path.join(tempfile.gettempdir(), 'fxc-background-*'))

class WaitForWorker(Callback):
    "At each batch of `at` in the first epoch (training, or with `training=False` validation), wait for the worker's job to end, so the hand-over comes at the next batch"
    order = 20 # After `CompilerCallback`
    def __init__(self, at=2, training=True):
        self.at, self.phase, self.worker_seen, self.pids = (at,) if isinstance(at, int) else at, training, False, []
    def after_batch(self):
        aside = self.learn.compiler.aside
        if self.training != self.phase or self.epoch or self.iter not in self.at or aside.compiling is None: return
        self.worker_seen = True
        self.pids.append(aside.worker.proc.pid)
        deadline = time.time() + 600
        while aside.poll(aside.compiling.job) is None and time.time() < deadline: time.sleep(0.2)

def _fit(compiled, cbs=(), epochs=2, **kw):
    set_seed(0, reproducible=True)
    learn = Learner(digits_dls(), two_conv_cnn(), cbs=list(cbs))
    if compiled: learn.compile(**{'backend': 'inductor', 'background': True, **EAGER_PRECISION, **kw})
    learn.fit(epochs, 3e-3)
    return learn

def _first_run(tmp_path, monkeypatch):
    "No warm record, as on a first run; a worker for a fit of any length, and a temporary folder of its own"
    monkeypatch.setattr(BackgroundCompile, 'cold_cost_s', 0)
    payoff_says(monkeypatch, False) # Validation runs eagerly
    (tmp_path/'tmp').mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path/'tmp')) # Other processes' workers never show up in this test's check

@pytest.fixture
def no_records(tmp_path, monkeypatch):
    "A first run's fit: no warm record of this library's; inductor's kernels from the test run's cache, where another test built them"
    monkeypatch.setattr(WarmRecords, 'folder', f'{WarmRecords.folder}-{tmp_path.name}') # Records of its own: unique in the test run
    _first_run(tmp_path, monkeypatch)
    yield
    assert _leftovers() == [], "a worker's temporary folder outlived the fit"

@pytest.fixture
def cold_cache(tmp_path, monkeypatch):
    "A first run's fit with an empty inductor cache of its own: for tests of what the worker writes there"
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path/'inductor'))
    _first_run(tmp_path, monkeypatch)
    yield tmp_path/'inductor'
    assert _leftovers() == [], "a worker's temporary folder outlived the fit"

class MeasuredEagerly(Callback):
    "Which training batches the policy ran eagerly to measure the eager step, and which it timed for a probe"
    order = 20 # After `CompilerCallback` decided
    def __init__(self): self.measured, self.probed = [], []
    def before_batch(self):
        p = self.learn.compiler.policy
        if self.training and p.measuring: self.measured.append(self.iter)
        if self.training and p.probing: self.probed.append(self.iter)

@pytest.mark.slow
def test_the_probes_eager_batches_are_the_reports_eager_step(no_records, monkeypatch):
    "A new state's probe times its eager batches alone once, for the background's verdict and the report: no eager batch after the hand-over"
    monkeypatch.setattr(BackgroundCompile, 'cold_cost_s', 1e-9) # The probe runs, and any fit pays back the compile
    monkeypatch.setattr(BackgroundCompile, 'handover_s', lambda self, st, start_s=None: 0.) # Its code serves the fit's rest from the job on
    spy, n = MeasuredEagerly(), BackgroundCompile.probe_batches
    comp = _fit(True, cbs=[spy, WaitForWorker(at=n)], epochs=1)
    r = comp.compiler.report
    assert spy.probed == list(range(n)) and spy.measured == [] # The probe's batches, and none after it
    assert len(r.eager_times) == n and r.batch_times, (r.eager_times, r.batch_times)
    assert r.eager_step == sorted(r.eager_times[1:])[(n - 1)//2] and re.search(r"compiled step [\d.]+ ms against [\d.]+ ms eager", r.payoff()), r.payoff()

@pytest.mark.slow
def test_compiled_code_takes_over_from_the_worker_and_trains_like_eager(cold_cache):
    eager = _fit(False)
    wait = WaitForWorker(at=2)
    comp = _fit(True, cbs=[wait])
    cb = comp.compiler
    assert wait.worker_seen and cb.aside.worker.proc is None
    notes = cb.report.background
    assert len(notes) == 1 and "while 3 training batch(es) ran eagerly; the compiled code took over at epoch 0, batch 3" in notes[0], notes
    assert re.search(r"\(its start-up took [\d.]+s \(Python, torch and this library [\d.]+s, the model's modules [\d.]+s, inductor [\d.]+s\), "
                     r"(done before the job was sent|[\d.]+s of it after the job was sent); loading the job "
                     r"[\d.]+s, compiling the forward [\d.]+s and the backward [\d.]+s\); compiling it in the fit's path took [\d.]+s$", notes[0]), notes
    assert cb.report.graphs >= 1 and cb.report.batch_times # Compiled batches ran after the hand-over
    assert any(cold_cache.rglob('*')) # The worker filled the cache the fit compiled from
    records = [json.loads(f.read_text()) for f in (cold_cache/WarmRecords.folder).glob('*.json')]
    # The state compiled, how long it took, and the share of a step its code saved, as the report measured
    assert len(records) == 1 and set(records[0]) == {'cold_s', 'start_s', 'training', 'warm_s', 'saving', 'compiled_s', 'eager_s'} and records[0]['training'], records
    assert records[0]['saving'] == pytest.approx(1 - cb.report.compiled_step / cb.report.eager_step)
    assert_fit_close(eager.model, comp.model)

@pytest.mark.slow
def test_a_validation_worth_its_hand_overs_warm_compile_compiles_in_the_worker_and_runs_its_code_from_the_hand_over(no_records, monkeypatch):
    "Judged with the worker beside the fit, the fit's validation compiles cold in the worker and takes over at its hand-over"
    asked = []
    monkeypatch.setattr(CompileReport, 'pays_back', lambda self, batches, beside_s=None: asked.append(beside_s) or beside_s is not None)
    monkeypatch.setattr(BackgroundCompile, 'handover_s', lambda self, st, start_s=None: 0.) # Every validation counts, in a fit this short
    eager = _fit(False)
    comp = _fit(True, cbs=[WaitForWorker(at=2), WaitForWorker(at=0, training=False)])
    r, valid = comp.compiler.report, len(comp.dls.valid)
    assert asked == [0.] # Judged once, at the first validation: cold, so the worker compiles it; begun, the next waits for it
    evaluation = [n for n in r.background if 'compiled for evaluation in a worker process' in n]
    assert len(evaluation) == 1 and "the compiled code took over at epoch 0, batch 1" in evaluation[0], r.background
    assert sum(e.during.startswith('validation') for e in r.events) == 1 # Its graph, compiled warm at the hand-over
    assert r.eager_valid == 0 # Waiting for the worker is not "too few to pay back"
    # Its compiled batches were timed for its record; its one eager batch, before the hand-over, too few to say
    rec = comp.compiler.aside.warm_starts.get(next(s.record for k,s in comp.compiler.aside.states.items() if not k.training and s.stage.compiled))
    assert rec['compiled_batch_s'] > 0 and 'eager_batch_s' not in rec, rec
    for a, b in zip(eager.recorder.values, comp.recorder.values): assert_close_to(torch.tensor(b[:2]), torch.tensor(a[:2]), FIT_TOL, 'losses')
    assert_fit_close(eager.model, comp.model)

def test_a_failed_worker_keeps_the_fit_eager_with_one_warning(no_records, monkeypatch):
    monkeypatch.setattr(Worker, 'code', "raise SystemExit('no compiler here')")
    eager = _fit(False)
    with pytest.warns(UserWarning, match=r"torch.compile failed in a background worker process \(no compiler here\)\. The fit trains eagerly") as ws:
        comp = _fit(True, cbs=[WaitForWorker(at=0)])
    assert sum('background worker' in str(w.message) for w in ws) == 1
    assert comp.compiler.report.graphs == 0 and not comp.compiler.report.batch_times
    assert "compiling in a worker process failed" in comp.compiler.report.background[0]
    assert_fit_close(eager.model, comp.model)

def test_a_fit_that_ends_first_leaves_no_worker_behind(no_records):
    seen = []
    class Stop(Callback):
        order = 20
        def after_batch(self):
            if self.iter == 1:
                seen.append(self.learn.compiler.aside.worker.proc)
                raise CancelFitException()
    learn = _fit(True, cbs=[Stop()])
    proc = seen[0]
    assert proc is not None and proc.poll() is not None # Killed, not left compiling
    assert learn.compiler.aside.worker.proc is None and learn.compiler.report.graphs == 0
    assert "the fit ended before the worker process finished compiling: 2 training batch(es) ran eagerly" in learn.compiler.report.background[0]

def test_a_fit_too_short_to_pay_trains_eagerly_without_a_worker(tmp_path, monkeypatch):
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path/'inductor'))
    started = []
    monkeypatch.setattr(BackgroundCompile, 'send', lambda *a: started.append(a) or True)
    eager, comp = _fit(False), _fit(True)
    assert not started and comp.compiler.report.graphs == 0 and comp.compiler.aside.worker.proc is None
    n = 2*len(comp.dls.train) - BackgroundCompile.probe_batches
    assert comp.compiler.report.background[0].startswith(f"trained eagerly: the fit's {n} training batches left, about "), comp.compiler.report.background
    assert_fit_close(eager.model, comp.model)

def test_background_must_be_a_bool():
    with pytest.raises(TypeError, match="background must be True, False or None, not 'yes'"): CompilerCallback(background='yes')

class Lengths(Callback):
    "Each training batch a sequence of another length, as text batches padded to their longest item are"
    order = 0
    def before_batch(self):
        if self.training: self.learn.xb = (self.xb[0].flatten(1)[:, None].expand(-1, 1 + self.iter % 5, -1),)

class MeanOverLength(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(64, 10)
    def forward(self, x): return self.lin(x.mean(1) if x.ndim == 3 else x.flatten(1)) # Validation: the plain images

def test_batches_of_ever_new_shapes_train_eagerly_and_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path/'inductor'))
    started = []
    monkeypatch.setattr(BackgroundCompile, 'send', lambda *a: started.append(a) or True)
    learn = Learner(digits_dls(), MeanOverLength(), cbs=Lengths()).compile(backend='inductor', background=True)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert not started and learn.compiler.report.graphs == 0
    n = 2*BackgroundCompile.probe_batches
    assert learn.compiler.report.background == [
        f"trained eagerly: the training batches' shapes kept changing ({n} times, none {BackgroundCompile.probe_batches} batches "
        "in a row), so none is worth a graph of its own; batches of one size (padded to one length, `drop_last=True`) or "
        "`dynamic=True` let one graph serve them"]

@pytest.mark.slow
def test_a_fit_that_trains_eagerly_never_imports_inductor(tmp_path):
    "`torch.compile` imports inductor (seconds on a GPU host): a fit that trains eagerly while it would compile elsewhere doesn't wait for it"
    import subprocess, sys, textwrap
    code = textwrap.dedent('''
        import sys, warnings
        warnings.simplefilter('ignore')
        from fastai.learner import Learner
        from fastxtend_compile import *
        from conftest import two_conv_cnn, digits_dls
        learn = Learner(digits_dls(), two_conv_cnn()).compile(background=True) # fastai's Adam: PyTorch's fused kernel, no compile
        with learn.no_bar(), learn.no_logging(): learn.fit(1) # Too short to be worth a worker: it trains eagerly
        print(learn.compiler.report.graphs, 'torch._inductor.compile_fx' in sys.modules)
    ''')
    # An empty inductor cache: a state another test compiled, in any process, would compile at once (a warm start)
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([os.path.dirname(__file__), os.environ.get('PYTHONPATH', '')]),
           'TORCHINDUCTOR_CACHE_DIR': str(tmp_path)}
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ['0', 'False'], out.stdout

def _starts(monkeypatch)->list:
    "The worker starts from here on"
    started, start = [], Worker.start
    monkeypatch.setattr(Worker, 'start', lambda self, *a: started.append(a) or start(self, *a))
    return started

@pytest.mark.slow
def test_a_state_compiled_before_compiles_at_once_without_a_worker(no_records, monkeypatch):
    "A new Learner of a model compiled before (a kernel restarted, a notebook run again) compiles at its first batch, warm"
    _fit(True, cbs=[WaitForWorker(at=0)]) # A worker fills the cache, and the record of what it holds
    started, eager = _starts(monkeypatch), _fit(False)
    comp = _fit(True)
    assert started == [] and comp.compiler.report.graphs >= 1
    notes = comp.compiler.report.background
    assert len(notes) == 1 and re.fullmatch(r"compiled at once, in the fit's path at epoch 0, batch 0: inductor's cache has this model "
                                            r"state's code \([\d.]+s when last measured\); compiling it in the fit's path took [\d.]+s", notes[0]), notes
    assert_fit_close(eager.model, comp.model)

_NEXT_PROCESS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import fastxtend_compile.life as life
from fastxtend_compile.worker import Worker
from test_background import _fit
life.pays_back = lambda *a: True # However short this fit: the records, not the payoff, are what this process checks
started = []
Worker.start = lambda self, *a: started.append(a)
learn = _fit(True)
print(json.dumps(dict(notes=learn.compiler.report.background, started=len(started), graphs=learn.compiler.report.graphs)))
"""

@pytest.mark.slow
def test_a_compile_in_the_fits_path_is_a_warm_start_for_the_background_in_a_new_process(cold_cache):
    "A cache filled by `background=False` is a warm start: the next process compiles at once after its probe, with no worker"
    r = _fit(True, background=False).compiler.report
    records = [json.loads(f.read_text()) for f in (cold_cache/WarmRecords.folder).glob('*.json')]
    assert len(records) == 1 and set(records[0]) == {'path_s', 'training', 'saving', 'compiled_s', 'eager_s'} and records[0]['path_s'] > 0, records # The training state
    assert records[0]['saving'] == pytest.approx(1 - r.compiled_step / r.eager_step)
    env = {**os.environ, 'TORCHINDUCTOR_CACHE_DIR': str(cold_cache), 'OMP_NUM_THREADS': '1'}
    out = subprocess.run([sys.executable, '-c', _NEXT_PROCESS, os.path.dirname(__file__)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res['started'] == 0 and res['graphs'] >= 1, res
    at = BackgroundCompile.probe_batches # Its first batches timed eagerly, then compiled, within the first 12
    assert len(res['notes']) == 1 and re.fullmatch(rf"compiled at once, in the fit's path at epoch 0, batch {at}: inductor's cache has "
        r"this model state's code \(compiled in a fit's path in [\d.]+s\); compiling it in the fit's path took [\d.]+s", res['notes'][0]), res

@pytest.mark.slow
@pytest.mark.parametrize('warm_s', [1e-4, 1e4])
def test_a_warm_start_compiles_where_the_fits_rest_pays_it_back(no_records, monkeypatch, warm_s):
    monkeypatch.setattr(BackgroundCompile, 'cold_cost_s', 6.) # A cold compile: far more than this fit's eager rest pays back
    monkeypatch.setattr(WarmRecords, 'get', lambda self, key: {'warm_s': warm_s})
    started, eager = _starts(monkeypatch), _fit(False)
    comp = _fit(True, backend='aot_eager')
    notes, n = comp.compiler.report.background, BackgroundCompile.probe_batches
    assert started == [] and len(notes) == 1, notes
    if warm_s < 1: # Timed over its first batches, the rest pays back the recorded compile: compiled then
        assert notes[0].startswith(f"compiled at once, in the fit's path at epoch 0, batch {n}: inductor's cache has this model "
                                   f"state's code ({warm_s:.1f}s when last measured)"), notes
        assert comp.compiler.report.graphs >= 1
    else:
        assert re.fullmatch(rf"trained eagerly: the fit's {2*len(comp.dls.train) - n} training batches left, about [\d.]+s eagerly, are too "
                            rf"few to pay back even a warm compile of 10000\.0s \(under {1e4 / SAVING:.0f}s\)", notes[0]), notes
        assert comp.compiler.report.graphs == 0
    assert_fit_close(eager.model, comp.model)

@pytest.mark.slow
def test_a_worker_out_of_gpu_memory_says_so(no_records, monkeypatch):
    monkeypatch.setattr(Worker, 'code', "import sys, torch; import fastxtend_compile.worker as b\n"
        "def full(path): raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
        "b.compile_in_worker = full; b.serve(*sys.argv[1:])")
    eager = _fit(False)
    with pytest.warns(UserWarning, match=r"torch.compile could not compile in a background worker process: the GPU is too full to compile "
                      r"beside the fit \(\S*OutOfMemoryError: CUDA out of memory\. Tried to allocate 2\.00 GiB\)\. The fit trains eagerly; "
                      r"`learn.compile\(background=False\)` compiles in the fit's path, with the memory the fit has\.") as ws:
        comp = _fit(True, cbs=[WaitForWorker(at=0)])
    assert sum('background worker' in str(w.message) for w in ws) == 1
    assert "failed after" in comp.compiler.report.background[0] and "the GPU is too full to compile beside the fit" in comp.compiler.report.background[0]
    assert comp.compiler.report.graphs == 0
    assert_fit_close(eager.model, comp.model)

class Halve(Callback):
    "From training batch `at` of the first epoch on, batches of half the size: a new model state"
    order = 0
    def __init__(self, at): self.at = at
    def before_batch(self):
        if self.training and (self.epoch or self.iter >= self.at):
            self.learn.xb, self.learn.yb = tuple(o[:32] for o in self.xb), tuple(o[:32] for o in self.yb)

@pytest.mark.slow
def test_one_worker_compiles_each_new_state_of_the_fit(no_records):
    eager = _fit(False, cbs=[Halve(6)], epochs=1)
    wait = WaitForWorker(at=(0, 6))
    comp = _fit(True, cbs=[Halve(6), wait], epochs=1, backend='aot_eager')
    notes = comp.compiler.report.background
    assert len(wait.pids) == 2 and wait.pids[0] == wait.pids[1] # The second state went to the worker that compiled the first
    assert len(notes) == 2 and all('the compiled code took over' in n for n in notes), notes
    assert comp.compiler.aside.worker.proc is None # Ended with the fit
    assert_fit_close(eager.model, comp.model)

def test_a_killed_processes_worker_folder_is_removed_by_the_next_start(no_records):
    gone = subprocess.Popen([sys.executable, '-c', 'pass'])
    gone.wait()
    stale = tempfile.mkdtemp(prefix=f'{Worker.prefix}{gone.pid}-')
    alive = tempfile.mkdtemp(prefix=f'{Worker.prefix}{os.getppid()}-') # Another running process's worker: kept
    w = Worker("import time; time.sleep(60)")
    try:
        w.start(torch.device('cpu'))
        assert not os.path.exists(stale) and os.path.isdir(alive) and os.path.isdir(w.tmp)
    finally:
        w.end()
        shutil.rmtree(alive)

@pytest.mark.worker_priority
@pytest.mark.skipif(not hasattr(os, 'getpriority'), reason="no process priorities to read")
def test_the_worker_and_its_compile_processes_run_below_the_fits_priority(no_records):
    assert Worker.nice > 0 # The library's own priority, which the other tests' workers leave aside
    w = Worker("import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])")
    try:
        w.start(torch.device('cpu'))
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, w.proc.pid) == min(own + Worker.nice, 19)
        deadline = time.time() + 30
        while not (kids := _children(w.proc.pid)) and time.time() < deadline: time.sleep(0.05)
        assert kids and all(os.getpriority(os.PRIO_PROCESS, k) == min(own + Worker.nice, 19) for k in kids), kids
    finally: w.end()

def _children(pid:int)->list:
    "The processes `pid` started, from /proc"
    try: return [int(c) for c in open(f'/proc/{pid}/task/{pid}/children').read().split()]
    except OSError: return []

def test_a_worker_that_ended_at_once_fails_its_job_quietly(no_records):
    "A worker gone before its job (it couldn't start) fails that job with its last words; ending it raises nothing"
    w = Worker("raise SystemExit('no compiler here')")
    w.start(torch.device('cpu'))
    w.proc.wait()
    job = w.submit({'inputs': b''}, nn.Linear(2, 2)) # Into a broken pipe
    res = w.poll(job)
    assert (res.ok, res.error, res.oom) == (False, 'no compiler here', False)
    w.end()
    assert w.proc is None and w.tmp is None

def test_the_hand_overs_compile_is_timed_within_its_epoch_and_phase(tmp_path, monkeypatch):
    "The warm compile's time, recorded for later fits, leaves out the batches after it, and isn't taken across a validation"
    from types import SimpleNamespace
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    at = lambda epoch, it, training=True: SimpleNamespace(epoch=epoch, iter=it, training=training)
    warm = BackgroundCompile({'backend': 'eager'}).warm_starts
    warm.time('state', 10., 0, at(0, 5), 0.5) # Batch 5 compiled warm, for the report's first line; batch 6 ran eagerly in 0.5s
    assert warm.timed(14., at(0, 7)) == (0, 3.) and warm.get('state') == {'warm_s': 3.}
    warm.time('other', 10., 0, at(0, 5), 0.5)
    assert warm.timed(99., at(0, 0, training=False)) is None # The epoch's validation came first
    assert warm.get('other') is None and warm.timing is None
    warm.times_warm = False # Under DDP, a rank other than 0: timed, not recorded
    warm.time('third', 10., 0, at(0, 5), 0.5)
    assert warm.timed(14., at(0, 7)) == (0, 3.) and warm.get('third') is None

def judge(aside, st, learn)->bool:
    "Whether the background compile sends `st` to its worker at this training batch, as the state's move finds (no worker started)"
    aside.send = lambda *args: False # The move's 'send', carried out as far as this batch goes
    return not aside.act(st, 'batch', learn)

@pytest.mark.parametrize('batches,first', [(2000, 0.02), (4000, 0.02), (2000, 2.)])
def test_a_cold_compile_pays_back_only_with_the_batches_left_after_the_workers_hand_over(tmp_path, monkeypatch, batches, first):
    "Its code serves the batches after the worker's hand-over: a fit whose rest would pay back the compile, but not after that, trains eagerly"
    from types import SimpleNamespace
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    learn = SimpleNamespace(n_epoch=1, n_iter=batches, epoch=0, iter=0, training=True)
    aside, model = BackgroundCompile({'backend': 'eager'}), nn.Linear(2, 2)
    st, n = aside.state(state_key(model, (torch.randn(1, 2),), True), model), BackgroundCompile.probe_batches
    for i in range(n):
        assert not judge(aside, st, learn)
        aside.probed(first if i == 0 else 0.02) # A 20 ms eager step; a first batch of 2s (a GPU's libraries loading) as one
    # By the mean, a 2s first batch would make the step 267 ms: 1892 batches after the hand-over would pay back the compile
    learn.iter = n
    # 1992 batches left save 14s against the 11s a cold compile costs the fit's path (its 3s warm hand-over, and 35s of eager
    # steps 1.3x slower beside the worker), but 1346 of them run before the worker's 35s hand-over
    assert judge(aside, st, learn) == (batches == 4000)
    if batches == 2000:
        assert st.stage is Stage.SHORT and [n.text for n in aside.notes] == ["trained eagerly: the fit's 1992 training batches left, "
            "about 40s eagerly, are too few to pay back a compile (under 59s; `background=False` compiles in the fit's path)"], aside.notes

@pytest.mark.parametrize('recorded_s,worth', [(None, True), (10., True), (100., False)])
def test_a_cold_compiles_hand_over_comes_a_start_up_and_the_models_recorded_compile_after_its_job(tmp_path, monkeypatch, recorded_s, worth):
    "A fit whose rest pays back a compile handed over after the prior's 35s trains eagerly where this machine recorded the model compiling for 100s"
    from types import SimpleNamespace
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    learn = SimpleNamespace(n_epoch=1, n_iter=4000, epoch=0, iter=0, training=True)
    aside, model = BackgroundCompile({'backend': 'eager'}), nn.Linear(2, 2)
    other = aside.state(state_key(model, (torch.randn(2, 2),), True), model) # Another batch size: another training state
    if recorded_s is not None: aside.warm_starts.records.put(other.record, path_s=recorded_s, training=True)
    st, n = aside.state(state_key(model, (torch.randn(1, 2),), True), model), BackgroundCompile.probe_batches
    for i in range(n): judge(aside, st, learn); aside.probed(0.02)
    learn.iter = n
    read, handover_s = [], aside.handover_s
    aside.handover_s = lambda st, start_s=None: read.append(st) or handover_s(st, start_s)
    starts, start_s = [], aside.warm_starts.start_s
    aside.warm_starts.start_s = lambda record: starts.append(record) or start_s(record)
    # 3992 batches of 20 ms left, 26 ms beside the worker: a hand-over after 15+100s comes after the fit's last
    assert judge(aside, st, learn) == worth and (st.stage is Stage.SHORT) == (not worth)
    # The records are read once for the verdict, its cost, and its note where it trains eagerly: the hand-over and the start-up
    assert read == [st] and starts == [st.record]

@pytest.mark.parametrize('compile_s,slowdown', [(20., 1.3), (3., 1.3), (60., 1.1)])
def test_a_cold_compile_costs_the_fits_path_what_the_fit_loses_to_it_beside_its_eager_steps(compile_s, slowdown):
    "A fit with the worker takes its eager time, less what the batches after the hand-over save, plus `cold_cost`"
    from fastxtend_compile.payoff import cold_cost, worker_handover, worker_rest, WARM_SHARE
    left, step_s, saving = 10_000, 0.02, 0.35
    handover_s = worker_handover(compile_s)
    rest = worker_rest(left, step_s, handover_s, slowdown)
    # Simulated: the eager steps beside the worker, slowed, until its hand-over; its warm compile; the rest, compiled
    before = left - rest
    fit_s = before*step_s*slowdown + WARM_SHARE*compile_s + rest*step_s*(1 - saving)
    assert fit_s == pytest.approx(left*step_s - rest*step_s*saving + cold_cost(handover_s, slowdown=slowdown), abs=step_s*slowdown)
    assert cold_cost(handover_s, slowdown=1.) == pytest.approx(WARM_SHARE*compile_s) # A worker that slows nothing costs its hand-over alone

def test_the_probe_times_the_eager_step_once_for_the_verdict_and_the_hand_overs_timing(tmp_path, monkeypatch):
    "A fit's slow first batch (its loader starting) moves neither the probe's median step nor what the hand-over's timing takes off"
    from types import SimpleNamespace
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    learn = SimpleNamespace(n_epoch=1, n_iter=10_000, epoch=0, iter=0, training=True)
    aside, model = BackgroundCompile({'backend': 'eager'}), nn.Linear(2, 2)
    st = aside.state(state_key(model, (torch.randn(1, 2),), True), model)
    worth = []
    # The first batch takes 5s, the others 0.25-0.45s, each timed alone by the recorder
    for took in [5., 0.3, 0.25, 0.4, 0.3, 0.35, 0.3, 0.45, None]:
        worth.append(judge(aside, st, learn))
        assert aside.probing == (took is not None) # Each of the probe's batches is timed, not the one judged after them
        if took is not None: aside.probed(took)
    assert worth == [False]*8 + [True] # After 8 batches timed, thousands left: a cold compile pays
    # The step: the median of the batches after the first (`eager_step`), for the verdict and the hand-over's timing alike
    assert st.probe.step_s == pytest.approx(0.3)
    aside.warm_starts.time(st.record, 10., 0, SimpleNamespace(epoch=0, iter=9, training=True), _step(st))
    # Batch 9 compiled in 2s, then ran a step: the probe's step is taken off
    assert aside.warm_starts.timed(12.3, SimpleNamespace(epoch=0, iter=10, training=True)) == (0, pytest.approx(2.))
    assert aside.warm_starts.get(st.record) == {'warm_s': pytest.approx(2.)}

@pytest.mark.parametrize('saving', [None, 0.4, -0.1])
def test_a_state_compiled_before_compiles_warm_where_the_share_its_code_saved_pays(tmp_path, monkeypatch, saving):
    "A state a fit compiled in its path before a kernel restart compiles at once, warm, where the step share its code saved pays that back"
    from types import SimpleNamespace
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    aside, model = BackgroundCompile({'backend': 'eager'}), nn.Linear(2, 2)
    st, n = aside.state(state_key(model, (torch.randn(1, 2),), True), model), BackgroundCompile.probe_batches
    # Compiled cold in a fit's path: its warm compile, not yet timed, is taken to cost 3s
    aside.warm_starts.records.put(st.record, path_s=3. / WARM_SHARE, **({} if saving is None else {'saving': saving}))
    learn = SimpleNamespace(n_epoch=1, n_iter=2808, epoch=0, iter=0, training=True)
    for _ in range(n):
        assert not judge(aside, st, learn)
        aside.probed(0.004)
    learn.iter = n
    # 2800 batches of 4ms left, 11.2s eagerly: 40% saved pays back 3s (7.5s of steps), and so does the prior (8.6s at 35%)
    # where no saving was measured; a measured loss, weighed as `MARGIN`, would need 100s
    assert SAVING * 11.2 > 3. and judge(aside, st, learn) == (saving != -0.1)
    if saving == -0.1:
        assert [n.text for n in aside.notes] == [f"trained eagerly: the fit's 2800 training batches left, about 11s eagerly, are too "
                                                 f"few to pay back even a warm compile of 3.0s (under {3. / MARGIN:.0f}s)"], aside.notes

def test_a_fit_records_the_share_of_a_step_its_one_compiled_training_state_saved(tmp_path, monkeypatch):
    "The share is the fit's compiled step against its eager one, kept for the one training state it compiled, by the process that timed both"
    from types import SimpleNamespace
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    model, x = nn.Linear(2, 2), (torch.randn(1, 2),)
    warm = BackgroundCompile({'backend': 'eager'}).warm_starts
    record = lambda training: warm.key(model, state_key(model, x, training))
    warm.in_path(model, x, True, 9.)
    warm.in_path(model, x, False, 2.) # Validation's state: not the training step measured
    warm.measured(0.006, 0.010)
    assert warm.get(record(True)) == {'path_s': 9., 'training': True, 'saving': pytest.approx(0.4), 'compiled_s': 0.006, 'eager_s': 0.010}
    assert warm.get(record(False)) == {'path_s': 2., 'training': False}
    warm.measured(0.001, 0.010) # A fit that compiled no training state records nothing
    assert warm.get(record(True))['saving'] == pytest.approx(0.4)
    warm.time(record(True), 1., 0, SimpleNamespace(epoch=0, iter=0, training=True)) # A later fit compiles it warm
    warm.times_warm = False # Under DDP, a rank other than the one that timed the eager step
    warm.measured(0.002, 0.010)
    assert warm.get(record(True))['saving'] == pytest.approx(0.4)
    warm.times_warm = True
    warm.time(record(True), 1., 0, SimpleNamespace(epoch=0, iter=0, training=True))
    warm.measured(0.012, 0.010) # Slower than eager: recorded as it was measured
    assert warm.get(record(True))['saving'] == pytest.approx(-0.2)

def test_a_cold_compile_is_expected_to_take_what_this_machine_recorded_of_the_model(tmp_path, monkeypatch):
    "A state's own recorded cold compile, in a worker or the fit's path; else its model's other training states', with the same settings; else the prior"
    from fastxtend_compile.payoff import TIER_COMPILE_S
    from fastxtend_compile.worker import JobResult
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    model, warm = nn.Linear(2, 2), BackgroundCompile({'backend': 'eager'}).warm_starts
    record = lambda bs, training=True, settings=None: warm.key(model, state_key(model, (torch.randn(bs, 2),), training), settings)
    assert warm.compile_s(record(1)) == TIER_COMPILE_S # Nothing recorded on this machine: the payoff rule's prior
    warm.in_path(model, (torch.randn(1, 2),), False, 2.) # An evaluation state: a forward alone
    assert warm.compile_s(record(1)) == TIER_COMPILE_S
    warm.compiled(record(2), JobResult(True, forward_s=3., backward_s=6., took_s=20.))
    warm.in_path(model, (torch.randn(4, 2),), True, 13.)
    assert warm.compile_s(record(1)) == 11. # The median of the two training states'
    assert warm.compile_s(record(4)) == 13. and warm.compile_s(record(1), record(2)) == 9. # Its own: a worker's compile
    assert warm.compile_s(record(1, settings={'backend': 'eager', 'mode': 'reduce-overhead'})) == TIER_COMPILE_S # Other settings: another compile
    assert warm.compile_s(record(1, settings={'backend': 'eager', 'mode': 'reduce-overhead'}), record(1)) == 11.
    warm.compiled(record(5), JobResult(False, 'failed'))
    assert warm.get(record(5)) is None

def test_a_cold_workers_hand_over_comes_the_start_up_and_compile_this_machine_recorded_of_the_model(tmp_path, monkeypatch):
    "A worker's start-up, recorded with each state it compiled, is the next cold worker's for the model; the prior until one is recorded"
    from fastxtend_compile.payoff import TIER_COMPILE_S, WORKER_START_S, cold_cost
    from fastxtend_compile.worker import JobResult
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    model, aside = nn.Linear(2, 2), BackgroundCompile({'backend': 'eager'})
    warm, state = aside.warm_starts, lambda bs: aside.state(state_key(model, (torch.randn(bs, 2),), True), model)
    assert aside.handover_s(state(1)) == WORKER_START_S + TIER_COMPILE_S and warm.start_s(state(1).record) == WORKER_START_S
    warm.compiled(state(2).record, JobResult(True, start_s=4., forward_s=3., backward_s=6.))
    warm.compiled(state(3).record, JobResult(True, start_s=6., forward_s=1., backward_s=2.))
    warm.in_path(model, (torch.randn(4, 2),), True, 13.) # Compiled in the fit's path: no start-up to record
    assert warm.start_s(state(1).record) == 5. # The median of the two workers' start-ups
    assert aside.handover_s(state(1)) == 5. + 9. and aside.handover_s(state(3)) == 5. + 3. # Then its compile, as recorded
    # Its cost to the fit's path is the recorded start-up's too: the warm hand-over is a share of the compile alone
    assert aside.facts(state(3), None).cold_cost_s == pytest.approx(cold_cost(8., 5.))

def test_the_next_training_batch_after_an_epochs_last_is_the_next_epochs_first():
    from types import SimpleNamespace
    from fastxtend_compile.background import position
    at = lambda it: SimpleNamespace(epoch=1, iter=it, n_iter=4)
    assert [position(at(2), True), position(at(3), True), position(at(3))] == [(1, 3), (2, 0), (1, 3)]

@pytest.mark.slow
def test_a_failed_job_fails_alone_and_the_worker_compiles_the_next(no_records):
    "A job that fails (here a model that can't be read back) leaves the job sent after it to compile in the same process"
    from fastxtend_compile.worker import job_payload
    w, m, x = Worker(), nn.Linear(3, 2), torch.randn(4, 3)
    try:
        bad = {**job_payload(m, (x,), dict(backend='eager')), 'model': b'not a pickle'}
        jobs = [w.submit(bad, m), w.submit(job_payload(m, (x,), dict(backend='eager')), m)]
        res = []
        for job in jobs:
            while (r := w.poll(job)) is None: time.sleep(0.05)
            res.append(r)
        assert [r.ok for r in res] == [False, True] and 'UnpicklingError' in res[0].error, res
        assert jobs[0].proc is jobs[1].proc and w.proc.poll() is None # One process served both, and still runs
    finally: w.end()

@pytest.mark.slow
def test_a_worker_compiles_a_model_of_torch_layers_without_importing_fastai(no_records, tmp_path, monkeypatch):
    "The worker's process imports torch and this package's `core`, not fastai, nor inductor for another backend: its start-up is seconds shorter"
    from fastxtend_compile.worker import job_payload
    from tier_backends import reports_imports
    monkeypatch.setenv('FXC_TEST_IMPORTS', str(tmp_path/'imports.json'))
    w, m, x = Worker(), nn.Sequential(nn.Linear(3, 2), nn.ReLU()), torch.randn(4, 3)
    try:
        job = w.submit(job_payload(m, (x,), dict(backend=reports_imports)), m)
        while (r := w.poll(job)) is None: time.sleep(0.05)
        assert r.ok, r.error
        assert json.loads((tmp_path/'imports.json').read_text()) == [] # Its backend ran in the worker, and saw none of them
    finally: w.end()

@pytest.mark.slow
def test_a_model_module_that_imports_this_package_gets_it_whole_in_the_worker():
    "A worker's package runs its `__init__` when a job reads a name of it, as a model's module that star-imports it does"
    from fastxtend_compile.worker import _DEFERRED_INIT
    probe = _DEFERRED_INIT + "import fastxtend_compile.worker; print('fastai' in sys.modules)\n" + \
            "from fastxtend_compile import *; from fastai.learner import Learner; print(hasattr(Learner, 'compile'), CompilerCallback.__name__)"
    out = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split('\n')[:2] == ['False', 'True CompilerCallback'], out.stdout

@pytest.mark.slow
def test_a_job_sent_after_its_process_ended_compiles_in_a_new_one(no_records):
    "The worker's process ended, with its job: a job sent later starts a new process and compiles, and the lost job says why it has no code"
    from fastxtend_compile.worker import job_payload
    w, m, x = Worker(), nn.Linear(3, 2), torch.randn(4, 3)
    try:
        first = w.submit(job_payload(m, (x,), dict(backend='eager')), m)
        ended = w.proc
        w.end() # The fit's worker idled, say, before the state's next job
        second = w.submit(job_payload(m, (x,), dict(backend='eager')), m)
        assert second.proc is w.proc is not None and w.proc is not ended and w.jobs == 2
        while (r := w.poll(second)) is None: time.sleep(0.05)
        assert r.ok, r.error
        assert w.poll(first).error == 'the worker process was ended'
    finally: w.end()

def test_a_new_model_where_a_freed_one_lived_is_a_new_state():
    "A model made after another is freed may get its address (`id`): it is a state of its own, not the freed one's"
    import gc
    x = torch.randn(1, 2)
    aside, a = BackgroundCompile({'backend': 'eager'}), nn.Linear(2, 2)
    old, key = id(a), state_key(a, (x,), True)
    aside.state(key, a).stage = Stage.READY
    del a; gc.collect()
    b = next((m for m in (nn.Linear(2, 2) for _ in range(10_000)) if id(m) == old), None)
    if b is None: pytest.skip("no new model took the freed one's address here")
    new = state_key(b, (x,), True)
    assert new != key and new not in aside.states and aside.state(new, b).stage is Stage.PROBING

def test_a_state_key_is_one_dict_key_for_equal_states_and_survives_pickling():
    "Equal states are one key, hashed once; a key loaded in another process is hashed there, not with the stored hash"
    import pickle
    model = nn.Linear(2, 2)
    key = state_key(model, (torch.randn(3, 2),), True)
    states = {key: 'a'}
    assert states[state_key(model, (torch.randn(3, 2),), True)] == 'a'
    assert state_key(model, (torch.randn(4, 2),), True) not in states # Another batch size
    model.weight.requires_grad_(False)
    assert state_key(model, (torch.randn(3, 2),), True) not in states # Another freeze state
    loaded = pickle.loads(pickle.dumps(key))
    assert loaded == key and hash(loaded) == hash(key) and loaded.durable == key.durable

def test_a_batch_key_reads_the_flags_of_the_parameters_kept_through_the_fit():
    "Each batch's state reads `requires_grad` from the parameter list the fit first made, not the module tree: the same key"
    aside, model, x = BackgroundCompile({'backend': 'eager'}), nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)), torch.randn(4, 2)
    key = aside.batch_key(model, (x,), True)
    kept = aside.params[1]
    assert key == state_key(model, (x,), True)
    model[0].weight.requires_grad_(False) # Frozen by hand, without `freeze_to`: a new state all the same
    frozen = aside.batch_key(model, (x,), True)
    assert aside.params[1] is kept and frozen != key and frozen == state_key(model, (x,), True)
    other = nn.Linear(2, 2) # Another model: its own parameters
    assert aside.batch_key(other, (x,), True) == state_key(other, (x,), True) and aside.params[1] is not kept
    aside.stop()
    assert aside.params is None

@pytest.mark.slow
def test_a_state_whose_worker_failed_is_tried_again_in_the_next_fit(no_records, monkeypatch):
    "A failed compile leaves its state eager for the fit; the next fit sends it to a worker again (the GPU may have room now)"
    code = Worker.code
    monkeypatch.setattr(Worker, 'code', "raise SystemExit('no compiler here')")
    set_seed(0, reproducible=True)
    learn = Learner(digits_dls(), two_conv_cnn(), cbs=[WaitForWorker(at=0)])
    learn.compile(backend='aot_eager', background=True, **EAGER_PRECISION)
    with pytest.warns(UserWarning, match=r"torch.compile failed in a background worker process \(no compiler here\)"), learn.no_bar():
        learn.fit(1, 3e-3)
    assert learn.compiler.report.graphs == 0
    monkeypatch.setattr(Worker, 'code', code)
    with learn.no_bar(): learn.fit(1, 3e-3)
    notes = learn.compiler.report.background
    assert "the compiled code took over at epoch 0, batch 1" in notes[-1] and learn.compiler.report.graphs >= 1, notes

def test_an_unfinished_evaluation_compile_is_reported_as_one():
    "A validation state still compiling when the fit ends ran no training batches eagerly: the report says it was for evaluation"
    from fastxtend_compile.state import ModelState
    model, aside = nn.Linear(2, 2).eval(), BackgroundCompile({'backend': 'eager'})
    with torch.no_grad(): st = aside.compiling = ModelState(state_key(model, (torch.randn(1, 2),), False), 'record')
    st.sent_at = (0, 0)
    aside.stop() # The fit ended
    assert [n.text for n in aside.take_notes()] == [
        "the fit ended before the worker process finished compiling for evaluation, sent at epoch 0, batch 0"]

def test_an_evaluation_state_is_cold_until_inductors_cache_has_its_code_and_started_once_worth_compiling(tmp_path, monkeypatch):
    "What a fit's validation verdict asks of the background: when a cold worker would hand its code over, if it would compile it cold, and whether its compile began"
    from fastxtend_compile.payoff import WORKER_HANDOVER_S, WORKER_START_S
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    aside, model = BackgroundCompile({'backend': 'eager'}), nn.Linear(2, 2)
    key = aside.batch_key(model, (torch.randn(1, 2),), False)
    assert aside.cold_wait(key, model) == WORKER_HANDOVER_S and not aside.started(key) # Nothing recorded: the prior's hand-over
    trained = aside.state(aside.batch_key(model, (torch.randn(4, 2),), True), model)
    aside.warm_starts.records.put(trained.record, path_s=40., training=True) # The model's training state compiled in a fit's path
    assert aside.cold_wait(key, model) == WORKER_START_S + 40. # A start-up, then the model's recorded compile
    st = aside.states[key]
    for stage, started in ((Stage.SHORT, False), (Stage.FAILED, False), (Stage.JUDGED, True), (Stage.COMPILING, True), (Stage.READY, True)):
        st.stage = stage
        assert aside.started(key) == started, stage
    aside.warm_starts.records.put(st.record, cold_s=9.) # A worker compiled it in an earlier fit: inductor's cache has its code
    assert aside.cold_wait(key, model) is None
    aside.ranks.evaluates = False # Under DDP evaluation runs eagerly: no worker compiles it
    assert aside.cold_wait(aside.batch_key(model, (torch.randn(3, 2),), False), model) is None

def test_evaluation_batches_are_timed_in_runs_of_one_kind_leaving_out_each_runs_first_and_an_evaluations_last():
    from fastxtend_compile.background import _EvalTimes
    t = _EvalTimes()
    # A validation: 4 batches eager while a worker compiles, then its code takes over, compiling 1s at the first compiled batch
    for now, compiled in ((0., False), (.1, False), (.2, False), (.3, False), (.4, True), (1.4, True), (1.5, True), (1.6, True), (1.7, True), (1.8, True)):
        t.batch('r', compiled, now)
    t.batch(None, False, 9.) # A training batch: the validation's last batch ended with its epoch
    assert t.take() == {('r', False): pytest.approx(.1), ('r', True): pytest.approx(.1)} and t.take() == {}
    for now in (0., .1, .2, .3): t.batch('r', True, now) # Two batches timed: too few to say
    assert t.take() == {}

def test_an_evaluation_states_batches_are_timed_eager_and_compiled_recorded_once_compiled_and_judge_its_later_validations(tmp_path, monkeypatch):
    "Each evaluation batch is timed to the next one's start; the fit's end records their means where the state's code was compiled"
    import fastxtend_compile.background as bg
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    aside, model = BackgroundCompile({'backend': 'eager'}), nn.Linear(2, 2)
    key, train = aside.batch_key(model, (torch.randn(4, 2),), False), aside.batch_key(model, (torch.randn(4, 2),), True)
    def fit():
        "Training batches, an eager validation, training batches, a compiled one, a training batch: each validation's first batch slow"
        # The clock is read once a batch of the validations, and once by the training batch that ends each: no more
        clock = iter([1., 2., 2.01, 2.02, 2.03, 3., 4., 4.5, 4.506, 4.512, 4.518, 5.]) # The last batches' ends: the epochs' ends
        monkeypatch.setattr(bg.time, 'perf_counter', lambda: next(clock))
        for compiled in (None, None, *[False]*5, None, None, *[True]*5, None): aside.eval_batch(train if compiled is None else key, model, compiled)
        monkeypatch.undo()
        monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
        aside.warm_starts.measured(None, None)
    record = aside.state(key, model).record
    fit()
    assert aside.warm_starts.get(record) is None # Never compiled: no record that says inductor's cache has its code
    aside.warm_starts.records.put(record, cold_s=9., warm_s=1.4, training=False)
    fit()
    rec = aside.warm_starts.get(record)
    assert rec['eager_batch_s'] == pytest.approx(0.01) and rec['compiled_batch_s'] == pytest.approx(0.006) # Means, the first batch of each run left out
    assert aside.pays_eval(key, model, 600) is True and aside.take_notes() == [] # 2.4s saved pays back its 1.4s warm compile
    assert aside.pays_eval(key, model, 300) is False and aside.pays_eval(key, model, 200) is False
    assert [n.text for n in aside.take_notes()] == [
        "ran eagerly, validation within the fit: a fit timed its batches at 10.0 ms eager and 6.0 ms compiled, 1.20s over the 300 left, "
        "under the 1.4s of a warm compile; `compile_valid=True` compiles it"]
    assert aside.pays_eval(key, model, 200, within=False) is False # A `get_preds` of 200 batches
    assert [n.text for n in aside.take_notes()] == [
        "ran eagerly, evaluation outside a fit (`get_preds`, `validate`): a fit timed its batches at 10.0 ms eager and 6.0 ms compiled, "
        "0.80s over its 200, under the 1.4s of a warm compile; `compile_valid=True` compiles it"]

@pytest.mark.background_default
def test_a_fit_compiles_in_the_background_on_a_cuda_gpu_by_default_or_as_asked_and_not_where_compiled_autograd_compiles_ddps_backwards():
    cpu, cuda = torch.device('cpu'), torch.device('cuda') # Starting for a CUDA device touches no GPU
    assert not BackgroundCompile({'backend': 'eager'}).start(None, cpu, ddp=False, compiled_backward=False) # Not off a CUDA GPU by default
    assert BackgroundCompile({'backend': 'eager'}).start(None, cuda, ddp=False, compiled_backward=False) # On one by default
    assert not BackgroundCompile({'backend': 'eager'}, background=False).start(None, cuda, ddp=False, compiled_backward=False)
    aside = BackgroundCompile({'backend': 'eager'}, background=True)
    assert not aside.start(None, cpu, ddp=True, compiled_backward=True) # Each backward compiles with DDP's all-reduces, in the fit's path
    assert [n.text for n in aside.take_notes()] == ["compiled in the fit's path: with `ddp_compiled_autograd=True` each backward "
                                                    "compiles with DDP's all-reduces, which a worker process can't run"]
    shown = []
    assert aside.start(shown.append, cpu, ddp=False, compiled_backward=False) and aside.show == shown.append and aside.ranks.rank == 0

@pytest.mark.parametrize('compile_valid', [True, False])
def test_an_evaluation_outside_a_fit_compiles_in_its_path_not_in_a_worker_it_would_end_first(no_records, monkeypatch, compile_valid):
    "`validate()` that is to compile (`compile_valid=True`, or its batches pay): its own path compiles its graph once, where a worker's job would end unfinished with it, every time"
    if not compile_valid: payoff_says(monkeypatch, True)
    set_seed(0, reproducible=True)
    dls, model = digits_dls(), two_conv_cnn()
    eager = Learner(dls, model).validate()[0] # The loss
    learn = Learner(dls, model).compile(backend='eager', background=True, compile_valid=compile_valid)
    seconds = []
    for i in range(2):
        assert learn.validate()[0] == pytest.approx(eager, rel=1e-5)
        r = learn.compiler.report # Of the evaluations so far: the first compiles the evaluation graph, the second runs it
        assert r.graphs == 1 and r.compile_seconds > 0, r.summary()
        assert not any('worker' in n for n in r.background), r.background
        seconds.append(r.compile_seconds)
    assert seconds[1] == seconds[0]
