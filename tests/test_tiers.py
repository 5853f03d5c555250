"Faster tiers: once the compiled code runs, a tier compiled in the worker takes over where an A/B on the fit's batches finds it faster"
import re, time
import pytest, torch
from torch import nn
from fastai.learner import Learner
from fastai.callback.core import Callback
from fastai.torch_core import set_seed
from fastxtend_compile import *
from fastxtend_compile import tiers, background, life
from fastxtend_compile.tiers import Tiers, why_no_tiers
from fastxtend_compile.payoff import pick_tier, first_tier, cudagraphs_fit, faster, first_in_path
from fastxtend_compile.background import BackgroundCompile, WarmStarts
from fastxtend_compile.internals import compiled_call
from conftest import two_conv_cnn, digits_dls, EAGER_PRECISION, assert_fit_close
from test_background import WaitForWorker, _leftovers, no_records # noqa: F401 (a fixture)
from tier_backends import sleepy, refused, slow_to_compile, worker_only, flaky, IdleMeter as _IdleMeter

# The A/Bs compare a step against one 100 ms slower, whatever the machine's load

class TierBatches(Callback):
    "Record which batches ran a tier, and wait for each job of the worker to end, so the tier's hand-over comes at a known batch"
    order = 20 # After `CompilerCallback`
    def __init__(self, wait=True): self.ran, self.wait = [], wait # `wait=False`: for the default's job alone
    def before_batch(self):
        if self.learn.compiler.policy.tier is not None: self.ran.append((self.epoch, self.training, self.iter, self.n_iter))
    def after_batch(self):
        aside = self.learn.compiler.aside
        jobs = aside.worker.waiting if self.wait else [aside.compiling.job] if aside.compiling else [] # The default's job, then the tier's
        for job in list(jobs):
            while aside.poll(job) is None: time.sleep(0.05)

@pytest.fixture
def cpu_tiers(no_records, monkeypatch):
    "Tiers on the CPU, in short stages, the tier named by the test picked whatever the measured step and the backend"
    monkeypatch.setattr(Tiers, 'default_on', ('cpu',))
    for k,v in dict(settle_batches=1, time_batches=3, warmup_batches=1, ab_batches=6, try_cost_s=0).items(): monkeypatch.setattr(Tiers, k, v)
    def use(name, settings):
        monkeypatch.setitem(tiers.TIERS, name, settings)
        monkeypatch.setattr(Tiers, 'pick', staticmethod(lambda busy: name))
        monkeypatch.setattr(tiers, 'why_no_tiers', lambda settings: None) # The test's backends have no modes
    return use

class PythonBound(nn.Module):
    "A model whose eager forward spends 30 ms in Python, which its traced graph leaves out: on the CPU, a launch-bound step's stand-in"
    def __init__(self): super().__init__(); self.model = two_conv_cnn()
    def forward(self, x):
        if not torch.compiler.is_compiling(): time.sleep(0.03)
        return self.model(x)

def _fit(compiled=True, epochs=3, wait=True, model=two_conv_cnn, **kw):
    set_seed(0, reproducible=True)
    seen = TierBatches(wait)
    learn = Learner(digits_dls(), model(), cbs=[seen] if compiled else [])
    # The optimizer's step stays fastai's: these fits check the model's tiers against eager. PyTorch's fused Adam rounds
    # otherwise on some CPUs: after these 3 epochs, 27 of 2,304 weights of the second conv 3.0e-4 from fastai's Adam (a
    # 2-core x86 machine, torch 2.14.1), the same with the `eager` backend and no tier; 0 with fastai's step.
    # `tests/test_optimizer.py` checks the fused step
    if compiled: learn.compile(**{'background': True, 'compile_opt': False, **EAGER_PRECISION, **kw})
    learn.fit(epochs, 3e-3)
    return learn, seen.ran

@pytest.mark.slow
def test_a_faster_tier_takes_over_after_its_ab_and_trains_like_eager(cpu_tiers):
    cpu_tiers('plain', dict(backend='aot_eager'))
    eager, _ = _fit(False)
    learn, ran = _fit(backend=sleepy) # The default compiles with a backend 100 ms slower at each call
    notes = learn.compiler.report.background
    took = next(n for n in notes if n.startswith('tier plain took over'))
    assert re.search(r"^tier plain took over at epoch \d, batch \d+: compiled in a worker process in [\d.]+s \(.+\); compiling it in the "
                     r"fit's path took [\d.]+s; ([\d.]+) ms a step against ([\d.]+) ms for the default, alternating on the fit's batches$", took), notes
    tier_ms, base_ms = map(float, re.search(r"([\d.]+) ms a step against ([\d.]+) ms", took).groups())
    assert base_ms >= 100 and tier_ms < base_ms, (tier_ms, base_ms) # The default's time holds the sleep its backend adds to each forward
    # Training batches alone, an epoch's last among them: fastai drops a smaller last training batch, so it has the state's shape
    assert ran and all(training for _,training,_,_ in ran) and any(it == n - 1 for _,_,it,n in ran), ran
    assert re.search(r"^tier plain ran \d+ training batch\(es\), from epoch \d, batch \d+ on$", notes[-1]), notes
    assert_fit_close(eager.model, learn.model)

    # The next fit of the same state runs the kept tier from its first batch, without measuring it again
    seen = learn.cbs.filter(lambda c: isinstance(c, TierBatches))[0]
    seen.ran = []
    learn.fit(1, 3e-3)
    n_iter = len(learn.dls.train)
    assert [it for _,_,it,_ in seen.ran] == list(range(n_iter)), seen.ran # Each batch
    assert learn.compiler.report.background[-1] == f"tier plain ran {n_iter} training batch(es), from epoch 0, batch 0 on"

@pytest.mark.slow
def test_a_tier_that_fails_in_the_fits_path_is_dropped_and_the_default_trains_on(cpu_tiers):
    cpu_tiers('worker_only', dict(backend=worker_only))
    eager, _ = _fit(False)
    learn, ran = _fit(backend='aot_eager')
    notes = learn.compiler.report.background
    assert ("tier worker_only failed in the fit's path (RuntimeError: no kernels in the training process); the default tier trains "
            "on") in notes, notes
    assert len(ran) == 1 # The switch batch asked for it, and ran the default's code
    assert [k for k in compiled_call(learn.model).entries if 'tier' in k] == []
    assert_fit_close(eager.model, learn.model)

@pytest.mark.slow
def test_a_fit_that_ends_while_its_tier_compiles_leaves_nothing_behind(cpu_tiers):
    cpu_tiers('slow', dict(backend=slow_to_compile))
    learn, ran = _fit(epochs=2, wait=False, backend='aot_eager')
    notes = learn.compiler.report.background
    assert "the fit ended before tier slow compiled in the worker process" in notes, notes
    assert ran == [] and learn.compiler.aside.worker.proc is None # The worker was ended (the fixture checks its folder went)

@pytest.mark.slow
def test_a_slower_tier_is_dropped_after_its_ab(cpu_tiers):
    cpu_tiers('sleepy', dict(backend=sleepy))
    eager, _ = _fit(False)
    learn, ran = _fit(backend='aot_eager')
    notes = learn.compiler.report.background
    dropped = next(n for n in notes if n.startswith('tier sleepy'))
    assert re.search(r"^tier sleepy not kept: [\d.]+ ms a step against [\d.]+ ms for the default, alternating on the fit's batches; "
                     r"its graphs were dropped$", dropped), notes
    assert len(ran) == 1 + Tiers.warmup_batches + Tiers.ab_batches, (ran, notes) # The switch, the warm-up and the A/B's half: then never again
    call = compiled_call(learn.model)
    assert not [k for k in call.entries if 'tier' in k] # Its compiled functions are gone
    assert_fit_close(eager.model, learn.model)

@pytest.mark.slow
def test_a_tier_the_worker_cannot_compile_leaves_the_default_training(cpu_tiers):
    cpu_tiers('refused', dict(backend=refused))
    eager, _ = _fit(False, epochs=2)
    learn, ran = _fit(epochs=2, backend='aot_eager')
    notes = learn.compiler.report.background
    assert any(re.search(r"^tier refused not tried: compiling it in a worker process failed after [\d.]+s \(.*this tier has no kernels "
                         r"for the model.*\); the default tier trains on$", n) for n in notes), notes
    assert ran == [] and learn.compiler.aside.worker.proc is None
    assert_fit_close(eager.model, learn.model)

@pytest.mark.slow
def test_a_short_fit_tries_no_tier(cpu_tiers, monkeypatch):
    cpu_tiers('plain', dict(backend='aot_eager'))
    monkeypatch.setattr(Tiers, 'try_cost_s', 6.) # Far more than a tier could save over a digits fit's few seconds on the CPU
    learn, ran = _fit(epochs=2, backend='aot_eager')
    notes = learn.compiler.report.background
    assert any(re.search(r"^no faster tier: plain would save about [\d.]+ ms a step over the \d+ training batches left once it "
                         r"compiled, [\d.]+s in all, under the 6.0s trying it costs the fit$", n) for n in notes), notes
    assert ran == [] and learn.compiler.aside.worker.jobs == 1 # The default's job alone: no tier was sent to the worker

@pytest.fixture
def first_tiers(cpu_tiers, monkeypatch):
    "Tiers on the CPU whose eager probe finds the step launch-bound: the worker compiles the test's tier first"
    monkeypatch.setattr(BackgroundCompile, 'cold_cost_s', 1e-9) # The probe runs, and any fit pays back the compile
    monkeypatch.setattr(BackgroundCompile, 'handover_s', lambda self, st, start_s=None: 0.) # Its code serves the fit's rest from the job on
    monkeypatch.setattr(tiers, '_BusyMeter', _IdleMeter)
    def use(name, settings):
        cpu_tiers(name, settings)
        monkeypatch.setattr(tiers.Tiers, 'pick_first', staticmethod(lambda busy, *_: name if busy == 0 else None))
        monkeypatch.setattr(tiers.Tiers, 'in_path', staticmethod(lambda busy, compile_s, warm_s, start_s: False)) # In the worker
    return use

# The batch of the probe's verdict, where tiers measure the eager step's GPU work once the probe timed it
VERDICT = BackgroundCompile.probe_batches + tiers.Tiers.first_batches + 1

def _handover(notes:list)->tuple:
    "Where the background compile's code took over, as (epoch, batch)"
    return tuple(map(int, re.search(r"the compiled code took over at epoch (\d+), batch (\d+)", notes[0]).groups()))

@pytest.mark.slow
def test_a_launch_bound_eager_step_has_its_tier_compiled_first_and_run_from_the_handover(first_tiers):
    first_tiers('plain', dict(backend='aot_eager'))
    eager, _ = _fit(False)
    learn, ran = _fit(backend=sleepy) # The default's code 100 ms slower at each call: the A/B keeps the tier
    notes, cb = learn.compiler.report.background, learn.compiler
    assert ran[0][:3] == (*_handover(notes)[:1], True, _handover(notes)[1]), (ran[:3], notes) # The tier ran the hand-over's batch
    assert _handover(notes) == (0, VERDICT + 1) # Sent at the verdict; done before the next batch
    assert cb.aside.worker.jobs == 2 # The tier's job, then the default's for the A/B: nothing else
    took = next(n for n in notes if n.startswith('tier plain took over'))
    assert re.search(r"^tier plain took over at epoch \d, batch \d+: the GPU ran work 0% of the eager [\d.]+ ms step, so CUDA graphs, "
                     r"compiled first, would save about [\d.]+ ms of it; compiled in a worker process in [\d.]+s \(.+\); "
                     r"compiling it in the fit's path took [\d.]+s; [\d.]+ ms a step against [\d.]+ ms for the default", took), notes
    assert_fit_close(eager.model, learn.model)

@pytest.fixture
def path_tiers(first_tiers, monkeypatch):
    "First tiers that compile in the fit's path, as the library's policy has a step whose GPU idles throughout"
    def use(name, settings):
        first_tiers(name, settings)
        monkeypatch.setattr(tiers.Tiers, 'in_path', staticmethod(first_in_path))
        monkeypatch.setattr(WarmStarts, 'compile_guess_s', 1e-3) # Paid back by a digits fit on the CPU
    return use

@pytest.mark.slow
def test_a_launch_bound_eager_step_compiles_its_tier_first_in_the_fits_path_and_keeps_it_where_it_beats_eager(path_tiers, monkeypatch):
    "The tier compiles cold at the probe's end and is kept once its steps beat the eager step the probe timed: no worker at all"
    path_tiers('plain', dict(backend='aot_eager'))
    eager, _ = _fit(False, model=PythonBound)
    learn, ran = _fit(model=PythonBound, backend='aot_eager')
    notes, at = learn.compiler.report.background, VERDICT
    assert notes[0] == (f"compiled in the fit's path at epoch 0, batch {at}, the faster tier first: a worker compiling beside the "
                        "eager step would slow it more than the compile costs here"), notes
    assert ran[0][:3] == (0, True, at) and learn.compiler.aside.worker.jobs == 0, (ran[:3], notes)
    took = next(n for n in notes if n.startswith('tier plain took over'))
    assert re.search(r"; compiled cold in the fit's path in [\d.]+s; ([\d.]+) ms a step against ([\d.]+) ms for the eager step, each "
                     r"timed alone$", took), notes
    tier_ms, eager_ms = map(float, re.search(r"([\d.]+) ms a step against ([\d.]+) ms", took).groups())
    assert eager_ms >= 30 and tier_ms < eager_ms, (tier_ms, eager_ms) # The eager step's time holds the 30 ms its forward sleeps in Python
    assert ran[-1][:3] == (2, True, len(learn.dls.train) - 1) # Kept to the fit's end
    assert_fit_close(eager.model, learn.model)
    # Recorded as a compile in a fit's path: a new Learner of the model runs the tier at once from its probe's end
    monkeypatch.setattr(life, 'warm_cost', lambda rec, default_s: 1e-9) # Any fit pays back a warm compile
    learn, ran = _fit(epochs=1, model=PythonBound, backend='aot_eager')
    notes = learn.compiler.report.background
    assert re.match(rf"compiled at once, in the fit's path at epoch 0, batch {at}: inductor's cache has this model state's code "
                    r"\(compiled in a fit's path in [\d.]+s\)", notes[0]), notes
    assert ran[0][:3] == (0, True, at), (ran[:3], notes)

@pytest.mark.slow
def test_a_tier_compiled_first_in_the_fits_path_no_faster_than_eager_meets_the_default_in_an_ab(path_tiers):
    "Not faster than the eager step: the worker compiles the default's code, and the A/B against it decides"
    path_tiers('sleepy', dict(backend=sleepy))
    eager, _ = _fit(False)
    learn, ran = _fit(backend='aot_eager')
    notes = learn.compiler.report.background
    assert notes[0].startswith("compiled in the fit's path at epoch 0") and learn.compiler.aside.worker.jobs == 1, notes
    assert any(re.search(r"^tier sleepy not kept: [\d.]+ ms a step against [\d.]+ ms for the default, alternating on the fit's "
                         r"batches; its graphs were dropped$", n) for n in notes), notes
    assert_fit_close(eager.model, learn.model)

@pytest.mark.slow
def test_a_tier_compiled_first_starts_warm_in_a_later_fit(first_tiers, monkeypatch):
    "A new Learner of the same model (a notebook run again) runs the tier from its probe's end, compiled at once, with no worker"
    first_tiers('plain', dict(backend='aot_eager'))
    monkeypatch.setattr(life, 'warm_cost', lambda rec, default_s: 1e-9) # Any fit pays back a warm compile
    _fit(epochs=2, backend=sleepy) # Records both codes: the tier's, compiled first, and the default's
    learn, ran = _fit(epochs=2, backend=sleepy)
    notes, at = learn.compiler.report.background, VERDICT
    assert re.match(rf"compiled at once, in the fit's path at epoch 0, batch {at}: inductor's cache has this model state's code", notes[0]), notes
    assert ran[0][:3] == (0, True, at) and learn.compiler.aside.worker.jobs == 0, (ran[:3], notes)
    # The first fit's A/B kept the tier, 100 ms a step faster than the default's code: kept again, no A/B, no default's code
    took = next(n for n in notes if n.startswith('tier plain took over'))
    kept = re.search(r"; kept without an A/B, as an earlier fit of this state on this kind of device found it faster: ([\d.]+) ms a "
                     r"step against ([\d.]+) ms for the default$", took)
    assert kept and float(kept[2]) - float(kept[1]) > 50, notes
    assert len(ran) == 2*len(learn.dls.train) - at, ran # Every training batch from the hand-over on: none the default's

@pytest.mark.slow
def test_a_kept_tier_that_fails_in_a_later_fit_is_no_longer_kept(first_tiers, monkeypatch):
    "A tier an earlier fit kept raises in the next fit's path: the default trains on, and no later fit keeps the tier at once"
    first_tiers('flaky', dict(backend=flaky))
    eager, _ = _fit(False, epochs=2)
    learn, _ = _fit(epochs=2, backend=sleepy) # The A/B keeps the tier over the default's slower code
    record = next(s.tier.record for s in learn.compiler.aside.states.values() if s.tier is not None and s.tier.kept)
    assert learn.compiler.aside.warm_starts.was_kept(record), "\n".join(learn.compiler.report.background)
    monkeypatch.setenv('FXC_TIER_FAILS', '1')
    for l in (eager, learn): l.fit(1, 3e-3)
    notes = learn.compiler.report.background
    assert notes[-1] == "tier flaky failed in the fit's path (RuntimeError: the tier fails now); the default tier trains on", notes
    assert learn.compiler.aside.warm_starts.was_kept(record) is None
    assert_fit_close(eager.model, learn.model)

@pytest.mark.slow
def test_a_tier_compiled_first_runs_on_in_the_next_fit_until_its_ab(first_tiers):
    "A fit that ends before the default's code compiled for the A/B: the next fit of the state runs the tier from its first batch"
    first_tiers('plain', dict(backend='aot_eager'))
    learn, ran = _fit(epochs=1, wait=False, backend=slow_to_compile) # The default's code takes the worker a minute
    ended = "and the fit ended before the default's code compiled for the A/B"
    assert ran and ran[0][:3] == (0, True, VERDICT + 1) and ended in learn.compiler.report.background[-1], ran
    seen = learn.cbs.filter(lambda c: isinstance(c, TierBatches))[0]
    seen.ran = []
    learn.fit(1, 3e-3)
    assert [it for _,_,it,_ in seen.ran] == list(range(len(learn.dls.train))), seen.ran # Never the default's code, uncompiled
    assert learn.compiler.report.background[-1].startswith("tier plain ran") and ended in learn.compiler.report.background[-1]

@pytest.mark.slow
def test_a_tier_compiled_first_that_fails_in_the_worker_leaves_the_default_to_take_over(first_tiers):
    first_tiers('refused', dict(backend=refused))
    eager, _ = _fit(False, epochs=2)
    learn, ran = _fit(epochs=2, backend='aot_eager')
    notes = learn.compiler.report.background
    assert re.search(r"^the faster tier compiled first in the worker process failed after [\d.]+s \(.*this tier has no kernels for the "
                     r"model.*\); the default's code compiles next, where the fit's rest pays it back$", notes[0]), notes
    assert "the compiled code took over" in notes[1] and ran == [], notes # The default's code, and no tier
    assert learn.compiler.report.graphs >= 1
    assert_fit_close(eager.model, learn.model)

def test_an_explicit_mode_or_dynamic_shapes_try_no_tier():
    settings = lambda **kw: {'backend': 'inductor', 'mode': None, 'options': None, 'dynamic': False, **kw}
    assert why_no_tiers(settings()) is None
    assert why_no_tiers(settings(mode='reduce-overhead')) == '' # The user's choice, kept exactly, without a word
    assert why_no_tiers(settings(options={'max_autotune': True})) == ''
    assert why_no_tiers(settings(dynamic=True)).text.startswith("no faster tier with `dynamic=True`")
    assert why_no_tiers(settings(backend='aot_eager')) == '' # A backend without inductor's modes: nothing to climb
    t = Tiers(settings(mode='default'))
    t.start(BackgroundCompile(settings(mode='default')), torch.device('cuda'))
    assert t.aside is None and t.notes == []

def test_the_tier_policy_follows_the_measured_step():
    assert pick_tier(0.3) == 'reduce-overhead' # The GPU idle most of the step: CUDA graphs save more than autotuned kernels
    assert pick_tier(0.9) == 'reduce-overhead' and pick_tier(0.97) == 'max-autotune-no-cudagraphs'
    assert pick_tier(None) is None
    # Compiled first: CUDA graphs, where their expected saving over the batches left pays back the 6 s of trying them. The
    # GPU busy 80% of a 14 ms eager step: its kernels compiled take 7.3 ms, so CUDA graphs save 6.7 ms a step
    assert first_tier(0.8, step_s=0.014, batches=1000, cost_s=6.) == 'reduce-overhead' # 6.7 s
    assert first_tier(0.8, step_s=0.014, batches=800, cost_s=6.) is None # 5.4 s
    # The GPU busy throughout: CUDA graphs would save what the default's code saves, and no A/B could keep them over it
    assert first_tier(0.98, step_s=0.014, batches=10**6, cost_s=6.) is None and first_tier(None, 0.014, 3000, 6.) is None
    assert cudagraphs_fit(3 << 30, 2 << 30) and not cudagraphs_fit(2 << 30, 2 << 30)
    assert faster([9., 9.5, 9.], [10., 10., 10.]) and not faster([9.8, 9.9, 9.8], [10., 10., 10.])
    # A worker's hand-over, its start-up and the compile after it, beside steps 1.3x slower, against standing still for
    # the compile: the more the GPU idles, the more the wait for the worker costs
    assert first_in_path(0.1, compile_s=20., warm_s=5.) and first_in_path(0.6, compile_s=20., warm_s=5.)
    assert first_in_path(0.95, compile_s=20., warm_s=5.) and not first_in_path(0.95, compile_s=30., warm_s=5.) # 23.6 s, 28.6 s
    # A longer compile makes the worker's wait as much longer: a step whose GPU idles most of it still compiles in the path
    assert first_in_path(0.1, compile_s=45., warm_s=5.) and not first_in_path(1., compile_s=45., warm_s=5.) # 62 s, 35 s
    assert not first_in_path(None, compile_s=1., warm_s=5.) # Unmeasured: the worker, which never stops the fit

def test_trying_a_tier_costs_its_warm_compile_and_its_ab_as_this_machine_recorded_them(tmp_path, monkeypatch):
    "A tier's warm compile at its switch batch, as recorded, else a share of the model's cold compile; then each A/B batch of the default, slower by the tier's saving"
    from fastxtend_compile.payoff import TIER_COMPILE_S, WARM_SHARE
    from fastxtend_compile.state import state_key
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    model, aside, t = nn.Linear(2, 2), BackgroundCompile({'backend': 'inductor'}), Tiers({'backend': 'inductor'})
    t.aside, aside.tiers, ab = aside, t, Tiers.ab_batches
    st = aside.state(state_key(model, (torch.randn(4, 2),), True), model)
    cost = lambda: aside.facts(st, None, model).try_cost_s('reduce-overhead', 0.01)
    assert cost() == pytest.approx(WARM_SHARE*TIER_COMPILE_S + ab*0.01) # Nothing recorded: the prior's cold compile
    aside.warm_starts.path(st.record, 10.) # The default's code compiled in a fit's path in 10 s
    assert cost() == pytest.approx(WARM_SHARE*10. + ab*0.01)
    aside.warm_starts.warmed(t.record(model, st, 'reduce-overhead'), 0.8) # A fit compiled the tier warm in 0.8 s
    assert cost() == pytest.approx(0.8 + ab*0.01)
    # One move asks of the tier's record several times (its try cost, cold and warm compile, whether it is cached): read once
    f, reads, get = aside.facts(st, None, model), [], aside.warm_starts.get
    aside.warm_starts.get = lambda record: reads.append(record) or get(record)
    asked = f.try_cost_s('reduce-overhead', 0.01), f.tier_compile_s('reduce-overhead'), f.tier_warm_s('reduce-overhead'), f.tier_cached('reduce-overhead')
    assert asked == (pytest.approx(0.8 + ab*0.01), 10., 0.8, True) and reads.count(t.record(model, st, 'reduce-overhead')) == 1
    monkeypatch.setattr(Tiers, 'try_cost_s', 6.) # Where a fit sets it
    assert cost() == 6.

def test_a_tier_runs_training_calls_alone_and_drops_whole():
    "The policy's tier runs calls with gradients in training mode; evaluation keeps the model's own compiled function; dropped, its functions go and the batch runs the model's own"
    from torch import nn
    from fastxtend_compile.core import compile_model, EagerPolicy, compile_settings
    set_seed(0)
    graphs = [] # The graphs the tier's backend compiled, by whether the model trained
    def tier_backend(gm, example_inputs):
        graphs.append(model.training)
        return gm
    model, policy = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), EagerPolicy()
    compile_model(model, policy=policy, backend='aot_eager')
    call, x = compiled_call(model), torch.randn(3, 4)
    policy.run_tier('plain', dict(backend=tier_backend))
    out = model(x)
    model.eval()
    with torch.no_grad(): ev = model(x)
    assert graphs == [True] # The training call alone ran the tier
    assert [k for k in call.entries if 'tier' in k] == [(call.trains, 'tier', 'plain')]
    torch.testing.assert_close(ev, model._call_impl(x))
    torch.testing.assert_close(out, model.train()._call_impl(x))
    t = Tiers(compile_settings(backend='aot_eager'), policy=policy)
    t.start(None, torch.device('cpu'))
    t.drop('plain', model) # As a tier that raised on another rank is dropped at the ranks' agreement, after this batch chose it
    assert [k for k in call.entries if 'tier' in k] == [] and policy.tier is None
    torch.testing.assert_close(model.train()(x), out)

def test_under_ddp_a_tier_compiled_first_runs_on_every_rank_only_where_its_cuda_graphs_fit_every_ranks_gpu():
    "Rank 0's choice, offered at an agreement: a rank whose GPU is too full leaves every rank on the default's code first"
    from fastxtend_compile.core import compile_settings
    from fastxtend_compile.state import ModelState, Stage
    t, aside, gb = Tiers(compile_settings()), BackgroundCompile(compile_settings()), 2**30
    t.aside, aside.tiers = aside, t
    offer = dict(tier='reduce-overhead', path=True, why=None, step_bytes=2*gb)
    st = ModelState(None, 'record')
    run = st.tier # As rank 0 picked it
    run.tier, run.settings, run.record, run.path, run.step_bytes = 'reduce-overhead', {'mode': 'reduce-overhead'}, 'tier-record', True, 2*gb
    run.first = run.picked = True
    assert t.offer(st) == offer
    aside.act(st, 'offered', None, None, offer=offer, frees=[16*gb, int(2.5*gb)])
    assert [n.text for n in aside.take_notes()] == [
        "no tier compiled first: CUDA graphs (reduce-overhead), about 2.0 GB a step, don't fit with room to spare in the 2.5 GB "
        "free on the fullest rank's GPU; the default's code goes first"]
    assert st.first is None and not st.tier.path and not st.tier.first and st.stage is Stage.PROBING and t.offer(st) is None

def test_gradients_of_their_own_are_given_where_cuda_graphs_run_and_again_after_an_unfreeze():
    "One part gives the parameters gradients of their own, for CUDA graphs: never off them, once a fit, again where parameters unfroze"
    from fastxtend_compile.core import compile_settings
    from fastai.test_utils import synth_learner
    learn = synth_learner()
    learn.create_opt()
    ps = list(learn.model.parameters())
    ps[1].requires_grad_(False)
    cuda = torch.device('cuda') # Only the device's type is read: nothing runs on it
    t = Tiers(compile_settings())
    t.start(None, cuda)
    t.own_gradients(learn.opt) # The model's own mode records no CUDA graphs
    t.own_gradients(learn.opt, 'max-autotune-no-cudagraphs')
    assert all(p.grad is None for p in ps) and not t.graphs_now()
    t.own_gradients(learn.opt, 'reduce-overhead') # A tier's first CUDA graphs
    assert [p.grad is not None for p in ps] == [True, False] and not ps[0].grad.any()
    ps[1].requires_grad_(True) # Unfrozen during the fit
    t.own_gradients(learn.opt)
    assert ps[1].grad is not None and not ps[1].grad.any()
    for p in ps: p.grad = None
    t.start(None, cuda) # The next fit: given afresh at its first CUDA graphs
    t.own_gradients(learn.opt)
    assert all(p.grad is None for p in ps)
    graphs = Tiers(compile_settings(mode='reduce-overhead'))
    graphs.start(None, cuda) # The model's own mode records CUDA graphs: from the fit's start, every batch
    graphs.own_gradients(learn.opt)
    assert all(p.grad is not None for p in ps) and graphs.graphs_now()
    graphs.start(None, torch.device('cpu')) # No CUDA graphs off a GPU
    assert not graphs.graphs_now()
