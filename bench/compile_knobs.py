"""Which inductor options cut the cold compile of fastai's `vision_learner(resnet34)` (bf16, data already on the GPU), and
what they cost the step. Each arm compiles in a process of its own with a fresh inductor cache, then times steady steps.
Usage: python bench/compile_knobs.py --arms base,no_lof,... --out DIR   [--profile ARM: cProfile that arm's compile]"""
import argparse, json, os, subprocess, sys, tempfile, time, statistics
from pathlib import Path

ARMS = {
    'base': {},
    'no_lof': {'loop_ordering_after_fusion': False},
    'no_peak': {'reorder_for_peak_memory': False},
    'no_mix': {'triton.mix_order_reduction': False},
    'no_coalesce': {'triton.coalesce_tiling_analysis': False},
    'no_autotune_pw': {'triton.autotune_pointwise': False},
    'no_pm': {'pattern_matcher': False},
    'no_epilogue_bench': {'benchmark_epilogue_fusion': False},
    'prof': {}, # The default options, with the compile under cProfile (`--profile prof`)
}

def run(a):
    import torch
    from fastai.vision.all import vision_learner, resnet34, DataLoaders, TfmdDL, TensorImage, TensorCategory, CrossEntropyLossFlat, Callback
    import fastxtend_compile # Patches `Learner.compile`
    options = json.loads(a.options)
    x = TensorImage(torch.randn(64, 3, 128, 128, device='cuda'))
    y = TensorCategory(torch.randint(0, 5, (64,), device='cuda'))
    def dls(n):
        d = DataLoaders(TfmdDL([(x, y)] * n, bs=None, num_workers=0, device='cuda'), TfmdDL([(x, y)] * 2, bs=None, num_workers=0, device='cuda'))
        d.c = 5
        return d
    class StepTimes(Callback):
        def before_fit(self): self.times = []
        def before_batch(self): torch.cuda.synchronize(); self.t = time.perf_counter()
        def after_batch(self):
            torch.cuda.synchronize()
            if self.training: self.times.append(time.perf_counter() - self.t)
    learn = vision_learner(dls(12), resnet34, pretrained=False, n_out=5, loss_func=CrossEntropyLossFlat()).to_bf16()
    learn.unfreeze()
    learn.compile(options=options or None)
    prof = None
    if a.profile:
        import cProfile
        prof = cProfile.Profile(); prof.enable()
    t = time.perf_counter()
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t
    if prof is not None:
        prof.disable()
        import pstats, io
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats('cumulative').print_stats(120)
        Path(a.profile).write_text(s.getvalue())
    r = learn.compiler.report
    compile_s, graphs = r.compile_seconds, r.graphs
    learn.dls = dls(60)
    st = StepTimes()
    with learn.no_bar(), learn.no_logging(): learn.fit(1, cbs=st)
    step_ms = 1e3 * statistics.median(st.times[5:])
    from torch._dynamo.utils import compilation_time_metrics
    times = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items()}
    res = dict(options=options, first_fit_s=first_s, compile_s=compile_s, graphs=graphs, step_ms=step_ms,
               recompiles=len(r.recompiles),
               compile_times=dict(sorted(times.items(), key=lambda kv: -kv[1])))
    print(json.dumps({k: v for k, v in res.items() if k != 'compile_times'}), flush=True)
    Path(a.json).write_text(json.dumps(res, indent=1))

def arms(a):
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.arms.split(','):
        opts = ARMS[name] if name in ARMS else json.loads(name)
        cache = Path(tempfile.mkdtemp(prefix='knobs-'))
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache/'triton'))
        cmd = [sys.executable, __file__, '--options', json.dumps(opts), '--json', str(out/f'{name}.json')]
        if name == a.profile: cmd += ['--profile', str(out/f'{name}.prof.txt')]
        t = time.perf_counter()
        subprocess.run(cmd, env=env, check=True)
        d = json.loads((out/f'{name}.json').read_text())
        ct = d['compile_times']
        keys = ('fx_codegen_and_compile', 'Scheduler.__init__', 'Scheduler.codegen', 'GraphLowering.run', '_compile.compile_inner')
        rows.append(f"| {name} | {d['compile_s']:.1f} | {d['first_fit_s']:.1f} | {d['step_ms']:.2f} | {d['graphs']} | "
                    + ' | '.join(f"{ct.get(k, 0):.1f}" for k in keys) + f" | {time.perf_counter() - t:.0f} |")
    md = ("| arm | compile s | first fit s | step ms | graphs | fx_codegen s | Scheduler init s | Scheduler codegen s | lowering s | dynamo s | process s |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n" + '\n'.join(rows) + '\n')
    (out/f'knobs-{int(time.time())}.md').write_text(md)
    print(md)

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('--options', default='{}')
    p.add_argument('--json', default=None)
    p.add_argument('--arms', default=None)
    p.add_argument('--profile', default=None)
    p.add_argument('--out', default=None)
    a = p.parse_args()
    arms(a) if a.arms else run(a)
