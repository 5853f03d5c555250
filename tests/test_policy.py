"The eager-or-compiled decision: one `EagerPolicy`, told about each batch by `CompilerCallback`, asked by every compiled call"
from types import SimpleNamespace
import pickle, time
import torch
from torch import nn
from fastxtend_compile import *
from fastxtend_compile.core import EagerPolicy
from fastxtend_compile.internals import graphs_compiled, compiled_call

def batch(training=True, iter=0, n_iter=10, model=None, epoch=0, n_epoch=1):
    "What the policy reads of a Learner at `before_batch`"
    return SimpleNamespace(training=training, iter=iter, n_iter=n_iter, model=model or nn.Linear(2, 2), xb=(), epoch=epoch, n_epoch=n_epoch)

class Aside:
    "A compile outside the fit's path whose code is ready once `ready` is set; evaluation waits for it too with `evaluation`"
    def __init__(self, evaluation=False, probing=False):
        self.ready, self.evaluation, self.asked, self.probing, self.probes = False, evaluation, [], probing, []
    def runs_eagerly(self, learn, key, model):
        self.asked.append(learn.training)
        return (learn.training or self.evaluation) and not self.ready
    def agree(self, learn, key, model): pass # One process: no ranks to agree with
    def probed(self, seconds): self.probes.append(seconds)
    def eval_batch(self, key, model, compiled): pass # Evaluation batches are not timed here

def validation(p, n_iter=4, **kwargs):
    "Run a training batch, then a validation of `n_iter` batches; `p`'s eager and timed decision for each validation batch"
    p.start_batch(batch(**kwargs)); p.end_batch(True)
    res = []
    for i in range(n_iter):
        with torch.no_grad(): p.start_batch(batch(training=False, iter=i, n_iter=n_iter, **kwargs))
        res.append((p.eager, p.valid_eager, p.timed))
        p.end_batch(False)
    return res

def test_training_batches_run_eagerly_only_to_measure_the_eager_step():
    p = EagerPolicy(compile_valid=False)
    p.start_fit()
    p.start_batch(batch())
    assert not p.eager and not p.one_off
    p.end_batch(True)
    p.start_batch(batch(), measure=True)
    assert p.eager and p.measuring and not p.valid_eager
    p.end_batch(True)
    assert not p.eager and p.trained
    # Compiled autograd runs the backward (DDP's all-reduces in it): training never runs eagerly, and its last batch is no one-off
    p.start_batch(batch(iter=9), measure=True, whole_backward=True)
    assert not p.eager and not p.one_off

def test_a_fits_validation_compiles_where_the_fits_validation_batches_left_pay_back():
    p, asked = EagerPolicy(compile_valid=False), []
    p.start_fit(pays=lambda n, beside_s=None: asked.append(n) or n >= 12)
    # 4 validation batches an epoch of 4: 16, 12, 8 and 4 left. Judged at each validation's first batch, for all of it
    runs = [validation(p, epoch=e, n_epoch=4) for e in range(4)]
    assert asked == [16, 12, 8, 4]
    compiled, eager = [(False, False, True)]*4, [(True, True, True)]*4 # Eager ones are timed: the report counts them
    assert runs == [compiled, compiled, eager, eager] and not p.evaluating and not p.eager_eval and p.eager_valid == 8 # Counted for the report
    p.stop()
    p.start_fit(pays=None) # Nothing measured: eager
    assert validation(p) == eager
    p.stop()
    p.compile_valid, asked[:] = True, [] # Always compiled, whatever its batches pay
    p.start_fit(pays=lambda n, beside_s=None: asked.append(n) or False)
    assert validation(p, epoch=3, n_epoch=4) == compiled and asked == []

def test_a_fits_validation_runs_its_graph_where_it_is_compiled_already():
    torch.manual_seed(0)
    model, p = nn.Linear(4, 2), EagerPolicy(compile_valid=False)
    p.watch(compile_model(model, policy=p, backend='aot_eager'))
    p.start_fit(pays=lambda n, beside_s=None: False)
    p.start_batch(batch(model=model)); p.end_batch(True)
    g, x = graphs_compiled(), torch.randn(8, 4)
    model.eval()
    with torch.no_grad(): # Its batches don't pay back an evaluation graph: eager, compiling nothing
        p.start_batch(batch(training=False, model=model))
        torch.testing.assert_close(model(x), x @ model.weight.T + model.bias)
        p.end_batch(False)
    assert graphs_compiled() == g
    p.stop()
    with torch.no_grad(): model(x) # Its graph, compiled outside the fit
    assert graphs_compiled() == g + 1
    aside, asked = Aside(evaluation=True), []
    p.start_fit(aside, pays=lambda n, beside_s=None: asked.append(n) or False)
    assert validation(p, model=model) == [(False, False, True)]*4 # Compiled, whatever its batches pay...
    assert asked == [] and aside.asked == [True] # ...with no compile outside the fit's path to wait for

def test_a_fits_validation_worth_compiling_waits_for_the_compile_outside_the_fits_path():
    # The last batch, a one-off that runs eagerly whatever is compiled, asks nothing and isn't compiled outside the fit's path
    waits, eager = [(True, False, False)]*3 + [(False, False, True)], [(True, True, True)]*4
    for compile_valid, pays, asked, runs in ((False, True, [True] + [False]*3, waits), (True, False, [True] + [False]*3, waits),
                                             (False, False, [True], eager)):
        p, aside = EagerPolicy(compile_valid=compile_valid), Aside(evaluation=True)
        p.start_fit(aside, pays=lambda n, beside_s=None: pays)
        # Worth compiling: each batch asks the worker, and waits eagerly, untimed, until its code is ready; else it runs eagerly
        assert validation(p) == runs and aside.asked == asked
        aside.ready = True
        assert validation(p) == (eager if runs == eager else [(False, False, True)]*4)

def test_validations_after_a_wait_are_those_an_epoch_apart_from_this_one_on():
    from fastxtend_compile.payoff import validations_after
    assert validations_after(6, 0., None) == 6 # Nothing to wait for: all of them
    assert validations_after(6, 35., 10.) == 2 # This one and the next three come before the hand-over
    assert validations_after(6, 30., 10.) == 3 # One exactly at the hand-over runs its code
    assert validations_after(3, 35., 10.) == 0
    assert validations_after(6, 35., None) == 0 # No epoch timed: none counted

class ColdAside(Aside):
    "An `Aside` that judges evaluation: a worker would compile a state cold (`cold_wait`), or began to (`started`)"
    def __init__(self, cold=True):
        super().__init__(evaluation=True)
        self.is_cold, self.began = cold, False
    def started(self, key): return self.began
    def cold_wait(self, key, model): return 35. if self.is_cold else None # A worker's hand-over, 35s after its job
    def pays_eval(self, key, model, batches, within=True): return None # No fit timed its batches

def test_a_fits_validation_compiled_by_the_worker_counts_the_batches_after_its_hand_over_and_keeps_a_compile_begun():
    def first_validation(p, epoch_s):
        "Epoch 0 of 6, 4 validation batches an epoch, started `epoch_s` before the validation's first batch, as fastai's `Recorder` timed it"
        p.start_batch(batch(n_epoch=6)); p.end_batch(True)
        learn = batch(training=False, n_iter=4, n_epoch=6)
        learn.recorder = SimpleNamespace(start_epoch=time.time() - epoch_s)
        p.start_batch(learn, key='valid')
        return p.valid_eager
    # Cold, the worker hands over 35s from now: with 10s epochs, 2 of the 6 validations run its code, 8 batches, judged with
    # the 35s the worker runs beside the fit; in inductor's cache already, all 24, compiled in the fit's path
    for cold, needed, asked, eager in ((True, 8, [(8, 35.)], False), (True, 9, [(8, 35.)], True), (False, 24, [(24, None)], False)):
        p, aside, seen = EagerPolicy(compile_valid=False), ColdAside(cold), []
        p.start_fit(aside, pays=lambda n, beside_s=None: seen.append((n, beside_s)) or n >= needed)
        assert first_validation(p, 10.) == eager and seen == asked
        assert p.valid_wait_s == (35. if eager else None) # The worker's wait weighed in the verdict, for the report to say
        assert aside.asked == [True] + ([] if eager else [False]) # Worth it: the worker is asked about it too
    p, aside, seen = EagerPolicy(compile_valid=False), ColdAside(), []
    p.start_fit(aside, pays=lambda n, beside_s=None: seen.append(n) or False)
    aside.began = True # An earlier validation's compile began: this one hands over once its code is ready, whatever is left
    assert not first_validation(p, 10.) and seen == [] and aside.asked == [True, False]

class TimedAside(ColdAside):
    "A `ColdAside` whose evaluation state's batches a fit timed, eager and compiled: they say `paid`"
    def __init__(self, paid):
        super().__init__(cold=False)
        self.paid, self.judged, self.timed, self.ready = paid, [], [], True # Its code runs, once judged worth it
    def pays_eval(self, key, model, batches, within=True): return self.judged.append((batches, within)) or self.paid
    def eval_batch(self, key, model, compiled): self.timed.append(compiled)

def test_a_fits_validation_whose_batches_were_timed_is_judged_by_them_and_each_batch_is_timed_as_it_runs():
    for paid, eager, pays_asked in ((True, False, []), (False, True, []), (None, True, [24])):
        p, aside, asked = EagerPolicy(compile_valid=False), TimedAside(paid), []
        p.start_fit(aside, pays=lambda n, beside_s=None: asked.append(n) or False)
        p.start_batch(batch(n_epoch=6), key='train'); p.end_batch(True)
        with torch.no_grad(): p.start_batch(batch(training=False, n_iter=4, n_epoch=6), key='valid')
        # 4 batches in each of the 6 validations left; the training steps' payoff is asked only where no fit timed them
        assert (p.valid_eager, aside.judged, asked) == (eager, [(24, True)], pays_asked), paid
        assert p.eager_valid == (paid is None) # Run eagerly by their own times: not "too few to pay back" by the training step's
        assert aside.timed == [None, not eager] # A training batch, then a validation batch, compiled or eager

def test_an_evaluation_outside_a_fit_whose_batches_were_timed_is_judged_by_them_and_not_counted_as_too_few():
    for paid, eager, pays_asked, counted in ((True, False, [], 0), (False, True, [], 0), (None, True, [10], 2)):
        p, aside, asked = EagerPolicy(compile_valid=False), TimedAside(paid), []
        p.start_fit(aside, pays=lambda n, beside_s=None: asked.append(n) or False)
        for i in range(2):
            with torch.no_grad(): p.start_batch(batch(training=False, iter=i, n_iter=10), key='valid')
            assert p.evaluating == p.eager == eager, paid
            p.end_batch(False)
        # Judged once, at its first batch, by its 10 batches; the training steps' payoff is asked only where no fit timed them
        assert (aside.judged, asked) == ([(10, False)], pays_asked), paid
        # Run eagerly by their own times: the report's note says so, not "too few to pay back" by the training step's saving
        assert p.eager_eval == counted, paid

def test_a_probes_eager_batch_is_timed_and_its_time_goes_to_the_probe():
    "An eager batch the compile outside the fit's path probes is the report's eager step: timed, its seconds handed back"
    p, aside = EagerPolicy(), Aside(probing=True)
    p.start_fit(aside)
    p.start_batch(batch())
    assert p.waiting and p.probing and p.timed
    p.end_batch(True, 0.25)
    assert aside.probes == [0.25] and not p.probing
    aside.probing = False # The probe is done: the batches that wait for the worker are not timed
    p.start_batch(batch())
    assert p.waiting and not p.probing and not p.timed
    p.end_batch(True, None)
    assert aside.probes == [0.25]

def test_the_last_batch_is_a_one_off_and_events_called_alone_are_not():
    p = EagerPolicy()
    p.start_batch(batch(iter=9, n_iter=10))
    assert p.one_off and not p.eager
    p.start_batch(batch(iter=8, n_iter=10))
    assert not p.one_off
    p.start_batch(SimpleNamespace(training=True, model=nn.Linear(2, 2), xb=())) # No batch loop: no `iter`, no `n_iter`
    assert not p.one_off

def test_batches_wait_eagerly_for_a_compile_outside_the_fits_path():
    p, aside = EagerPolicy(), Aside()
    p.start_fit(aside)
    p.start_batch(batch())
    assert p.waiting and p.eager
    p.end_batch(True)
    aside.ready = True
    p.start_batch(batch())
    assert not p.waiting and not p.eager and aside.asked == [True, True]
    p.stop()
    p.start_batch(batch())
    assert len(aside.asked) == 2 # The fit ended: its compile outside the path is no longer asked

def test_evaluation_outside_a_fit_compiles_only_where_its_batches_pay_back():
    torch.manual_seed(0)
    model, p = nn.Linear(4, 2), EagerPolicy(compile_valid=False)
    p.watch(compile_model(model, policy=p, backend='aot_eager'))
    asked = []
    def pays(n, beside_s=None): return asked.append(n) or n >= 100
    # Nothing measured (`pays` None), too few batches to pay, enough: decided at the first batch, for the whole evaluation
    for n_iter, judge, eager in ((10, None, True), (10, pays, True), (100, pays, False)):
        p.start_fit(Aside(), pays=judge)
        for i in range(2):
            with torch.no_grad(): p.start_batch(batch(training=False, iter=i, n_iter=n_iter))
            assert p.evaluating == p.eager == eager and p.timed == (not eager)
            p.end_batch(False)
        assert p.eager_eval == 2*eager
        p.stop()
    assert asked == [10, 100]
    p.compile_valid = True # Every evaluation compiles
    p.start_fit(pays=None)
    with torch.no_grad(): p.start_batch(batch(training=False))
    assert not p.eager
    p.stop()
    # Its evaluation graph compiled (a no-grad call in eval mode): evaluation outside a fit runs it, whatever it pays
    p.compile_valid = False
    model.eval()
    with torch.no_grad(): model(torch.randn(8, 4))
    p.start_fit(Aside(), pays=None)
    with torch.no_grad(): p.start_batch(batch(training=False))
    assert not p.evaluating and p.eager_eval == 0

def test_lr_find_runs_eagerly_unless_its_graph_is_compiled_or_its_batches_pay_back():
    from fastai.callback.schedule import LRFinder
    torch.manual_seed(0)
    model, p = nn.Linear(4, 2), EagerPolicy()
    p.watch(compile_model(model, policy=p, backend='aot_eager'))
    finder, asked = LRFinder(num_it=50), []
    lr_batch = lambda i=0: SimpleNamespace(training=True, iter=i, n_iter=10, model=model, xb=(), cbs=[finder])
    for enough, eager in ((50, False), (51, True)):
        p.start_fit(pays=lambda n, beside_s=None: asked.append(n) or n >= enough)
        for i in range(2):
            p.start_batch(lr_batch(i), measure=True)
            assert p.evaluating == eager and p.eager and p.measuring == (not eager) and p.timed == (not eager)
            p.end_batch(True)
        assert p.eager_lr_find == 2*eager and not p.eager_eval
        p.stop()
    assert asked == [50, 50]
    p.start_fit(pays=lambda n, beside_s=None: False) # A fit of its own trains compiled
    p.start_batch(batch(model=model))
    assert not p.eager
    p.stop()
    model.train() # Its training graph compiled: `lr_find` runs it
    model(torch.randn(8, 4))
    p.start_fit(pays=lambda n, beside_s=None: False)
    p.start_batch(lr_batch())
    assert not p.evaluating and not p.eager

def test_a_shape_seen_once_runs_eagerly_and_compiles_when_seen_again():
    torch.manual_seed(0)
    model, p = nn.Linear(4, 2), EagerPolicy()
    compile_model(model, policy=p, backend='aot_eager')
    assert compiled_call(model).policy is p
    g = graphs_compiled()
    model(torch.randn(8, 4)); model(torch.randn(8, 4))
    assert graphs_compiled() == g + 1
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), x @ model.weight.T + model.bias) # A new shape, seen once: eagerly
    assert graphs_compiled() == g + 1 and compiled_call(model).eager_calls == {((True, True), ((3, 4),)): 1}
    model(x) # Seen again: compiled
    assert graphs_compiled() == g + 2

def test_every_call_of_an_eager_batch_runs_eagerly_and_the_next_batch_compiles():
    torch.manual_seed(0)
    model, p = nn.Linear(4, 2), EagerPolicy()
    compile_model(model, policy=p, backend='aot_eager')
    g, x = graphs_compiled(), torch.randn(8, 4)
    p.start_batch(batch(), measure=True)
    torch.testing.assert_close(model(x), x @ model.weight.T + model.bias)
    assert graphs_compiled() == g
    p.end_batch(True)
    model(x)
    assert graphs_compiled() == g + 1

def test_a_one_off_call_without_gradients_runs_eagerly_even_without_a_graph():
    torch.manual_seed(0)
    model, p = nn.Linear(4, 2), EagerPolicy()
    compile_model(model, policy=p, backend='aot_eager')
    g = graphs_compiled()
    p.start_batch(batch(training=False, iter=0, n_iter=1)) # `predict` on one item
    with torch.no_grad(): model(torch.randn(1, 4))
    assert graphs_compiled() == g
    p.start_batch(batch(training=True, iter=0, n_iter=1)) # A fit with one training batch an epoch compiles it
    model(torch.randn(1, 4))
    assert graphs_compiled() == g + 1

def test_dynamic_graphs_take_new_shapes():
    torch.manual_seed(0)
    model, p = nn.Linear(4, 2), EagerPolicy()
    compile_model(model, policy=p, backend='aot_eager', dynamic=True)
    for n in (8, 3, 5): model(torch.randn(n, 4))
    assert compiled_call(model).eager_calls == {}

def test_regional_blocks_share_the_callbacks_policy_which_pickles_without_its_calls():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
    cb = CompilerCallback(backend='aot_eager', regional=True, compile_valid=True)
    compile_model(model, regional=True, policy=cb.policy, backend='aot_eager')
    cb.policy.watch(model)
    calls = cb.policy.compiled_calls()
    assert len(calls) == 3 and all(c.policy is cb.policy for c in calls) and cb.compile_valid
    copy = pickle.loads(pickle.dumps(cb))
    assert copy.policy is not cb.policy and copy.policy.compiled_calls() == [] and copy.policy.compile_valid

def test_cuda_graphs_begin_one_step_a_batch_however_many_compiled_calls_it_makes(monkeypatch):
    "A regional model's blocks share a batch's step of CUDA graphs: its backward needs every block's outputs; outside a batch each call begins one"
    from fastai.learner import Learner
    from fastai.data.core import DataLoaders
    from fastai.callback.core import Callback
    from torch.utils.data import TensorDataset
    steps = []
    monkeypatch.setattr(torch.compiler, 'cudagraph_mark_step_begin', lambda: steps.append(1))
    class Steps(Callback):
        "The steps of CUDA graphs each training batch began"
        def before_fit(self): self.per_batch = []
        def before_batch(self): self.start = len(steps)
        def after_batch(self):
            if self.training: self.per_batch.append(len(steps) - self.start)
    class Block(nn.Module):
        def __init__(self): super().__init__(); self.lin = nn.Linear(8, 8)
        def forward(self, x): return x + torch.relu(self.lin(x))
    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randn(96, 1)
    dls = DataLoaders.from_dsets(TensorDataset(x, y), TensorDataset(x[:32], y[:32]), bs=16, num_workers=0, device='cpu')
    model = nn.Sequential(nn.Sequential(*[Block() for _ in range(3)]), nn.Linear(8, 1))
    learn = Learner(dls, model, loss_func=nn.MSELoss(), cbs=Steps())
    learn.compile(backend='aot_eager', mode='reduce-overhead', regional=True, background=False)
    learn.fit(1)
    assert len(learn.compiler.policy.compiled_calls()) == 3 and learn.steps.per_batch == [1] * len(dls.train)
    steps.clear()
    with torch.no_grad(): learn.model(x[:4].clone()) # No batch running: each block's call begins a step
    assert len(steps) == 3

def test_a_tiers_error_does_not_outlive_its_fit():
    "A tier that raised in a fit that then ended is not dropped again, nor reported, in the next fit"
    from fastxtend_compile.tiers import Tiers
    tiers = Tiers({'backend': 'eager'})
    p = tiers.policy
    p.run_tier('reduce-overhead', {'mode': 'reduce-overhead'})
    assert p.tier_failed('reduce-overhead', RuntimeError('no kernels')) and p.tier_error is not None
    assert p.tier is None # The call runs again with the model's own code
    tiers.stop()
    p.stop() # The callback stops both as the fit ends
    assert p.take_tier_error() is None and tiers.take_notes() == []

def test_a_models_own_bug_found_in_a_tier_is_raised_not_retried():
    "An error TorchDynamo finds in the model's own code, as it traces a tier, is the model's: the tier isn't blamed for it"
    from fastxtend_compile.internals import traced_op_error
    p = EagerPolicy()
    p.run_tier('reduce-overhead', {'mode': 'reduce-overhead'})
    assert not p.tier_failed('reduce-overhead', traced_op_error()('bad shapes')) and p.tier_error is None

def test_a_dropped_tier_leaves_the_batch_on_the_default():
    "A tier dropped while a batch had chosen it (another rank's tier raised) no longer runs; dropping another tier changes nothing"
    p = EagerPolicy()
    p.run_tier('reduce-overhead', {'mode': 'reduce-overhead'})
    p.clear_tier('max-autotune-no-cudagraphs')
    assert p.tier == ('reduce-overhead', {'mode': 'reduce-overhead'})
    p.clear_tier('reduce-overhead')
    assert p.tier is None
