import argparse, json, os, subprocess, sys, tempfile, time, cProfile, pstats, io
from pathlib import Path

def run(role, out):
    t0 = time.perf_counter()
    import torch
    from fastai.vision.all import vision_learner, resnet34, DataLoaders, TfmdDL, TensorImage, TensorCategory, CrossEntropyLossFlat
    import fastxtend_compile
    from fastxtend_compile.internals import warm_up_inductor
    x = TensorImage(torch.randn(64, 3, 128, 128, device='cuda'))
    y = TensorCategory(torch.randint(0, 5, (64,), device='cuda'))
    dl = TfmdDL([(x, y)] * 12, bs=None, num_workers=0, device='cuda')
    dls = DataLoaders(dl, TfmdDL([(x, y)] * 2, bs=None, num_workers=0, device='cuda'))
    dls.c = 5
    learn = vision_learner(dls, resnet34, pretrained=False, n_out=5, loss_func=CrossEntropyLossFlat()).to_bf16()
    learn.unfreeze()
    with learn.no_bar(), learn.no_logging(): learn.fit(1) # eager, like the frozen epoch (CUDA, cudnn warmed)
    torch.cuda.synchronize()
    tw = None
    if role == 'prewarm':
        t = time.perf_counter(); warm_up_inductor(); tw = time.perf_counter() - t
    learn.compile()
    mods0 = set(sys.modules)
    pr = cProfile.Profile() if role != 'cold' else None
    t = time.perf_counter()
    if pr: pr.enable()
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    torch.cuda.synchronize()
    if pr: pr.disable()
    fit_s = time.perf_counter() - t
    new = sorted(set(sys.modules) - mods0)
    r = learn.compiler.report
    res = dict(role=role, fit_s=fit_s, warm_up_s=tw, compile_s=r.compile_seconds, graphs=r.graphs, new_modules=len(new))
    print(json.dumps(res), flush=True)
    if pr:
        s = io.StringIO(); st = pstats.Stats(pr, stream=s)
        st.sort_stats('tottime').print_stats(40)
        st.sort_stats('cumulative').print_stats(120)
        Path(out, f'{role}.prof.txt').write_text(s.getvalue() + '\nNEW MODULES:\n' + '\n'.join(new))
        st.dump_stats(str(Path(out, f'{role}.pstats')))

if __name__ == '__main__':
    role, out = sys.argv[1], sys.argv[2]
    if role == 'all':
        cache = Path(tempfile.mkdtemp(prefix='pw-'))
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache/'triton'))
        for r in ['cold', 'base', 'prewarm', 'base', 'prewarm']:
            subprocess.run([sys.executable, __file__, r, out], env=env, check=False)
    else: run(role, out)
