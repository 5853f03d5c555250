"Each use of PyTorch's private API, one test each: a torch upgrade that changes one fails here, by name"
import importlib.util, logging, operator, pickle, pytest, torch
from torch import nn
from fastxtend_compile.internals import *
from fastxtend_compile import internals
from fastxtend_compile.core import compiled_entry, graph_break_reason
from fastxtend_compile.internals import FrameCompile, tree_map_only, tree_flatten, tree_unflatten, tree_leaves

def _fresh_compiled(f, **kw): return torch.compile(own_function(f, 'internals_test_call'), backend='eager', **kw)

def test_own_function_gets_its_own_dynamo_cache():
    def f(x): return x + 1
    a, b = own_function(f, 'a_call'), own_function(f, 'b_call')
    assert a.__code__ is not b.__code__ and a.__name__ == 'a_call' and a(1) == f(1) == 2
    before = graphs_compiled()
    for g in (a, b): torch.compile(g, backend='eager')(torch.ones(2)) # A copy shares no cache with its twin
    assert graphs_compiled() - before == 2

def test_compiled_call_is_what_module_call_runs():
    m = nn.Linear(2, 2)
    assert compiled_call(m) is None
    set_compiled_call(m, lambda *a, **k: 'compiled')
    assert m(torch.ones(2)) == 'compiled' and compiled_call(m) is not None
    assert '_compiled_call_impl' not in m.__getstate__() # Not pickled with the module
    set_compiled_call(m, None)
    assert m(torch.ones(2)).shape == (2,)

def test_optimized_module_and_unsupported():
    assert is_optimized_module(torch.compile(nn.Linear(1, 1), backend='eager')) and not is_optimized_module(nn.Linear(1, 1))
    def f(x):
        if x.sum() > 0: return x
        return -x
    with pytest.raises(graph_break_error()): torch.compile(f, backend='eager', fullgraph=True)(torch.ones(1))

def test_traced_op_error_is_what_a_shape_that_does_not_fit_raises():
    with pytest.raises(traced_op_error(), match='fake tensors'): torch.compile(nn.Linear(3, 2), backend='eager')(torch.ones(4, 5))

def test_compile_callbacks_run_around_each_compile():
    seen = []
    start, end = (lambda *a: seen.append('start')), (lambda *a: seen.append('end'))
    add_compile_callbacks(start, end)
    try: _fresh_compiled(lambda x: x * 2)(torch.ones(1))
    finally: remove_compile_callbacks(start, end)
    assert seen == ['start', 'end']
    _fresh_compiled(lambda x: x * 3)(torch.ones(1))
    assert seen == ['start', 'end'] # Removed
    remove_compile_callbacks(start, end) # Twice is harmless

def test_recompile_limit_record_is_recognised():
    records = []
    h = logging.Handler(logging.WARNING); h.emit = records.append
    recompile_limit_logger.addHandler(h)
    f = _fresh_compiled(lambda x, n: x * n)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            for n in range(3): f(torch.ones(1), n)
    finally: recompile_limit_logger.removeHandler(h)
    hits = [r for r in map(recompile_limit_hit, records) if r]
    assert hits and hits[0][0] == 'recompile_limit' and int(hits[0][1]) == 1
    name, filename, line = hits[0][2]
    assert name == 'internals_test_call' and filename == __file__ and isinstance(line, int) and hits[0][3]

def test_compilation_metrics_describe_each_frame():
    seen = set(map(id, compilation_metrics())) # A bounded deque: once full, old records drop off the front
    f = _fresh_compiled(lambda x: x.sin())
    f(torch.ones(2)); f(torch.ones(3))
    new = [m for m in compilation_metrics() if id(m) not in seen]
    assert [m.co_name for m in new] == ['internals_test_call'] * 2
    assert new[0].recompile_reason is None and new[1].recompile_reason and new[1].fail_type is None
    assert new[0].entire_frame_compile_time_s >= 0 and new[0].co_filename == __file__ and new[0].co_firstlineno > 0
    first, again = map(frame_compile, new) # As the report reads them
    assert first.name == 'internals_test_call' and first.filename == __file__ and first.line == new[0].co_firstlineno
    assert first.reason == '' and again.reason == new[1].recompile_reason and first.seconds >= 0

def test_failed_compile_has_no_frame_compile():
    seen = set(map(id, compilation_metrics()))
    def f(x):
        if x.sum() > 0: return x
        return -x
    with pytest.raises(graph_break_error()): torch.compile(own_function(f, 'internals_fail_call'), backend='eager', fullgraph=True)(torch.ones(1))
    new = [m for m in compilation_metrics() if id(m) not in seen]
    assert new and [frame_compile(m) for m in new] == [None] * len(new)

def _recompile_reasons(f, *calls)->list:
    "TorchDynamo's reason for each recompile of `f` over `calls`, each a thunk that calls it"
    seen = set(map(id, compilation_metrics()))
    for c in calls: c()
    return [m.recompile_reason for m in compilation_metrics() if id(m) not in seen and m.recompile_reason]

def test_guard_failures_are_recognised_in_torch_s_words():
    f = _fresh_compiled(lambda x: x * 2)
    lin = nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.1)) # Reads its `training` flag
    g = torch.compile(own_function(lambda m, x: m(x), 'internals_guard_call'), backend='eager')
    reasons = _recompile_reasons(f, lambda: f(torch.ones(4, 3)), lambda: f(torch.ones(5, 3)), lambda: f(torch.ones(5, 7)),
                                 lambda: f(torch.ones(5, 7, dtype=torch.float64)), lambda: f(torch.ones(7, 5, dtype=torch.float64).t()))
    kinds = [guard_failure(r) for r in reasons]
    assert kinds[:4] == [('batch_size', ('4', '5')), ('size', ('1', '3', '7')), ('dtype', ()), ('stride', ())], reasons
    reasons = _recompile_reasons(g, lambda: g(lin, torch.ones(2, 3)), lambda: lin.eval() and g(lin, torch.ones(2, 3)))
    assert [guard_failure(r)[0] for r in reasons] == ['training'], reasons
    lin.train()
    def nograd():
        with torch.no_grad(): g(lin, torch.ones(2, 3))
    reasons = _recompile_reasons(g, nograd)
    assert [guard_failure(r)[0] for r in reasons] == ['grad_mode'], reasons
    lin[0].weight.requires_grad_(False)
    reasons = _recompile_reasons(g, lambda: g(lin, torch.ones(2, 3)))
    assert reasons == [] or guard_failure(reasons[0])[0] in ('requires_grad', 'grad_mode'), reasons # Some versions don't guard it
    a = torch.compile(own_function(lambda m, x: m(x), 'internals_autocast_call'), backend='eager')
    def a_call(grad=True, bf16=False):
        with torch.set_grad_enabled(grad), torch.autocast('cpu', dtype=torch.bfloat16, enabled=bf16): a(lin, torch.ones(2, 3))
    # Mixed precision switched on after validation's graph: its inputs' dtype as it was, grad mode named beside autocast
    reasons = _recompile_reasons(a, a_call, lambda: a_call(grad=False), lambda: a_call(bf16=True))
    assert [guard_failure(r)[0] for r in reasons] == ['grad_mode', 'autocast'], reasons
    def no_grad_then(mode):
        with mode(): a(lin, torch.ones(2, 3))
    # Inference tensors after a graph for ordinary ones, gradients off for both
    reasons = _recompile_reasons(a, lambda: no_grad_then(torch.no_grad), lambda: no_grad_then(torch.inference_mode))
    assert [guard_failure(r)[0] for r in reasons] == ['inference'], reasons
    h = _fresh_compiled(lambda x, n: x * n)
    reasons = _recompile_reasons(h, lambda: h(torch.ones(1), 2), lambda: h(torch.ones(1), 3))
    assert guard_failure(reasons[0]) == ('value', ('n', '2')), reasons
    k = _fresh_compiled(lambda x, l: x * len(l))
    reasons = _recompile_reasons(k, lambda: k(torch.ones(1), [1, 2]), lambda: k(torch.ones(1), [1, 2, 3]))
    assert guard_failure(reasons[0]) == ('length', ('l', '2')), reasons
    m = nn.Sequential(nn.ReLU())
    m.f = torch.relu
    def calls_f(m, x): return m.f(m[0](x))
    c = torch.compile(own_function(calls_f, 'internals_identity_call'), backend='eager')
    def swap(name, new):
        def call():
            setattr(m, name, new) if name == 'f' else m.__setitem__(0, new)
            c(m, torch.ones(2))
        return call
    # A function the model calls, replaced; a layer, replaced by one of another type. Some versions name only the type's class
    reasons = _recompile_reasons(c, swap('f', torch.relu), swap('f', torch.tanh), swap(0, nn.GELU()))
    kinds = [guard_failure(r) for r in reasons]
    assert [k for k,v in kinds] == ['identity', 'type'] and kinds[0][1][0] == "m.f" and kinds[1][1] in (
        ("m._modules['0']", 'torch.nn.modules.activation.ReLU'), ("m._modules['0']", None)), reasons
    assert guard_failure('something TorchDynamo never said') is None

def test_a_dynamic_graphs_stride_guard_is_recognised():
    # fastai's text encoders pass chunks of a batch, slices of a larger tensor: their strides follow another size
    f = _fresh_compiled(lambda x: (x * 2).sum(1), dynamic=None)
    def call(x):
        mark_dynamic(x, 1)
        return lambda: f(x)
    full = torch.arange(80).view(4, 20)
    reasons = _recompile_reasons(f, call(torch.arange(20).view(4, 5)), call(torch.arange(28).view(4, 7)), call(full[:, :6]), call(full[:, :9]))
    assert [guard_failure(r) for r in reasons] == [('stride', ())], reasons

def test_fx_code_is_recognised():
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert is_fx_code(gm.forward.__code__.co_filename) and not is_fx_code(__file__)

def test_graph_and_graph_break_counters():
    graphs, breaks = graphs_compiled(), graph_break_reasons()
    def f(x):
        x = x + 1
        print('break')
        return x * 2
    _fresh_compiled(f)(torch.ones(1))
    new = graph_break_reasons() - breaks
    assert graphs_compiled() - graphs == 2 and sum(new.values()) == 1
    assert '`print`' in graph_break_reason(next(iter(new))) # Its reason, as TorchDynamo words it

def test_graph_break_parts_from_torch_s_words():
    def print_break(x):
        print('break')
        return x
    def branch(x):
        if x.sum() > 0: return x
        return -x
    for f,expl in ((print_break, '`print`'), (branch, None)):
        with pytest.raises(graph_break_error()) as e: torch.compile(own_function(f, 'internals_parts_call'), backend='eager', fullgraph=True)(torch.ones(1))
        b = graph_break_parts(str(e.value))
        assert isinstance(b.explanation, str) and b.explanation and (b.hint is None or b.hint.startswith('Hint:'))
        if expl: assert expl in b.explanation or expl in (b.hint or ''), b
        else: assert b.data_dependent or 'data-dependent' in b.explanation.lower() or 'data dependent' in b.explanation.lower(), b
        frame = error_frame(e.value) # The user's line where it broke
        assert frame.filename == __file__ and frame.name == 'internals_parts_call' and frame.lineno > f.__code__.co_firstlineno

def test_call_module_runs_hooks_but_not_the_compiled_call():
    m, seen = nn.Linear(2, 2), []
    m.register_forward_hook(lambda *a: seen.append('hook'))
    set_compiled_call(m, lambda *a, **k: 'compiled')
    try: assert call_module(m, torch.ones(2)).shape == (2,) and seen == ['hook']
    finally: set_compiled_call(m, None)

def test_optimized_inner_is_the_module_inside_torch_compile():
    m = nn.Linear(1, 1)
    assert optimized_inner(torch.compile(m, backend='eager')) is m and optimized_inner(m) is m

def test_pytree_flattens_and_rebuilds_nested_inputs():
    xs = ((torch.ones(1), [torch.zeros(2), 3]), {'k': torch.ones(3)})
    leaves, spec = tree_flatten(xs)
    assert len(leaves) == 4 and tree_unflatten(leaves, spec)[0][1][1] == 3
    assert [t.shape for t in tree_leaves(tree_map_only(torch.Tensor, lambda t: t * 2, xs)) if isinstance(t, torch.Tensor)] == [(1,), (2,), (3,)]

def test_hook_dicts_see_every_kind_of_hook():
    m = nn.Sequential(nn.Linear(1, 1))
    dicts = hook_dicts(m)
    assert not any(dicts)
    hs = [m[0].register_forward_hook(lambda *a: None), m.register_forward_pre_hook(lambda *a: None),
          m[0].register_full_backward_hook(lambda *a: None), torch.nn.modules.module.register_module_forward_hook(lambda *a: None)]
    assert sum(len(d) for d in dicts) == 4
    for h in hs: h.remove()
    assert not any(dicts)

def test_dynamo_marks_are_set_on_traced_parameters_and_stripped():
    m = nn.Linear(2, 2)
    compiled_entry('Linear', backend='eager')(m, torch.ones(2))
    p = m.weight
    assert '_dynamo_static_input_type' in p.__dict__ # What TorchDynamo leaves on parameters, and would be pickled
    with without_dynamo_marks(m): assert b'_dynamo' not in pickle.dumps(m)
    assert '_dynamo_static_input_type' in p.__dict__

def test_kernels_options_and_support():
    from torch._inductor import config
    with config.patch({'cpp.cxx': (None, 'clang++')}): assert inductor_cxx() == 'clang++' # The compiler inductor is set to use
    assert 'cpu' in fused_kernel_devices() and fused_adam_kernel(True) is torch._fused_adamw_ and fused_adam_kernel(False) is torch._fused_adam_
    assert 'max_autotune' in inductor_options() and 'triton.cudagraphs' in inductor_options()
    assert dynamo_supported() is True

def test_explain_leaves_other_compiled_code_alone():
    f = _fresh_compiled(lambda x: x.cos())
    f(torch.ones(2))
    graphs = graphs_compiled()
    def g(x):
        x = x + 1
        print('break')
        return x * 2
    out = explain(g, torch.ones(2))
    assert (out.graph_count, out.graph_break_count, len(out.break_reasons)) == (2, 1, 1) and out.op_count == 2
    assert out.ops_per_graph == [[operator.add], [operator.mul]] and out.out_guards and len(out.graphs) == 2
    reason, (filename, line, name, code) = explained_break(out.break_reasons[0])
    assert '`print`' in graph_break_reason(reason) and filename == __file__ and name == 'g' and code == "print('break')"
    seen = set(map(id, compilation_metrics()))
    f(torch.ones(2)) # Still compiled: no new compile, as there would be after `torch._dynamo.reset()`
    assert all(id(m) in seen for m in compilation_metrics())

def test_inductor_cache_dir_and_cpp_kernel_files(tmp_path, monkeypatch):
    monkeypatch.setenv('TORCHINDUCTOR_CACHE_DIR', str(tmp_path))
    assert inductor_cache_dir() == str(tmp_path)
    assert cpp_kernel_files() == []
    f = torch.compile(own_function(lambda x: (x * 3).sin() + 2, 'cpp_kernel_test_call'), backend='inductor')
    f(torch.randn(37)) # A kernel built into this cache directory, and registered in inductor's C++ code caches
    files = cpp_kernel_files()
    assert any(f.endswith('.so') for f in files) and all((tmp_path/f).is_file() for f in files), files
    assert all(f[:2] == f.split('/')[1][1:3] for f in files) # `<key[1:3]>/<key>.*`: what a fresh cache looks for
    # The vector-ISA probes (built once per cache directory) are found by their sources
    from torch._inductor.cpu_vec_isa import VecISA, VecAVX512, VecAMX
    (tmp_path/'zz').mkdir(exist_ok=True) # A real kernel's key may put it there too (seen on CI: 1 in 32² a kernel)
    for n,code in (('a', VecISA._avx_code), ('b', VecAVX512._avx512_bf16_code), ('c', VecAMX._amx_code)):
        (tmp_path/'zz'/f'czz{n}.cpp').write_text(code)
        (tmp_path/'zz'/f'czz{n}.so').write_bytes(b'')
    assert {f'zz/czz{n}.{e}' for n in 'abc' for e in ('cpp', 'so')} <= set(cpp_kernel_files())

def test_optimize_ddp_is_set_and_read():
    old = optimize_ddp()
    try:
        set_optimize_ddp('no_optimization')
        assert torch._dynamo.config.optimize_ddp == 'no_optimization' == optimize_ddp()
        assert torch._dynamo.utils.get_optimize_ddp_mode() == 'no_optimization' # What TorchDynamo acts on
    finally: set_optimize_ddp(old)
    assert optimize_ddp() == old

def test_python_reducer_is_seen_and_what_it_changes_is_restored():
    import socket
    from torch.nn.parallel import DistributedDataParallel
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    torch.distributed.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    old, saved = optimize_ddp(), python_reducer_settings()
    try:
        assert not uses_python_reducer(DistributedDataParallel(nn.Linear(2, 2)))
        set_optimize_ddp('python_reducer')
        ddp = DistributedDataParallel(nn.Linear(2, 2)) # DDP reads the setting as it wraps, and changes inductor's and TorchDynamo's
        assert uses_python_reducer(ddp) and python_reducer_settings() != saved
        restore_python_reducer_settings(saved)
        assert python_reducer_settings() == saved
    finally:
        set_optimize_ddp(old)
        restore_python_reducer_settings(saved)
        torch.distributed.destroy_process_group()

def test_ddp_comm_hooks_are_read_from_ddp():
    import socket
    from torch.nn.parallel import DistributedDataParallel
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    torch.distributed.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(nn.Linear(2, 2))
        assert ddp_comm_hooks(ddp) == []
        ddp.register_comm_hook(None, allreduce_hook)
        assert ddp_comm_hooks(ddp) == [(allreduce_hook, None)]
    finally: torch.distributed.destroy_process_group()

def test_ddp_joining_is_read_from_ddps_join_context():
    import socket
    from torch.nn.parallel import DistributedDataParallel
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    torch.distributed.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(nn.Linear(2, 2))
        assert not ddp_joining(ddp)
        # The context for uneven inputs, made (not entered, which would run its collectives): DDP's forward now takes part
        ddp.join()
        assert ddp_joining(ddp) and not ddp_joining(nn.Linear(2, 2))
        del ddp # Its reducer goes while its process group is still there
    finally: torch.distributed.destroy_process_group()

def test_ddp_forward_calls_module_where_ddp_has_nothing_else_to_do_and_the_call_is_ddps():
    import socket, warnings
    from torch.nn.parallel import DistributedDataParallel
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    torch.distributed.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    try:
        x, bn = torch.randn(4, 2), lambda: nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        ddp = DistributedDataParallel(nn.Linear(2, 2))
        assert not ddp_forward_calls_module(ddp) # Its first forward sets it up
        ddp(x)
        assert ddp_forward_calls_module(ddp)
        with_buffers = DistributedDataParallel(bn())
        with_buffers(x)
        assert not ddp_forward_calls_module(with_buffers) # It broadcasts rank 0's running statistics before each forward
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', FutureWarning) # Newer torch names the argument `forward_sync_buffers`
            unsynced = DistributedDataParallel(bn(), broadcast_buffers=False)
        unsynced(x)
        assert ddp_forward_calls_module(unsynced)
        active = []
        ddp.module.register_forward_hook(lambda m, i, o: active.append(DistributedDataParallel._get_active_ddp_module()))
        assert torch.equal(ddp_module_call(ddp, x), ddp.module(x))
        assert active == [ddp, None] # Within DDP's forward context, as TorchDynamo sees a module DDP runs
    finally: torch.distributed.destroy_process_group()

def test_copy_into_copies_each_source_into_its_destination_in_place():
    a, b = torch.zeros(2, 3).t(), torch.zeros(4) # A destination need not be contiguous
    ids = (a.data_ptr(), b.data_ptr())
    copy_into([a, b], [torch.arange(6.).view(3, 2), torch.ones(4)])
    assert torch.equal(a, torch.arange(6.).view(3, 2)) and torch.equal(b, torch.ones(4))
    assert (a.data_ptr(), b.data_ptr()) == ids

def test_at_backward_end_runs_once_the_backward_is_done_before_it_returns():
    w = nn.Parameter(torch.ones(3))
    seen = []
    y = (w * 2).sum()
    y.register_hook(lambda g: at_backward_end(lambda: seen.append(w.grad.clone())))
    y.backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((3,), 2.)) # Every gradient is ready when it runs
    with pytest.raises(RuntimeError, match='Final callbacks can only be installed during backward pass'): at_backward_end(lambda: None)

def test_compiled_autograd_compiles_the_backward():
    torch.manual_seed(0)
    lin, x = nn.Linear(4, 3), torch.randn(8, 4)
    lin(x).square().mean().backward()
    eager = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    captures = compiled_autograd_captures()
    with compiled_autograd(torch.compile(backend='eager')): lin(x).square().mean().backward()
    assert compiled_autograd_captures() == captures + 1
    for g,e in zip([p.grad for p in lin.parameters()], eager): torch.testing.assert_close(g, e)

def test_aot_autograd_cache_is_set_and_read():
    old = aot_autograd_cache()
    try:
        set_aot_autograd_cache(False)
        assert torch._functorch.config.enable_autograd_cache is False and not aot_autograd_cache()
        set_aot_autograd_cache(True)
        assert aot_autograd_cache()
    finally: set_aot_autograd_cache(old)

def test_precompiled_code_is_saved_and_found_by_qualified_name():
    "While `caching_precompile` is on, TorchDynamo keeps the code it traces, quietly drops guards on globals, and finds it again by name"
    import uuid
    def f(x): return torch.relu(x) + 1
    name = f'internals_precompile_{uuid.uuid4().hex}' # No earlier run's code to find
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    old = caching_precompile()
    set_caching_precompile(True)
    precompile_guard_logger.addHandler(handler)
    try:
        assert caching_precompile()
        torch.compile(own_function(f, 'f_call', name), backend='inductor')(torch.ones(3))
        assert any(dropped_guard(r) for r in records) # `torch`, a global module, is no longer guarded
        torch.compiler.save_cache_artifacts() # Writes the precompiled code into TorchDynamo's cache
        loads, graphs = precompiled_loads(), graphs_compiled()
        g = torch.compile(own_function(f, 'f_call', name), backend='inductor') # The same qualified name: found
        assert precompiled_loads() == loads + 1
        assert torch.equal(g(torch.ones(3)), f(torch.ones(3))) and graphs_compiled() == graphs # Run, not traced again
        torch.compile(own_function(f, 'f_call', name + '_other'), backend='inductor') # Another name: not found
        assert precompiled_loads() == loads + 1
    finally:
        precompile_guard_logger.removeHandler(handler)
        set_caching_precompile(old)
    assert not caching_precompile()

def test_own_function_qualified_name():
    def f(x): return x
    g = own_function(f, 'a_call', 'a_call_0123')
    assert g.__name__ == 'a_call' and g.__qualname__ == 'a_call_0123' and g.__code__.co_name == 'a_call'
    assert own_function(f, 'b_call').__qualname__ == 'b_call'

@pytest.mark.slow
@pytest.mark.skipif(precompile_supported(), reason="this torch loads precompiled code")
def test_precompiled_code_of_a_model_with_gradients_does_not_load_on_older_torch(tmp_path):
    "Why `precompile_supported` is torch 2.15 or newer: before, TorchDynamo fails to load the guards of parameters with gradients"
    import subprocess, sys, textwrap
    script = textwrap.dedent('''
        import sys, torch
        from torch import nn
        from fastxtend_compile.internals import own_function, set_caching_precompile
        set_caching_precompile(True)
        def call(m, x): return m(x)
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        m(torch.ones(1, 4)).sum().backward() # Gradients, as after a first batch
        entry = lambda: torch.compile(own_function(call, 'seq_call'), backend='inductor')
        if sys.argv[1] == 'save':
            entry()(m, torch.ones(1, 4)).sum().backward()
            open(sys.argv[2], 'wb').write(torch.compiler.save_cache_artifacts()[0])
        else:
            torch.compiler.load_cache_artifacts(open(sys.argv[2], 'rb').read())
            try: entry()
            except TypeError as e: print(e)
    ''')
    for role, cache in (('save', 'a'), ('load', 'b')):
        env = {**__import__('os').environ, 'TORCHINDUCTOR_CACHE_DIR': str(tmp_path/cache)}
        out = subprocess.run([sys.executable, '-c', script, role, str(tmp_path/'artifacts.bin')], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
    assert 'assigned grad expected to be a Tensor or None but got grad of type _Missing' in out.stdout

def test_inductor_fallback_random_draws_dropout_as_eager():
    f = lambda x: torch.nn.functional.dropout(x, 0.5)
    x = torch.ones(64)
    torch.manual_seed(0); eager = f(x)
    torch.manual_seed(0)
    with inductor_fallback_random(): compiled = torch.compile(f, backend='inductor')(x)
    torch.testing.assert_close(compiled, eager)

class _Branches(nn.Module):
    def forward(self, x): return x * 2 if x.sum().item() > 0 else x

class _Logs(nn.Module):
    def __init__(self): super().__init__(); self.log = []
    def forward(self, x):
        self.log.append(1)
        return x + 1

def test_fullgraph_refusals_data_dependent_and_recompile_limit():
    f = torch.compile(_Branches(), backend='eager', fullgraph=True)
    with pytest.raises(data_dependent_error()) as e: f(torch.ones(3))
    assert is_data_dependent(e.value) and e.value.real_stack[-1].line.strip().startswith('def forward(self, x): return x * 2')
    g = torch.compile(own_function(lambda m, x: m(x), 'logs_call'), backend='eager', fullgraph=True)
    m = _Logs()
    with pytest.raises(recompile_limit_error()):
        for _ in range(20): g(m, torch.ones(3))
    guard, file, line, code = last_recompile('logs_call')
    assert guard.startswith('len(') and '.log) ==' in guard and file == __file__ and code.strip() == 'self.log.append(1)'

def test_held_records_are_released_unless_the_context_ends_with_the_kept_exception(caplog):
    log = logging.getLogger('fastxtend_compile.test_held')
    with caplog.at_level(logging.ERROR, logger=log.name):
        with HeldRecords(log, KeyError): log.error('one')
        assert caplog.messages == ['one']
        with pytest.raises(KeyError):
            with HeldRecords(log, KeyError) as held: log.error('two'); raise KeyError()
        assert caplog.messages == ['one'] and len(held.records) == 1
        held.release()
        assert caplog.messages == ['one', 'two']
    assert fake_tensor_logger.name == 'torch._subclasses.fake_tensor'

def test_guarded_code_is_the_innermost_user_frame():
    g = torch.compile(own_function(lambda m, x: m(x), 'guarded_call'), backend='eager')
    m = _Logs()
    for _ in range(3): g(m, torch.ones(3))
    reason = next(r.recompile_reason for r in reversed(compilation_metrics()) if r.co_name == 'guarded_call' and r.recompile_reason)
    file, line, code = guarded_code(reason)
    assert file == __file__ and code.strip() == 'self.log.append(1)'

def test_mark_dynamic_compiles_one_graph_for_every_size():
    f = _fresh_compiled(lambda x: x.sum(1) * 2)
    before = graphs_compiled()
    for n in (3, 5, 9):
        x = torch.ones(2, n)
        mark_dynamic(x, 1)
        assert torch.equal(f(x), torch.full((2,), 2.*n))
    assert graphs_compiled() - before == 1

@pytest.mark.slow
def test_import_inductor():
    "What a worker process imports before its first job is what `torch.compile` imports to compile with inductor"
    import subprocess, sys
    code = ('import sys, torch; from fastxtend_compile.internals import import_inductor; import_inductor(); '
            'print("torch._inductor.compile_fx" in sys.modules)')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ['True'], out.stderr[-2000:]

def test_gpu_sleep_holds_the_gpu_with_torchs_spinning_kernel():
    "`gpu_sleep` queues `torch.cuda._sleep`, which every build has (CUDA's run on the CPU too); tests/test_gpu.py times it"
    assert callable(torch.cuda._sleep)
    assert 'gpu_sleep' in internals.__all__

def test_backend_error_is_the_backends_own():
    "TorchDynamo wraps a backend's error in `BackendCompilerFailed`, without it as the cause: `backend_error` finds it"
    def broken(gm, example_inputs): raise ValueError('no kernels here')
    with pytest.raises(Exception) as info: torch.compile(nn.Linear(2, 2), backend=broken)(torch.randn(3, 2))
    inner = backend_error(info.value)
    assert isinstance(inner, ValueError) and str(inner) == 'no kernels here'
    assert backend_error(ValueError('plain')) is None

def test_tensor_version_moves_on_with_each_in_place_change():
    "The version counter `ZeroedGrads` reads: moved on by an in-place op, the backward's add into a gradient among them"
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.zeros(3)
    g, v = p.grad, tensor_version(p.grad)
    assert tensor_version(g + 1) == 0 and tensor_version(g) == v # An op that makes a new tensor leaves it
    (p * 2).sum().backward() # Adds into the gradient that exists
    assert p.grad is g and tensor_version(g) > v
    v = tensor_version(g)
    torch._foreach_zero_([g])
    assert tensor_version(g) > v

def test_subclass_dispatch_off_skips_a_subclass_torch_function():
    "What the library reads of fastai's `TensorBase` inputs each batch (shapes, dtypes, `requires_grad`) skips its `__torch_function__`"
    from fastxtend_compile.internals import subclass_dispatch_off
    calls = []
    class Spied(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})
    t = torch.zeros(2, 3).as_subclass(Spied).requires_grad_()
    calls.clear(); _ = t.shape, t.requires_grad
    assert len(calls) == 2 # Each read dispatches
    calls.clear()
    with subclass_dispatch_off(): shape, dtype, grad = tuple(t.shape), t.dtype, t.requires_grad
    assert calls == [] and shape == (2, 3) and dtype == torch.float32 and grad

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec('triton') is None, reason="inductor starts its compile processes only where Triton is installed")
def test_compile_workers_start_as_a_gpu_fits_compile_starts():
    "On a CUDA GPU with inductor, inductor's Triton compile processes start as a compile starts, before the backend is called; elsewhere they don't"
    import subprocess, sys
    code = '''if True:
        import torch
        from fastxtend_compile.core import CompileWorkers
        from fastxtend_compile.internals import compile_workers_started
        seen = []
        def backend(gm, inputs):
            seen.append(compile_workers_started())
            return gm.forward
        workers = CompileWorkers()
        for device, f in (('cpu', lambda x: x + 1), ('cuda', lambda x: x * 2), ('cuda', lambda x: x * 3)):
            workers.start({'backend': 'inductor'}, torch.device(device))
            torch.compile(f, backend=backend)(torch.ones(2))
            workers.stop()
        print(*seen, workers.watching)'''
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ['False', 'True', 'True', 'False'], out.stderr[-2000:]

def test_compile_workers_that_cannot_start_early_leave_the_compile_to_go_on(monkeypatch):
    "Where inductor's compile processes can't start as a compile starts, the compile goes on: inductor tries again itself"
    from fastxtend_compile import core
    def refused(): raise RuntimeError("no processes here")
    monkeypatch.setattr(core, 'start_compile_workers', refused)
    monkeypatch.setattr(core, 'compile_workers_started', lambda: False)
    workers = core.CompileWorkers()
    workers.start({'backend': 'inductor'}, torch.device('cuda'))
    try: out = _fresh_compiled(lambda x: x * 4)(torch.ones(2))
    finally: workers.stop()
    assert torch.equal(out, torch.full((2,), 4.)) and not workers.watching
