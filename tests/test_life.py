"A model state's life as a table: each move of `advance`, from a stage, an event and facts, with no compile, worker or fit"
from types import SimpleNamespace
import pytest
from fastxtend_compile.life import advance, EAGER, COMPILED
from fastxtend_compile.state import Stage
from fastxtend_compile.worker import JobResult
from fastxtend_compile import background

P, J, C, D, R, S, F = Stage.PROBING, Stage.JUDGED, Stage.COMPILING, Stage.DONE, Stage.READY, Stage.SHORT, Stage.FAILED
OK, BAD = JobResult(True, took_s=20.), JobResult(False, 'no kernels', took_s=3.)

def facts(**kw):
    "A training batch of a probed state in one process: 10,000 batches of 100 ms left, nothing recorded, nothing waiting"
    return SimpleNamespace(**{**dict(training=True, handover=None, compiling=False, judges=True, evaluates=True, agrees=False, rank=0,
        leader=True, probe_all=False, probe_batches=8, seen=8, changes=1, any_ready=False, tries_tiers=False, path=False, in_cache=(None, False),
        left=10_000, probe_s=0.1, cold_cost_s=6., compile_s=20., handover_s=35., first_gone=True, has_result=True, warm_rec={}, first_busy=None, kept=False, first=False), **kw})

DDP = dict(agrees=True, evaluates=False)
WARM = ({'warm_s': 1.}, False) # Only the default's code is cached, which compiled warm in 1s

MOVES = [ # (what, stage, event, facts, the stage it moves to, its actions: each action's kind, a batch's 'eager' or 'compiled')
    ('its code runs', R, 'batch', {}, R, ['compiled']),
    ('its hand-over is this batch', R, 'batch', dict(handover='worker'), R, ['take_over', 'compiled']),
    ('a faster tier is tried', Stage.AB, 'batch', {}, Stage.AB, ['compiled']),
    ('too short for the fit', S, 'batch', {}, S, ['eager']),
    ('its compile failed', F, 'batch', {}, F, ['eager']),
    ('another state compiles', P, 'batch', dict(compiling=True), P, ['count', 'eager']),
    ('it waits for the ranks', J, 'batch', DDP, J, ['eager']),
    ('an evaluation, under DDP', P, 'batch', dict(training=False, judges=False, **DDP), P, ['note', 'eager']),
    ('rank 0 alone probes', P, 'batch', dict(judges=False, **DDP), P, ['eager']),
    ('a probe batch', P, 'batch', dict(seen=3), P, ['probe', 'eager']),
    ('states keep changing', P, 'batch', dict(seen=0, changes=16), P, ['note', 'probe', 'eager']),
    ('changing, one compiled', P, 'batch', dict(seen=0, changes=16, any_ready=True), P, ['probe', 'eager']),
    ('worth a cold compile', P, 'batch', {}, P, ['send']),
    ('every state compiles', P, 'batch', dict(probe_all=True, seen=0), P, ['send']),
    ('too short for a cold compile', P, 'batch', dict(left=2000, probe_s=0.02), S, ['idle', 'note', 'eager']),
    # CUDA graphs go first on an eager step the GPU ran half of: their expected saving (68% of it) pays where the prior's 35% doesn't
    ('worth it, as its step measured', P, 'batch', dict(left=2000, probe_s=0.02, first_busy=0.5), P, ['send']),
    # A 6-epoch transformer fit on one H100: 2,988 batches of a 14 ms eager step left, the GPU busy 81% of it. The worker's
    # code serves 1,065 of them, each expected to save 47% of the step: 7.1s, more than the worker costs the fit's path
    ('worth it, a GPU-bound step', P, 'batch', dict(left=2988, probe_s=0.014, first_busy=0.81), P, ['send']),
    ('the default cached', P, 'batch', dict(in_cache=WARM), R, ['default_first', 'idle', 'warm', 'compiled']),
    ('its tier first cached', P, 'batch', dict(in_cache=({'path_s': 30.}, True)), R, ['idle', 'warm', 'compiled']),
    ('too short even warm', P, 'batch', dict(in_cache=WARM, left=20), S, ['default_first', 'idle', 'note', 'eager']),
    ('its tier first in the path', P, 'batch', dict(path=True, left=10), R, ['idle', 'in_path', 'compiled']),
    ('worth it, under DDP', P, 'batch', DDP, J, ['eager']),
    ('an evaluation state', P, 'batch', dict(training=False, seen=0, in_cache=WARM), R, ['idle', 'warm', 'compiled']),
    ('sent', P, 'sent', {}, C, ['compiling', 'eager']),
    ('not sent', P, 'unsent', dict(error='PicklingError: no'), R, ['default_first', 'note', 'compiled']),
    ('not sent, under DDP', J, 'unsent', dict(error='PicklingError: no', **DDP), D, ['default_first', 'result', 'eager']),
    ('compiled', C, 'done', dict(res=OK), R, ['result', 'record', 'handover']),
    ('compiled, under DDP', C, 'done', dict(res=OK, **DDP), D, ['result', 'record']),
    ('failed', C, 'done', dict(res=BAD), F, ['result', 'record', 'note', 'warn']),
    ('failed, on rank 1', C, 'done', dict(res=BAD, rank=1), F, ['result', 'record', 'note']),
    ('its tier first failed: judged again', C, 'done', dict(res=BAD, first_gone=False), P, ['default_first', 'note']),
    ('the ranks: failed', D, 'agreed', dict(decision='failed', res=BAD, **DDP), F, ['note', 'warn']),
    ('the ranks: warm', J, 'agreed', dict(decision='warm', **DDP), R, ['idle', 'warm']),
    ('the ranks: ready', D, 'agreed', dict(decision='ready', **DDP), R, ['handover']),
    ('the ranks: ready, no job here', D, 'agreed', dict(decision='ready', has_result=False, **DDP), R, []),
    ('the ranks: in the path', J, 'agreed', dict(decision='path', **DDP), R, ['idle', 'in_path']),
    ('the ranks: start', J, 'agreed', dict(decision='start', worker='none', **DDP), J, ['send']),
    ('the ranks: start, its device compiles', J, 'agreed', dict(decision='start', worker='none', leader=False, **DDP), J, []),
    ('the ranks: start, compiling', J, 'agreed', dict(decision='start', worker='compiling', **DDP), J, []),
    ('the fit ended: its kept tier next', Stage.SETTLED, 'ended', dict(kept=True), Stage.SETTLED, ['end_fit']),
    ('the fit ended: its tier compiled first runs on', Stage.CHECK, 'ended', dict(first=True), Stage.WAIT, ['end_fit']),
    ('the fit ended: its tiers tried again', Stage.AB, 'ended', {}, R, ['end_fit']),
    ('the fit ended before its tier compiled first ran', R, 'ended', dict(first=True), R, ['end_fit']),
]

def note(actions): return next(a[1] for a in actions if a[0] == 'note')

def kinds(actions): return [a[1] if a[0] == 'run' else a[0] for a in actions]

@pytest.mark.parametrize('what,stage,event,given,to,acts', MOVES, ids=[m[0] for m in MOVES])
def test_each_move_of_a_model_states_life(what, stage, event, given, to, acts):
    moved, actions = advance(stage, event, facts(**given))
    assert (moved, kinds(actions)) == (to, acts)
    assert {a[0] for a in actions} - {'run', 'send'} <= set(background._ACTS) # The background compile carries out each

def test_a_batch_moves_once_and_says_how_it_runs():
    "A batch's one move, its tiers' included, ends with how the batch runs, unless it sends a job, whose move ('sent', 'unsent') then says"
    for moves, known in ((MOVES, facts), (TIER_MOVES, tier_facts)):
        for _, stage, event, given, _, _ in moves:
            _, actions = advance(stage, event, known(**given))
            if event != 'batch' or actions[-1][0] == 'send': continue
            assert [a for a in actions if a[0] == 'run'] == [actions[-1]] and actions[-1] in (EAGER, COMPILED)
    assert advance(P, 'sent', facts())[1][-1] is EAGER and advance(P, 'unsent', facts(error='e'))[1][-1] is COMPILED
    assert COMPILED is advance(R, 'batch', facts())[1][-1]

def test_the_verdicts_notes_say_what_it_weighed():
    "A state too short to pay back its compile says the batches left, their eager time, and the time that would pay"
    _, actions = advance(P, 'batch', facts(left=2000, probe_s=0.02))
    assert note(actions).text == ("trained eagerly: the fit's 2000 training batches left, about 40s eagerly, are too few to pay back a compile "
                         "(under 44s; `background=False` compiles in the fit's path)")
    _, actions = advance(P, 'batch', facts(in_cache=WARM, left=20))
    assert note(actions).text == ("trained eagerly: the fit's 20 training batches left, about 2s eagerly, are too few to pay "
                                          "back even a warm compile of 1.0s (under 3s)")
    _, actions = advance(P, 'batch', facts(left=84, probe_s=0.0065)) # Under a second of steps: not rounded to none
    assert note(actions).text.startswith("trained eagerly: the fit's 84 training batches left, about 0.55s eagerly, are too few")
    _, actions = advance(P, 'batch', facts(left=1800, probe_s=0.02, first_busy=0.82)) # CUDA graphs were picked to go first, in the worker
    assert note(actions).text.endswith("compiles in the fit's path); the eager step's measure had picked CUDA graphs to compile first (the GPU ran work 82% of it)")
    _, actions = advance(C, 'done', facts(res=BAD, first_gone=False))
    assert note(actions).kind == 'first_failed'

def test_a_fit_ends_where_the_next_starts_its_tiers():
    "One stage for the whole life: as a fit ends, a kept tier stays settled, a tier compiled first waits for its A/B, any other compiled state is ready, and the rest go"
    from fastxtend_compile.core import compile_settings
    from fastxtend_compile.state import ModelState, TierRun
    assert [s for s in Stage if not s.compiled] == [P, J, C, D, S, F]
    aside = background.BackgroundCompile(compile_settings())
    def state(stage, kept=None, first=False):
        st = aside.states[len(aside.states)] = ModelState(None, f'record{len(aside.states)}')
        st.stage, st.tier, st.probe = stage, TierRun(kept), 'probe'
        st.tier.first, st.tier.fallback, st.tier.n = first, 'job', 5
        return st
    kept, first, ab, timed, probing = (state(Stage.SETTLED, kept='reduce-overhead'), state(Stage.WARMUP, first=True), state(Stage.AB),
                                       state(Stage.TIME), state(P))
    aside.stop()
    assert list(aside.states.values()) == [kept, first, ab, timed] # The state still probed is met afresh
    def ended(st): return st.stage, st.tier.tier, st.tier.kept, st.tier.first, st.tier.fallback, st.tier.n, st.probe
    assert ended(kept) == (Stage.SETTLED, 'reduce-overhead', True, False, None, 0, None)
    assert ended(first) == (Stage.WAIT, None, False, True, None, 0, None) # Its A/B's job sent afresh
    assert ended(ab) == ended(timed) == (R, None, False, False, None, 0, None) # Its tiers tried again

# A state's way through the faster tiers: its training batches' moves once the fit tries tiers, from its probe's end on, and its jobs' 'sent' and 'unsent'
from fastxtend_compile import tiers
from fastxtend_compile.payoff import pick_tier, first_tier, first_in_path
SE, TI, PR, TC, WU, CK, WA, AB, AG, SD = (Stage.SETTLE, Stage.TIME, Stage.PROFILE, Stage.TIER_COMPILING, Stage.WARMUP, Stage.CHECK,
                                          Stage.WAIT, Stage.AB, Stage.AGREE, Stage.SETTLED)

def tier_facts(**kw):
    "A training batch of a state in one process that tries tiers, on a GPU with room: its default's steps 100 ms, its eager step 20 ms, 10,000 batches left"
    return facts(**{**dict(tries_tiers=True, n=0, name='reduce-overhead', kept=False, first=False, first_gone=True, path=False, dropped=False,
        base=[0.1]*8, tier_times=[], ab_base=[], settle_batches=4, time_batches=8, warmup_batches=3, ab_batches=8, try_cost_s=lambda name, saving_s: 2.,
        profiled=None, free=80*2**30, agrees=False, agreed=None, leader=True, tier_for=pick_tier, graphs=lambda name: name == 'reduce-overhead',
        tier_cached=lambda name: False, left_after=lambda wait_s, step_s: 10_000, compile_s=20., tier_res=None, has_job=False, polled=None, was_kept=None,
        probe_s=0.02, fallback=False, default_cached=True, fallback_res=None, picked=False, seen=8, probe_batches=8,
        first_batches=3, first_for=first_tier, first_in_path=first_in_path, tier_compile_s=lambda name: 20., tier_warm_s=lambda name: 5., start_s=15.), **kw})

FIRST = dict(first=True, first_gone=False) # A tier compiled first, before the default's code
LAUNCH = dict(profiled=(0.03, 2**30)) # The GPU ran work 30% of the default's step: CUDA graphs pay
TOGETHER = dict(agrees=True)
PICKED = ('pick', dict(busy=0.3, step_s=0.1, step_bytes=0, free=None))
FAILED_ELSEWHERE = ('compile', dict(ok=False, error='out of memory', oom=True, took_s=5.))
KEEP = ['kept', 'run_tier', 'record_kept', 'took_over']

EAGER_20MS = dict(probe_s=0.02) # The probe timed a 20 ms eager step
GB = 2**30
OFFER = dict(tier='reduce-overhead', path=True, why=dict(busy=0.3), step_bytes=2*GB) # Rank 0's tier compiled first

TIER_MOVES = [ # (what, stage, event, facts, the stage it moves to, its actions' kinds)
    # Its probe's end: the eager step's GPU work measured, the tier compiled first picked (the verdict at the next batch), or
    # none, and the verdict now
    ('its probe under way', P, 'batch', dict(seen=3), P, ['probe']),
    ("the eager step's GPU work measured", P, 'batch', {}, P, ['measure']),
    ('too few batches left for any tier first: not measured', P, 'batch', dict(left_after=lambda wait_s, step_s: 99), P, ['picked', 'send']),
    ('unmeasurable: the default first', P, 'batch', dict(profiled=False), P, ['picked', 'send']),
    ('launch-bound: CUDA graphs first', P, 'batch', dict(profiled=(0.006, 2**30), **EAGER_20MS), P, ['picked', 'first']),
    ('GPU-bound: the default first, and why', P, 'batch', dict(profiled=(0.02, 0), **EAGER_20MS), P, ['picked', 'note', 'send']),
    ('no room for the graphs first', P, 'batch', dict(profiled=(0.006, 2**30), free=2**20, **EAGER_20MS), P, ['picked', 'send']),
    ('picked: the verdict', P, 'batch', dict(picked=True), P, ['send']),
    ('too short, its tier first not picked', P, 'batch', dict(left=20, left_after=lambda wait_s, step_s: 20), S, ['picked', 'idle', 'note']),
    # Its code runs from the verdict's batch on: its way through the tiers starts at that batch
    ('its tier first, in the path: run at once', P, 'batch', dict(picked=True, path=True, **FIRST), WU, ['idle', 'in_path', 'result_first', 'run_tier', 'time']),
    ("only the default's code cached: it goes first", P, 'batch', dict(picked=True, in_cache=({'warm_s': 1.}, False), **FIRST), SE,
     ['default_first', 'idle', 'warm', 'fresh', 'tick']),
    ("not sent: the default's code compiles here", P, 'unsent', dict(error='PicklingError: no'), SE, ['default_first', 'note', 'tick', 'run']),
    ('a tier that raised before the code ran', R, 'batch', dict(dropped=True), SD, []),
    ('the default goes first', R, 'batch', {}, SE, ['tick']),
    ('a tier compiled first takes over', R, 'batch', FIRST, WU, ['result_first', 'run_tier', 'time']),
    ('the default cached instead of the tier', R, 'batch', dict(first=True), SE, ['fresh', 'tick']),
    ('its caches warm', SE, 'batch', dict(n=1), SE, ['tick']),
    ('warm: its step timed next', SE, 'batch', dict(n=3), TI, []),
    ('its step timed', TI, 'batch', dict(base=[0.1]*3), TI, ['time']),
    ('timed: its GPU work measured', TI, 'batch', {}, PR, ['measure']),
    ('its GPU work measured', PR, 'batch', {}, PR, ['measure']),
    ('launch-bound: CUDA graphs in the worker', PR, 'batch', LAUNCH, SD, ['tier', 'send']),
    ('their code cached', PR, 'batch', dict(tier_cached=lambda name: True, **LAUNCH), WU, ['tier', 'run_tier', 'time']),
    ('another rank compiles for the device', PR, 'batch', dict(leader=False, **LAUNCH), TC, ['tier']),
    ('no room for the graphs', PR, 'batch', dict(free=2**20, **LAUNCH), SD, ['note']),
    ('too few batches left', PR, 'batch', dict(left_after=lambda wait_s, step_s: 20, **LAUNCH), SD, ['note']),
    ('unmeasurable: no tier', PR, 'batch', dict(profiled=False), SD, ['note']),
    ('under DDP, its vote', PR, 'batch', dict(**LAUNCH, **TOGETHER), AG, ['vote']),
    ('under DDP, the ranks undecided', AG, 'batch', TOGETHER, AG, []),
    ('undecided, the tier compiled first runs', AG, 'batch', dict(**FIRST, **TOGETHER), AG, ['run_tier']),
    ('under DDP, decided', AG, 'batch', dict(agreed=PICKED, **TOGETHER), SD, ['tier', 'send']),
    ('the tier sent', SD, 'sent', {}, TC, []),
    ('the tier not sent', SD, 'unsent', dict(error='PicklingError: no'), SD, ['note']),
    ('not sent, under DDP', SD, 'unsent', dict(error='PicklingError: no', **TOGETHER), TC, ['res']),
    ('the tier compiles', TC, 'batch', dict(has_job=True), TC, []),
    ('the tier compiled', TC, 'batch', dict(has_job=True, polled=OK), WU, ['compiled', 'run_tier', 'time']),
    ('the tier failed', TC, 'batch', dict(has_job=True, polled=BAD), SD, ['compiled', 'note']),
    ('compiled here, under DDP', TC, 'batch', dict(has_job=True, polled=OK, **TOGETHER), TC, ['compiled', 'vote']),
    ('failed on another device', TC, 'batch', dict(agreed=FAILED_ELSEWHERE, **TOGETHER), SD, ['note']),
    ('the switch batch timed', WU, 'batch', {}, WU, ['took', 'tick', 'run_tier']),
    ('warm: the A/B', WU, 'batch', dict(n=3), AB, ['run_tier', 'time', 'tick']),
    ('kept by an earlier fit', WU, 'batch', dict(n=3, was_kept=[0.05, 0.1, 'the default']), SD, ['kept', 'run_tier', 'took_over']),
    ('compiled first in the path: checked', WU, 'batch', dict(n=3, path=True, **FIRST), CK, ['run_tier', 'time']),
    ('compiled first in the worker: the A/B waits', WU, 'batch', dict(n=3, default_cached=False, **FIRST), WA, ['send']),
    ("the default's code compiles", WA, 'batch', dict(fallback=True, **FIRST), WA, ['run_tier']),
    ('it beats the eager step', CK, 'batch', dict(tier_times=[0.05]*8, probe_s=0.1, path=True, **FIRST), SD, KEEP),
    ('no faster than eager', CK, 'batch', dict(tier_times=[0.1]*8, probe_s=0.1, path=True, default_cached=False, **FIRST), WA, ['send']),
    ('the eager step unmeasured', CK, 'batch', dict(tier_times=[0.05]*8, path=True, **FIRST), AB, ['run_tier', 'time', 'tick']),
    ("the default's job sent", WA, 'sent', FIRST, WA, ['run_tier']),
    ("the default's job not sent", WA, 'unsent', dict(error='PicklingError: no', **FIRST), SD, ['kept', 'run_tier', 'note']),
    ('the default compiled: the A/B', WA, 'batch', dict(fallback=True, fallback_res=OK, **FIRST), AB, ['fallback_done', 'run_tier', 'time', 'tick']),
    ('the default failed: the tier kept alone', WA, 'batch', dict(fallback=True, fallback_res=BAD, **FIRST), SD, ['fallback_done', 'kept', 'run_tier', 'note']),
    ("the A/B: the tier's batch", AB, 'batch', dict(n=2), AB, ['run_tier', 'time', 'tick']),
    ("the A/B: the default's batch", AB, 'batch', dict(n=3), AB, ['time', 'tick']),
    ('the tier wins its A/B', AB, 'batch', dict(n=16, tier_times=[0.05]*8, ab_base=[0.1]*8), SD, KEEP),
    ('the tier loses its A/B', AB, 'batch', dict(n=16, tier_times=[0.098]*8, ab_base=[0.1]*8), SD, ['drop', 'note']),
    ("rank 0's A/B, under DDP", AB, 'batch', dict(n=16, tier_times=[0.05]*8, ab_base=[0.1]*8, **TOGETHER), AG, ['vote']),
    ('its tier kept', SD, 'batch', dict(kept=True), SD, ['run_tier']),
    # Its tier raised in a fit's path, here or on another rank: dropped, and no longer kept
    ('its tier raised', WU, 'raised', {}, SD, ['unkept']),
    ('its kept tier raised', SD, 'raised', dict(kept=True), SD, ['unkept']),
    ('its tier raised before its code ran', P, 'raised', FIRST, P, ['unkept']),
    # Under DDP, rank 0's tier compiled first, offered at an agreement: its CUDA graphs take 2 GB a step
    ('rank 0 offers a tier first: adopted', P, 'offered', dict(offer=OFFER, frees=[16*GB, 4*GB], offering=False), P, ['first']),
    ('adopted, its memory unmeasured', J, 'offered', dict(offer={**OFFER, 'step_bytes': None}, frees=[], offering=False), J, ['first']),
    ('the rank that offered it', P, 'offered', dict(offer=OFFER, frees=[16*GB, 4*GB], offering=True), P, []),
    ('no room on the fullest rank', P, 'offered', dict(offer=OFFER, frees=[16*GB, int(2.5*GB)], offering=True), P,
     ['default_first', 'fresh', 'note']),
    ('the default kept', SD, 'batch', {}, SD, []),
]

@pytest.mark.parametrize('what,stage,event,given,to,acts', TIER_MOVES, ids=[m[0] for m in TIER_MOVES])
def test_each_move_through_the_tiers(what, stage, event, given, to, acts):
    moved, actions = advance(stage, event, tier_facts(**given))
    if event == 'batch' and actions[-1][0] == 'run': # How the batch runs: its code once compiled, else eagerly
        assert actions[-1] == (COMPILED if moved.compiled else EAGER)
        actions = actions[:-1]
    assert (moved, [a[0] for a in actions]) == (to, acts)
    assert {a[0] for a in actions} - {'run', 'send'} <= set(tiers.Tiers.acts) | set(background._ACTS) # `BackgroundCompile.act` carries out each
    assert ('send',) not in [a[:1] for a in actions[:-1]] # A job's send is the move's last action: 'sent' or 'unsent' goes on
    # A vote waits for the ranks: cast only where the state stays to wait, since a new stage starts with none
    assert not any(a[0] == 'vote' for a in actions) or moved in (AG, TC)

def test_the_tiers_notes_say_what_they_weighed():
    "Why no tier, or why the tier compiled first is kept alone, in the report's words"
    def said(stage, event, **given): return next(a[1] for a in advance(stage, event, tier_facts(**given))[1] if a[0] == 'note')
    assert said(PR, 'batch', left_after=lambda wait_s, step_s: 20, **LAUNCH).text == (
        "no faster tier: reduce-overhead would save about 70.0 ms a step over the 20 training batches left once it compiled, 1.4s in all, "
        "under the 2.0s trying it costs the fit")
    assert said(PR, 'batch', free=2**20, **LAUNCH).kind == 'no_room'
    assert said(WA, 'unsent', error='PicklingError: no', **FIRST).kind == 'kept_alone'
    assert said(TC, 'batch', agreed=FAILED_ELSEWHERE, **TOGETHER).facts['res'].oom # Another device's failure, as that device had it
    assert said(P, 'offered', offer=OFFER, frees=[16*GB, int(2.5*GB)], offering=False).facts == dict(
        name='reduce-overhead', step_bytes=2*GB, free=int(2.5*GB)) # The fullest rank's GPU
    adopted = advance(J, 'offered', tier_facts(offer=OFFER, frees=[16*GB, 4*GB], offering=False))[1]
    assert adopted == (('first', 'reduce-overhead', True, dict(busy=0.3), 2*GB),) # As rank 0 set it

def test_an_eager_step_measured_says_which_tier_goes_first_and_why():
    "CUDA graphs first, in the fit's path where a worker beside the eager step would cost more; else why the default's code goes first"
    def acts(**given): return advance(P, 'batch', tier_facts(**{**EAGER_20MS, **given}))[1]
    first = next(a for a in acts(profiled=(0.006, 2**30)) if a[0] == 'first')
    assert first[1:3] == ('reduce-overhead', True) and first[4] == 2**30 and first[3]['busy'] == pytest.approx(0.3)
    assert next(a for a in acts(profiled=(0.006, 2**30), tier_cached=lambda name: True) if a[0] == 'first')[2] is False # Cached: warm, from the worker
    few = dict(left_after=lambda wait_s, step_s: 400, try_cost_s=lambda name, saving_s: 6.) # 8s of eager steps: CUDA graphs could pay back 6s, had the GPU idled
    assert [note(acts(profiled=(0.02, 0), **few)).text, note(acts(profiled=(0.01, 0), **few)).text] == [
        "no tier compiled first: the GPU ran work 100% of the eager 20.0 ms step, so CUDA graphs would save too little of it; the "
        "default's code goes first",
        "no tier compiled first: the GPU ran work 50% of the eager 20.0 ms step, so CUDA graphs would save about 13.5 ms of it, 5.4s "
        "over the 400 training batches left, under the 6.0s trying them costs the fit; the default's code goes first"]
    assert [a[0] for a in acts(left_after=lambda wait_s, step_s: 290, try_cost_s=lambda name, saving_s: 6.)] == ['picked', 'send'] # 5.8s: not measured, the verdict now

def test_cuda_graphs_compile_first_where_the_compile_this_machine_recorded_costs_the_fit_least():
    "The GPU busy 95% of a 20 ms eager step: the prior's 20 s compile stops the fit for less than a worker would cost; a recorded 40 s, more"
    def path(busy, compile_s):
        facts = tier_facts(profiled=(busy*0.02, 2**30), tier_compile_s=lambda name: compile_s, **EAGER_20MS)
        return next(a for a in advance(P, 'batch', facts)[1] if a[0] == 'first')[2]
    assert path(0.95, 20.) and not path(0.95, 40.) # Beside the worker: 35 s and 55 s to its hand-over, steps 1.3x slower
    assert path(0.3, 40.) # CUDA graphs save most of a step whose GPU idles: standing still for them costs the fit least

def test_a_tier_picked_first_is_a_fact_of_the_verdict():
    "The probe's verdict knows the GPU's share of the eager step where CUDA graphs were picked to compile first, and only there"
    from fastxtend_compile.state import ModelState
    st = ModelState(None, 'record')
    f = background._Facts(None, st, None)
    assert f.first_busy is None
    st.tier.why = dict(busy=0.82, step_s=0.02, of='eager', graphs=True, saving=0.007, first=True)
    assert f.first_busy is None # Measured, but the default's code goes first
    st.tier.settings, st.tier.record = {'mode': 'reduce-overhead'}, 'record-of-the-tier'
    assert f.first_busy == 0.82 and st.compiled_record == 'record-of-the-tier'
    st.default_first()
    assert f.first_busy is None and st.compiled_record == 'record'
