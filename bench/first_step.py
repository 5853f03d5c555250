"""Time to the first compiled training step of fastai's `vision_learner(resnet34)` (bf16) on data already on the GPU, in a
process of its own, with the inductor cache dir given: where a warm start's seconds go. `--early-pool` starts inductor's
compile workers before TorchDynamo traces (as `learn.compile()` may), rather than when inductor is first called.
Usage: TORCHINDUCTOR_CACHE_DIR=DIR python bench/first_step.py [--early-pool]
       python bench/first_step.py --arms N --out DIR   (a cold process, then N warm pairs, alternating late and early pool)"""
import argparse, json, os, subprocess, sys, tempfile, time
from pathlib import Path

def run(a):
    t0 = time.perf_counter()
    import torch
    from fastai.vision.all import vision_learner, resnet34, DataLoaders, TfmdDL, TensorImage, TensorCategory, CrossEntropyLossFlat
    import fastxtend_compile # Patches `Learner.compile`
    x = TensorImage(torch.randn(64, 3, 128, 128, device='cuda'))
    y = TensorCategory(torch.randint(0, 5, (64,), device='cuda'))
    dl = TfmdDL([(x, y)] * 12, bs=None, num_workers=0, device='cuda')
    dls = DataLoaders(dl, TfmdDL([(x, y)] * 2, bs=None, num_workers=0, device='cuda'))
    dls.c = 5
    learn = vision_learner(dls, resnet34, pretrained=False, n_out=5, loss_func=CrossEntropyLossFlat()).to_bf16()
    learn.unfreeze()
    if a.early_pool:
        from torch._inductor.async_compile import maybe_warm_pool
        maybe_warm_pool()
    learn.compile()
    t = time.perf_counter()
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    torch.cuda.synchronize()
    fit_s = time.perf_counter() - t
    from torch._dynamo.utils import compile_times
    r = learn.compiler.report
    res = dict(early_pool=a.early_pool, fit_s=fit_s, compile_s=r.compile_seconds, graphs=r.graphs, import_to_fit_s=t - t0,
               compile_times=compile_times(repr='str'))
    print(json.dumps({k: v for k, v in res.items() if k != 'compile_times'}))
    if a.json: Path(a.json).write_text(json.dumps(res, indent=1))

def arms(a):
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix='first-step-'))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache/'triton'))
    runs = [('cold', False)] + [(f'warm{i}-{"early" if e else "late"}', e) for i in range(a.arms) for e in (False, True)]
    rows = []
    for name, early in runs:
        cmd = [sys.executable, __file__, '--json', str(out/f'{name}.json')] + (['--early-pool'] if early else [])
        subprocess.run(cmd, env=env, check=True)
        d = json.loads((out/f'{name}.json').read_text())
        rows.append(f"| {name} | {'early' if early else 'late'} | {d['fit_s']:.2f} | {d['compile_s']:.2f} | {d['graphs']} |")
    (out/'first_step.md').write_text("| process | compile workers started | fit(1) s | compile s | graphs |\n|---|---|---:|---:|---:|\n"
                                     + '\n'.join(rows) + '\n')
    print((out/'first_step.md').read_text())

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('--early-pool', action='store_true')
    p.add_argument('--json', default=None)
    p.add_argument('--arms', type=int, default=0)
    p.add_argument('--out', default=None)
    a = p.parse_args()
    arms(a) if a.arms else run(a)
