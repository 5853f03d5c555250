"What the compiler did is visible: report, warnings, explain, the crash ladder, clear errors"
import importlib.util, inspect, logging, re, shutil, pytest, torch
from functools import partial
from torch import nn
import matplotlib; matplotlib.use('Agg')
from fastai.learner import Learner
from fastai.optimizer import SGD
from fastai.test_utils import synth_learner
from fastai.data.core import DataLoaders
from fastai.data.load import DataLoader
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.core import Callback
from fastxtend_compile import *
from fastxtend_compile.report import CompileRecorder
from fastxtend_compile.core import cannot_compile_reason, EagerPolicy
from fastxtend_compile.internals import compiled_call, recompile_limit_logger, recompile_limit_hit
from conftest import two_conv_cnn, digits_dls

BACKEND = 'aot_eager'

class Toy(nn.Module):
    "The FAQ's toy example: a `print` and a data-dependent `if` in `forward`"
    def __init__(self): super().__init__(); self.a = nn.Linear(1,1)
    def forward(self, x):
        x = self.a(x)
        print("woo")
        if x.sum() < 0: x = x * -1
        return x * 2

def test_report_records_compiles_and_recompile_reasons(digits, capsys):
    # SGD's step is compiled (fastai's default `Adam` runs PyTorch's fused kernel: nothing to compile); the fit's
    # validation too, without gradients (`compile_valid=True`)
    learn = Learner(digits, two_conv_cnn(), opt_func=partial(SGD, mom=0.9)).compile(backend=BACKEND, verbose=True, compile_valid=True)
    learn.fit(1)
    r = learn.compiler.report
    assert r.graphs == 3 and r.graph_breaks == 0 and not r.fallbacks
    assert [e.frame for e in r.events if e.kind == 'compile'] == ['Sequential', 'optimizer step']
    assert r.events[0].kind == 'compile' and r.events[0].during == 'training batch 1' and r.events[0].frame == 'Sequential'
    assert [e.reason for e in r.recompiles] == ["gradients were switched on or off (validation and inference run without them)"]
    assert r.compile_seconds > 0
    out = capsys.readouterr().out # `verbose=True`: the summary after the fit
    assert re.search(r"torch.compile: 3 graph\(s\) compiled in [\d.]+s, 0 graph break\(s\), 1 recompile\(s\), 0 eager fallback\(s\)", out)
    last = len(digits.valid_ds) % 64 # The smaller last validation batch ran eagerly: no graph for a shape seen once
    assert f"ran eagerly, a shape seen once and not worth a graph: 1 validation or inference call(s) with input {last}×1×8×8" in out
    # aot_eager runs eager's kernels: any verdict, as this machine measured them
    assert re.search(r"(paid|faster, not paid back yet|did not pay): compiled step [\d.]+ ms against [\d.]+ ms eager", out)

def test_the_report_names_mixed_precision_switched_on(digits):
    learn = Learner(digits, two_conv_cnn()).compile(backend='eager')
    learn.fit(1)
    with torch.autocast('cpu', dtype=torch.bfloat16): learn.fit(1) # As fastai's `MixedPrecision` does on a GPU
    assert "mixed precision (autocast) was switched on or off" in [e.reason for e in learn.compiler.report.recompiles]

class _Record:
    "A TorchDynamo compile record, as the recorder reads one"
    __slots__ = ('co_name', 'co_filename', 'co_firstlineno', 'fail_type', 'recompile_reason', 'entire_frame_compile_time_s')
    def __init__(self, name): self.co_name, self.co_filename, self.co_firstlineno, self.fail_type, self.recompile_reason, self.entire_frame_compile_time_s = name, 'm.py', 1, None, None, 0.1

def test_a_record_reusing_a_dropped_ones_id_is_counted(monkeypatch):
    "TorchDynamo keeps its last 64 compile records: a new one that reuses the id of one it dropped is still new"
    import fastxtend_compile.report as report
    records = [_Record('old')]
    monkeypatch.setattr(report, 'compilation_metrics', lambda: list(records))
    r = CompileReport()
    recorder = report.CompileRecorder(r)
    recorder.start(None)
    records.clear() # Dropped: freed, unless the recorder holds it
    records += [_Record(f'new{i}') for i in range(3)] # Where CPython puts them: the freed record's memory, if it is free
    recorder.collect()
    recorder.stop()
    assert [e.frame for e in r.events] == [f'new{i} (m.py:1)' for i in range(3)], r.events

def test_graph_breaks_counted():
    learn = synth_learner(cbs=CompilerCallback(backend=BACKEND))
    learn.model = Toy()
    learn.fit(1)
    r = learn.compiler.report
    assert r.graph_breaks >= 2 and r.graph_breaks == sum(r.break_reasons.values())
    lines = r.summary().splitlines()
    prints = [l for l in lines if l.startswith('  graph break') and "builtin operator `print`" in l]
    assert len(prints) == 1, lines # One line per reason, with how often it broke the graph
    assert "  `DynamoExplainCallback` shows the file and line of each graph break" in lines

def test_fallback_to_eager_always_warns(monkeypatch):
    monkeypatch.setattr(EagerPolicy, 'vary_after', 99) # Sizes that keep changing would compile one dynamic graph: not here
    class Varying(DataLoader):
        "Batches of a different size each time, each size twice: a size seen again is compiled"
        def create_batches(self, samps):
            for i in [*range(2, 8)]*2: yield (torch.randn(i, 1), torch.randn(i, 1))
    dls = DataLoaders(Varying(range(6)), Varying(range(6)))
    learn = Learner(dls, nn.Linear(1,1), loss_func=nn.MSELoss()).compile(backend='eager', verbose=False)
    with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(UserWarning) as rec:
        learn.fit(1)
    msgs = [str(w.message) for w in rec if 'gave up' in str(w.message)]
    assert msgs, [str(w.message) for w in rec]
    assert re.search(r"torch.compile gave up on Linear after 2 recompiles \(recompile_limit\) and runs it eagerly from now on\. Last cause: batch size changed", msgs[0])
    assert "pass `dynamic=True` (or `drop_last=True` for a smaller last batch)" in msgs[0] and "recompile_limit" in msgs[0]
    assert learn.compiler.report.fallbacks

def test_fallback_on_a_python_value_guard_warns():
    "A float read in `forward` and changed every batch: TorchDynamo records no metric for this fallback, only a log line"
    class Scaled(nn.Module):
        def __init__(self): super().__init__(); self.lin, self.scale = nn.Linear(1,1), 0.5
        def forward(self, x): return self.lin(x) * self.scale
    class ChangeScale(Callback):
        def before_batch(self): self.learn.model.scale = float(self.iter) + 0.5
    learn = synth_learner(cbs=ChangeScale()).compile(backend='eager')
    learn.model = Scaled()
    seen = [] # What reaches the handlers of TorchDynamo's logger: its own warning, beside the library's, would
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    recompile_limit_logger.addHandler(handler)
    try:
        with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(UserWarning, match=r"torch.compile gave up on Scaled after 2 recompiles") as rec:
            learn.fit(1)
    finally: recompile_limit_logger.removeHandler(handler)
    fb = learn.compiler.report.fallbacks[0]
    assert fb.reason.startswith("a guard on the Python value `module.scale` failed") and fb.during.startswith('training batch')
    w = [w for w in rec if 'gave up' in str(w.message)]
    assert len(w) == 1 and 'dynamic=True' not in str(w[0].message) # Advice for shapes doesn't apply
    # Shown at the line of `forward` that reads the value, in place of TorchDynamo's own warning
    assert (w[0].filename, w[0].lineno) == (__file__, inspect.getsourcelines(Scaled.forward)[1])
    assert not [r for r in seen if recompile_limit_hit(r)], [r.getMessage()[:200] for r in seen]

def test_a_function_or_layer_replaced_between_fits_is_named():
    class Act(nn.Module):
        def __init__(self): super().__init__(); self.lin, self.f = nn.Linear(1,1), torch.relu
        def forward(self, x): return self.f(self.lin(x))
    learn = synth_learner().compile(backend='eager')
    learn.model = Act()
    with learn.no_bar(), learn.no_logging():
        learn.fit(1)
        learn.model.f = torch.tanh # Another function
        learn.fit(1)
        learn.model.lin = nn.Sequential(nn.Linear(1,1)) # A layer of another type
        learn.fit(1)
    reasons = [e.reason for e in learn.compiler.report.recompiles if e.during.startswith('training')]
    assert len(reasons) == 2 and reasons[0].startswith("`module.f` was replaced by another object"), reasons
    assert reasons[1] == ("`module._modules['lin']` was replaced by an object of another type (it was a Linear): the model recompiles "
                          "for each; set them before the fit"), reasons

def test_a_compile_outside_a_fit_is_named_so(digits):
    "A `get_preds` after the fit compiles for its own batch size: named an evaluation outside a fit, not the fit's validation"
    learn = Learner(digits, two_conv_cnn()).compile(backend='eager', compile_valid=True)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    r, n = learn.compiler.report, len(learn.compiler.report.events)
    assert [e.during for e in r.events] == ['training batch 1', 'validation'], r.events
    dl = digits.test_dl(digits.valid.items[:12], bs=3) # Another batch size, seen more than once: a recompile
    with learn.no_bar(): learn.get_preds(dl=dl)
    assert [(e.kind, e.during) for e in r.events[n:]] == [('recompile', 'evaluation outside a fit')], r.events

def test_long_compile_is_announced(digits, capsys):
    learn = Learner(digits, two_conv_cnn()).compile(backend=BACKEND, compile_valid=True)
    learn.compiler.compile_recorder.notice_after = 0.
    learn.fit(1)
    out = capsys.readouterr().out # Printed above fastai's progress bar, from the main thread, naming the phase
    assert re.search(r"torch.compile compiled Sequential for training batch 1 in [\d.]+s", out)
    assert re.search(r"torch.compile compiled Sequential for validation in [\d.]+s", out)

def test_batch_time_plot(digits):
    learn = Learner(digits, two_conv_cnn()).compile(backend=BACKEND)
    learn.fit(1)
    r = learn.compiler.report
    times = r.batch_times # Batches 2 to 4 ran eagerly, to measure the eager step
    assert len(r.eager_times) == 3 and len(times) == len(digits.train) - 3 and times[0][1] and not any(c for _,c in times[1:])
    ax = learn.compiler.plot_batch_times()
    assert len(ax.lines[0].get_ydata()) == len(times) and ax.get_yscale() == 'log'
    assert [l.get_label().split()[0] for l in ax.lines[1:]] == ['median', 'eager'] # The compiled and eager steps
    assert ax.collections # the compile spike is marked

def test_explain_toy_example_and_leaves_learner_untouched(capsys):
    learn = synth_learner(cbs=DynamoExplainCallback())
    learn.model = Toy()
    learn.model.a.register_buffer('counter', torch.zeros(1))
    w = [p.clone() for p in learn.model.parameters()]
    torch.manual_seed(1); state = torch.get_rng_state()
    learn.fit(1)
    assert torch.equal(torch.get_rng_state(), state)
    out = learn.dynamo_explain.explain_output
    assert (out.graph_count, out.graph_break_count) == (3, 2)
    assert all(torch.equal(a, b) for a,b in zip(w, learn.model.parameters()))
    assert learn.opt is None or not any('grad_avg' in s for s in learn.opt.state.values()) # no optimizer step
    text = capsys.readouterr().out
    assert "Dynamo explain: 3 graph(s), 2 graph break(s)" in text
    assert re.search(r"Graph break 1 at .*test_report.py:\d+ in forward: `print\(\"woo\"\)`", text)
    assert re.search(r"Graph break 2 at .*test_report.py:\d+ in forward: `if x.sum\(\) < 0", text)
    assert "Guards" not in text and "Ops in graph" not in text

def test_explain_guards_and_ops_only_when_asked(capsys):
    learn = synth_learner(cbs=DynamoExplainCallback(out_guards=True, ops_per_graph=True))
    learn.fit(1)
    text = capsys.readouterr().out
    assert "Guards (" in text and "Ops in graph 1" in text

def test_explain_uses_mixed_precision_autocast():
    seen = []
    class Probe(nn.Module):
        def __init__(self): super().__init__(); self.a = nn.Linear(1,1)
        def forward(self, x):
            seen.append(torch.is_autocast_enabled('cpu'))
            return self.a(x)
    learn = synth_learner(cbs=[DynamoExplainCallback(print_results=False), MixedPrecision(amp_mode='bf16')])
    learn.model = Probe()
    learn.fit(1)
    assert seen and all(seen)

def test_debug_compile_ladder_passes_and_matches():
    learn = Learner(digits_dls(), two_conv_cnn())
    stages = learn.debug_compile(backend='inductor', show=False)
    assert [s.backend for s in stages] == ['eager', 'aot_eager', 'inductor']
    assert all(s.ok and s.max_diff < 1e-3 for s in stages)

class ReluNet(nn.Module):
    "Calls `torch.relu`, which torch's testing backends break on purpose"
    def __init__(self): super().__init__(); self.a, self.b = nn.Linear(64, 32), nn.Linear(32, 10)
    def forward(self, x): return self.b(torch.relu(self.a(x.flatten(1))))

def test_debug_compile_stops_at_first_failure(capsys):
    learn = Learner(digits_dls(), ReluNet())
    p = [x.clone() for x in learn.model.parameters()]
    stages = learn.debug_compile(backend='relu_compile_error_TESTING_ONLY')
    assert [s.backend for s in stages] == ['eager', 'aot_eager', 'relu_compile_error_TESTING_ONLY']
    assert stages[0].ok and stages[1].ok and stages[2].error is not None and not stages[2].ok
    assert "relu_compile_error_TESTING_ONLY: FAILED with" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a,b in zip(p, learn.model.parameters())) and all(x.grad is None for x in learn.model.parameters())

def test_debug_compile_reports_wrong_results():
    learn = Learner(digits_dls(), ReluNet())
    stages = learn.debug_compile(backend='relu_accuracy_error_TESTING_ONLY', show=False)
    assert stages[-1].error is None and not stages[-1].outputs_match and not stages[-1].ok

def test_fullgraph_with_graph_break_says_where_and_leaves_learner_eager():
    learn = synth_learner().compile(fullgraph=True, backend='eager')
    learn.model = Toy()
    with pytest.raises(GraphBreakError, match=r"fullgraph=True, but the model has a graph break at .*test_report.py:\d+ in forward: `print\(\"woo\"\)`") as e:
        learn.fit(1)
    assert "`CompilerCallback` was removed and the Learner trains eagerly" in str(e.value)
    assert not hasattr(learn, 'compiler') and not is_compiled(learn.model)
    w = learn.model.a.weight.clone()
    learn.fit(1)
    assert not torch.equal(w, learn.model.a.weight)

def test_no_cpp_compiler_trains_eagerly(monkeypatch):
    monkeypatch.setattr(shutil, 'which', lambda name: None)
    learn = Learner(digits_dls().cpu(), two_conv_cnn()).compile() # On the CPU, where inductor needs a C++ compiler, GPU or not
    with pytest.warns(UserWarning, match="Not compiling the model: inductor needs a C\\+\\+ compiler to compile for the CPU and none was found"):
        learn.fit(1)
    assert not is_compiled(learn.model)

def test_gpu_too_old_for_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda device=None: (6, 1))
    assert cannot_compile_reason('inductor', 'cuda') == "inductor needs Triton, which needs a CUDA GPU of compute capability 7.0 or newer; this GPU has 6.1"
    assert cannot_compile_reason('aot_eager', 'cuda') is None

def test_gpu_without_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda device=None: (9, 0))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'triton' else find_spec(name, *a))
    assert cannot_compile_reason('inductor', 'cuda') == "inductor needs Triton to compile for a CUDA GPU and it isn't installed (`pip install triton`)"
    assert cannot_compile_reason('aot_eager', 'cuda') is None
    assert cannot_compile_reason('inductor', 'cpu') is None # The CPU's code is C++

def test_torch_that_cannot_compile(digits, monkeypatch):
    monkeypatch.setattr(torch._dynamo, 'is_dynamo_supported', lambda: False)
    learn = Learner(digits, two_conv_cnn()).compile(backend=BACKEND)
    with pytest.warns(UserWarning, match=r"Not compiling the model: torch.compile is not supported by this build of torch .* on Python 3\.\d+"):
        learn.fit(1)
    assert not is_compiled(learn.model)

def test_explain_and_debug_compile_see_a_regional_model_eager_and_leave_it_compiled(digits):
    from test_lifecycle import tower
    learn = Learner(digits, tower()).compile(backend=BACKEND, regional=True)
    learn.fit(1)
    blocks = list(learn.model[2])
    calls = [compiled_call(b) for b in blocks]
    explain = DynamoExplainCallback(print_results=False)
    learn.fit(1, cbs=explain)
    out = explain.explain_output
    assert (out.graph_count, out.graph_break_count) == (1, 0) # the whole model as one eager-traced graph
    assert all(s.ok for s in learn.debug_compile(backend='aot_eager', show=False))
    assert [compiled_call(b) for b in blocks] == calls

def test_ddp_strategy_lines():
    def recorded(**ddp): # As the fit's end gives the recorder the DDP strategy's facts (`DDPStrategy.averaged`)
        rec = CompileRecorder(CompileReport())
        rec.start(ddp=True); rec.stop(**ddp)
        return rec.report
    report = recorded()
    assert report.ddp and report.ddp_strategy() == "DDP: whole graphs, gradients all-reduced after the backward, in one all-reduce"
    assert report.ddp_strategy() in report.summary()
    joined = recorded(ddp_joined=3)
    assert joined.ddp_strategy() == ("DDP: whole graphs, gradients all-reduced after the backward, in one all-reduce, and by "
                                     "DDP's reducer for the 3 batch(es) under its `join()` (uneven inputs)")
    hooked = recorded(ddp_reducer="a communication hook registered with DDP")
    assert hooked.ddp_strategy() == ("DDP: whole graphs, gradients all-reduced after the backward, by DDP's reducer "
                                     "(a communication hook registered with DDP)")
    assert 'DDP:' not in CompileReport().summary()
    r = CompileReport(ddp=True, ddp_backward_graphs=2)
    assert r.ddp_strategy() == ("DDP: whole graphs, each backward compiled by compiled autograd with DDP's all-reduces in its "
                                "graph (DDP's Python reducer, `ddp_compiled_autograd=True`): 2 backward graph(s)")

def test_payoff_not_measured_under_compiled_autograd_says_why():
    r = CompileReport(batch_times=[(0.01, False)]*4, ddp_backward_graphs=1)
    assert r.payoff() == "payoff: not measured (with `ddp_compiled_autograd` an eager backward would all-reduce each gradient alone)"
    assert r.payoff() in r.summary()
    assert CompileReport(batch_times=[(0.01, False)]*4).payoff() == "payoff: not measured (the fit ran too few compiled training batches)"

def test_notes_of_gpu_fits_say_what_their_facts_say():
    "The background's and the tiers' notes are facts; the report alone words them, CUDA graphs' and several ranks' included"
    from fastxtend_compile.report import Note
    first = dict(busy=0.4, step_s=0.012, of='eager', graphs=True, saving=0.0072, first=True)
    two = dict(world=2, devices=2, hosts=1) # Two ranks of one host, a device each
    assert Note('tier_took_over', name='reduce-overhead', why=first, res=None, warm_s=1.5, path=True, at=(0, 9), ranks=two,
                against=('eager', 0.005, 0.012)).text == (
        "tier reduce-overhead took over at epoch 0, batch 9, on all 2 ranks at once: the GPU ran work 40% of the eager 12.0 ms "
        "step, so CUDA graphs, compiled first, would save about 7.2 ms of it; compiled cold in the fit's path in 1.5s; 5.0 ms a "
        "step against 12.0 ms for the eager step, each timed alone")
    assert Note('no_room', busy=0.3, step_s=0.01, name='reduce-overhead', step_bytes=2**31, free=2**30).text == (
        "no faster tier: the GPU ran work 30% of the default's 10.0 ms step, so CUDA graphs (reduce-overhead) would be faster, "
        "but their memory, 2.0 GB a step, doesn't fit in the 1.0 GB the GPU has free")
    assert Note('in_path', training=True, at=(1, 0), ranks=two).text.startswith("compiled in the fit's path at epoch 1, batch 0, on "
                                                                               "all 2 ranks at once, the faster tier first")
    warm = Note('warm', record={'cold_s': 20.}, training=False, at=(0, 3), ranks=None)
    assert warm.text == ("compiled for evaluation at once, in the fit's path at epoch 0, batch 3: inductor's cache has this model "
                         "state's code (compiled cold in 20.0s)")
    warm.add(took_s=2.) # Timed at a later batch
    assert warm.text.endswith("(compiled cold in 20.0s); compiling it in the fit's path took 2.0s")
