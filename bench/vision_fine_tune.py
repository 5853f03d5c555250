"""A fastai vision workflow, compiled: images on disk -> `ImageDataLoaders` -> `vision_learner(resnet34).to_bf16().compile()`
-> `fine_tune`. Prints the compile report: graphs, graph breaks, recompiles and eager fallbacks.
Usage: python bench/vision_fine_tune.py [--n 1200] [--size 64] [--epochs 1] [--device cuda]"""
import argparse, tempfile, time
from pathlib import Path
import numpy as np
from PIL import Image
from fastai.vision.all import *
from fastxtend_compile import *

def write_images(path:Path, n:int, size:int, seed:int=0):
    "Two classes of random images, one brighter than the other, written as JPEG files"
    rng = np.random.default_rng(seed)
    for i in range(n):
        label = ('dark', 'bright')[i % 2]
        (path/label).mkdir(parents=True, exist_ok=True)
        img = rng.integers(0, 128, (size, size, 3)) + (96 if label == 'bright' else 0)
        Image.fromarray(img.astype(np.uint8)).save(path/label/f'{i}.jpg')

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('--n', type=int, default=1200); p.add_argument('--size', type=int, default=64)
    p.add_argument('--epochs', type=int, default=1); p.add_argument('--bs', type=int, default=64)
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_images(Path(tmp), a.n, a.size)
        # 20% validation: a last validation batch smaller than the others, as on most real data sets
        dls = ImageDataLoaders.from_folder(tmp, valid_pct=0.2, seed=0, item_tfms=Resize(a.size), batch_tfms=aug_transforms(),
                                           bs=a.bs, num_workers=0, device=a.device)
        learn = vision_learner(dls, resnet34, pretrained=False, metrics=accuracy)
        if a.device == 'cuda': learn = learn.to_bf16()
        learn.compile(backend='inductor' if a.device == 'cuda' else 'aot_eager')
        t = time.perf_counter()
        learn.fine_tune(a.epochs)
        print(f'fine_tune({a.epochs}) took {time.perf_counter()-t:.1f}s on {a.device}, torch {torch.__version__}')
        print(learn.compiler.report.summary())
