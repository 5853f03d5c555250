"""A fastai vision workflow, eager or compiled: images on disk -> `ImageDataLoaders` (`Resize`, `aug_transforms`) ->
`vision_learner(resnet34)` (bf16 on CUDA) -> `fine_tune`. Prints the compile report, and with `--json` writes the run's
numbers: total and per-epoch seconds, compile seconds, graphs, recompiles, eager calls, payoff, TorchDynamo's
compile-time breakdown.
Usage: python bench/vision_fine_tune.py [--n 1200] [--size 64] [--epochs 1] [--device cuda] [--eager] [--json FILE]
       python bench/vision_fine_tune.py --arms eager,cold,warm --out DIR  (each arm in its own process; warm reuses
       cold's inductor cache)"""
import argparse, json, os, subprocess, sys, tempfile, time
from pathlib import Path
import numpy as np
from PIL import Image

def write_images(path:Path, n:int, size:int, seed:int=0):
    "Two classes of random images, one brighter than the other, written as JPEG files"
    rng = np.random.default_rng(seed)
    for i in range(n):
        label = ('dark', 'bright')[i % 2]
        (path/label).mkdir(parents=True, exist_ok=True)
        img = rng.integers(0, 128, (size, size, 3)) + (96 if label == 'bright' else 0)
        Image.fromarray(img.astype(np.uint8)).save(path/label/f'{i}.jpg')

def run(a):
    import torch
    from fastai.vision.all import ImageDataLoaders, Resize, aug_transforms, vision_learner, resnet34, accuracy, Callback
    from fastxtend_compile import CompilerCallback
    class EpochTimes(Callback):
        order = 100
        def before_fit(self): self.times = getattr(self, 'times', [])
        def before_epoch(self): self.t = time.perf_counter()
        def after_epoch(self):
            if torch.cuda.is_available(): torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t)
    with tempfile.TemporaryDirectory() as tmp:
        write_images(Path(tmp), a.n, a.size)
        # 20% validation: a last validation batch smaller than the others, as on most real data sets
        dls = ImageDataLoaders.from_folder(tmp, valid_pct=0.2, seed=0, item_tfms=Resize(a.size), batch_tfms=aug_transforms(),
                                           bs=a.bs, num_workers=a.workers, device=a.device)
        timer = EpochTimes()
        learn = vision_learner(dls, resnet34, pretrained=False, metrics=accuracy, cbs=timer)
        if a.device == 'cuda': learn = learn.to_bf16()
        if not a.eager: learn.compile(backend='inductor' if a.device == 'cuda' else 'aot_eager')
        t = time.perf_counter()
        with learn.no_bar(): learn.fine_tune(a.epochs)
        total = time.perf_counter() - t
    res = dict(arm='eager' if a.eager else 'compiled', total_s=total, epoch_s=timer.times, torch=torch.__version__,
               device=torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu', n=a.n, size=a.size, bs=a.bs,
               epochs=a.epochs, workers=a.workers)
    print(f"fine_tune({a.epochs}) {res['arm']} took {total:.1f}s on {res['device']}, torch {torch.__version__}; epochs "
          + ', '.join(f'{s:.2f}' for s in timer.times))
    if not a.eager:
        r = learn.compiler.report
        from torch._dynamo.utils import compile_times
        res.update(compile_s=r.compile_seconds, graphs=r.graphs, recompiles=len(r.recompiles), fallbacks=len(r.fallbacks),
                   eager_calls=sum(r.eager_calls.values()), compiled_step=r.compiled_step, eager_step=r.eager_step,
                   data_share=r.data_share, payoff=r.payoff(), summary=r.summary(), compile_times=compile_times(repr='str'))
        print(r.summary())
    if a.json: Path(a.json).write_text(json.dumps(res, indent=1))

def arms(a):
    "Each arm in its own process: eager; compiled with a fresh inductor cache (cold); compiled again on that cache (warm)"
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    cache = tempfile.mkdtemp(prefix='inductor-')
    base = [sys.executable, __file__, '--n', str(a.n), '--size', str(a.size), '--epochs', str(a.epochs), '--bs', str(a.bs),
            '--workers', str(a.workers), '--device', a.device]
    for arm in a.arms.split(','):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache if arm in ('cold', 'warm') else tempfile.mkdtemp(prefix='inductor-'))
        subprocess.run(base + (['--eager'] if arm == 'eager' else []) + ['--json', str(out/f'{arm}.json')], env=env, check=True)

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('--n', type=int, default=1200); p.add_argument('--size', type=int, default=64)
    p.add_argument('--epochs', type=int, default=1); p.add_argument('--bs', type=int, default=64)
    p.add_argument('--workers', type=int, default=0)
    p.add_argument('--device', default=None)
    p.add_argument('--eager', action='store_true'); p.add_argument('--json')
    p.add_argument('--arms'); p.add_argument('--out', default='.')
    a = p.parse_args()
    if a.device is None:
        import torch
        a.device = 'cuda' if torch.cuda.is_available() else 'cpu'
    arms(a) if a.arms else run(a)
