"""Workflow benchmarks: fastai used as its users use it, eager against `learn.compile()`.

Each workflow builds its data and `Learner` the way a fastai user does and runs the usual fit (`fine_tune` or
`fit_one_cycle`), once per *arm*, each arm in a process of its own:

    vision      JPEG files on disk -> ImageDataLoaders.from_folder(Resize, aug_transforms) -> vision_learner(resnet34,
                pretrained=False) (.to_bf16() on CUDA) -> fine_tune
    vision-big  the same with larger images already at their training size and resnet50: the GPU, not the DataLoader,
                bounds it
    segmentation  PNG images and masks on disk -> SegmentationDataLoaders.from_label_func(aug_transforms) ->
                unet_learner(resnet34, pretrained=False) (.to_bf16() on CUDA) -> fine_tune
    tabular     a synthetic DataFrame -> TabularDataLoaders.from_df(Categorify, FillMissing, Normalize) ->
                tabular_learner(layers=[200,100]) -> fit_one_cycle
    text        synthetic token sequences -> fastai Datasets/DataLoaders -> a transformer encoder classifier
                (nn.TransformerEncoder) (.to_bf16() on CUDA) -> fit_one_cycle
    text-small  the same with a small transformer and short sequences: the host's kernel launches, not the GPU, bound
                its step
    awd-lstm    synthetic sentences from word lists in a DataFrame -> TextDataLoaders.from_df (spaCy's tokenizer where
                installed, else fastai's BaseTokenizer) -> text_classifier_learner(AWD_LSTM, pretrained=False) -> fit_one_cycle

    eager         no compiling, fastai's default optimizer (`Adam`)
    eager-fused   no compiling, torch's fused AdamW wrapped for fastai (OptimWrapper) with fastai's Adam defaults
                  (betas (0.9, 0.99), eps 1e-5, weight decay 0.01, decoupled): what a user picks instead of compiling.
                  Fused on the CPU too, where torch has the kernel for float32
    compile-cold  learn.compile(background=False): compiled in the fit's path, fresh TORCHINDUCTOR_CACHE_DIR
    compile-warm  learn.compile() in a new process on a copy of compile-cold's cache dir (inductor's on-disk caches warm)
    compile-saved learn.compile() in a new process with a fresh cache dir, after learn.load_compile_cache() of the file
                  compile-cold saved with learn.save_compile_cache(): a warm start on another machine
    compile-ro    learn.compile(mode='reduce-overhead') (CUDA graphs), fresh cache dir; CUDA only
    regional-cold, regional-warm, regional-saved   the same with learn.compile(regional=True): only the repeated blocks
                  (ResNet's residual blocks, transformer layers), each compiled once for its twins
    valid-cold, valid-warm, valid-saved   the same with learn.compile(compile_valid=True): the fit's validation compiled
                  too (its evaluation graph), where learn.compile() runs it eagerly
    background-cold learn.compile(background=True): the fit trains eagerly while a worker process compiles, then the
                  compiled code takes over; fresh cache dir
    background-warm the same in a new process on a copy of background-cold's cache dir
                  (both name mode='default', which keeps a fit on the default mode: no faster tier)
    tiers-cold, tiers-warm   learn.compile(background=True) with `mode` unset: once the default mode's code runs, a
                  faster tier (CUDA graphs for a launch-bound step, autotuned kernels for a GPU-bound one) compiles in
                  the worker and takes over where an A/B on the fit's batches finds it faster. Tiers are tried on
                  CUDA alone: on the CPU these arms are a background compile of the default mode
    unfrozen-cold, unfrozen-warm   as tiers-cold and tiers-warm, with Python's collector left unfrozen during the fit
                  (`GCFreeze.on = False`), so its full collections visit every object the compiles made; unfrozen-warm
                  starts from tiers-cold's cache, as tiers-warm does
    unwarmed-cold   as tiers-cold, with inductor's Triton compile processes started by inductor once TorchDynamo
                  has traced the graph, not as the fit's first compile starts, nor as a worker process starts up
                  (`CompileWorkers.on = False`)
    noprefetch-cold   as tiers-cold, with no training batch copied ahead: the DataLoader copies each in the fit's
                  thread, as fastai does
    Every other compiled arm passes background=False: it compiles in the fit's path.
    --get-preds   also times learn.get_preds() on the validation set right after the fit, in every arm
    precompile-cold, precompile-warm, precompile-saved   the same with learn.compile(precompile=True): TorchDynamo's traced
                  code saved with the compile cache, so the warm and saved arms don't trace the model (torch 2.15+;
                  inductor only, so left out of a default run with another backend)

    python bench/workflow.py --workflows vision,vision-big,tabular,text --arms eager,compile-cold,compile-warm,compile-ro --out DIR
    python bench/workflow.py --smoke --out /tmp/wf-smoke     # every workflow but text-small, tiny, on the CPU
    bash bench/first_run.sh DIR text 3                       # the first run of learn.compile() against eager-fused, on a GPU
    python bench/workflow.py --workflows vision --arms compile-cold --compile-kwargs '{"options": {"loop_ordering_after_fusion": false}}'
                                                             # inductor's options, against the default compile

A kind of compile is one entry of `KINDS`, which gives it its arms. Each compiled arm's record has TorchDynamo's
compile time by phase (`phases`): where a cold or warm start's seconds go.

Writes DIR/workflow.json (every number), DIR/workflow.md (a table per workflow, its ratios against eager and against
eager-fused where that arm ran) and DIR/arms.log (each process's command and the end of its output), rewriting them
after every arm. Exits with status 1 when an arm failed.
"""
from __future__ import annotations
import argparse, collections, datetime, json, os, shutil, statistics, sys, tempfile, threading, time
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from procs import ROOT, arm_env, core_share, env_line, error_line, git_commit, log_process, run_jobs, run_process, versions

# A compiled arm is a kind of `learn.compile()` call started one of three ways: `cold`, with a fresh inductor cache;
# `warm`, a new process on the cold run's cache; `saved`, a fresh cache after `learn.load_compile_cache()` of the file
# the cold run wrote with `learn.save_compile_cache()` (a warm start on another machine). A kind of compile to measure
# is one entry here: its `learn.compile` arguments, a few words for the tables, and the starts it runs. Every kind but
# `background` compiles in the fit's path (`background=False`).
KINDS = {
    'compile':    ({}, '`learn.compile()`', ('cold', 'warm', 'saved')),
    'regional':   (dict(regional=True), '`learn.compile(regional=True)`: only the repeated blocks compiled', ('cold', 'warm', 'saved')),
    'valid':      (dict(compile_valid=True), "`learn.compile(compile_valid=True)`: the fit's validation compiled too", ('cold', 'warm', 'saved')),
    'precompile': (dict(precompile=True), "`learn.compile(precompile=True)`: TorchDynamo's traced code saved with the compile cache", ('cold', 'warm', 'saved')),
    'background': (dict(background=True, mode='default'), '`learn.compile(background=True)`: trains eagerly while a worker process '
                   'compiles; the default mode named, so no faster tier', ('cold', 'warm')),
    'tiers':      (dict(background=True), '`learn.compile(background=True)`, `mode` unset: the default tier takes over, then a faster '
                   'tier where the measured step has one (tried on CUDA alone)', ('cold', 'warm')),
    'unfrozen':   (dict(background=True), "as *tiers*, with Python's collector left unfrozen during the fit (`GCFreeze.on = False`): "
                   "its full collections visit every object", ('cold', 'warm')),
    'unwarmed':   (dict(background=True), "as *tiers*, with inductor's Triton compile processes started by inductor once TorchDynamo "
                   "has traced the graph, not as the fit's first compile starts, nor as a worker process starts up (`CompileWorkers.on = False`)", ('cold',)),
    'bar':        (dict(background=True), "`learn.compile(background=True)` on *tiers-cold*'s cache, as *tiers-warm*, with fastai's progress bar shown, as users train", ('warm',)),
    'noprefetch': (dict(background=True), "as *tiers*, with no batch copied ahead: the `DataLoader` copies each in the fit's thread, as "
                   "fastai does", ('cold',)),
    'loader':     (dict(background=True), "as *tiers-warm*, on *tiers-cold*'s cache, with every batch received from the `DataLoader`'s workers "
                   "and copied in the fit's thread when it asks for it, as the library does for a loader without workers", ('warm',)),
}
EAGER = ('eager', 'eager-fused') # Arms that compile nothing: fastai's `Adam`, and torch's fused AdamW (`fused_adamw`)
ARMS = (*EAGER, *(f'compile-{s}' for s in KINDS['compile'][2]), 'compile-ro',
        *(f'{k}-{s}' for k,(_,_,starts) in KINDS.items() if k != 'compile' for s in starts))
ARM_MODE = {a: None if a in EAGER else 'reduce-overhead' if a == 'compile-ro' else 'default' for a in ARMS}
ARM_KWARGS = {a: {'background': False, **KINDS[a.split('-')[0]][0]} for a in ARMS if a not in EAGER}
# Arms that start from what a cold run left; *unfrozen-warm*, *bar-warm* and *loader-warm* from *tiers-cold*'s, beside *tiers-warm*
COLD_OF = {a: ('tiers' if a.startswith(('unfrozen-', 'bar-', 'loader-')) else a.rsplit('-', 1)[0]) + '-cold' for a in ARMS if a.endswith(('-warm', '-saved'))}
INDUCTOR_ONLY = ('precompile',) # Kinds left out of a default run with another backend

# Sizes: `gpu` is the default, `smoke` a tiny CPU check of the same code paths. `--config` overrides either.
WORKFLOWS = {
    'vision': dict(
        gpu=dict(n=6000, size=128, bs=64, epochs=3, arch='resnet34', classes=5, valid_pct=0.2, stored=160),
        smoke=dict(n=48, size=32, bs=8, epochs=1, arch='resnet34', classes=3, valid_pct=0.2, stored=40)),
    'vision-big': dict(
        gpu=dict(n=4000, size=224, bs=64, epochs=2, arch='resnet50', classes=5, valid_pct=0.2, stored=224),
        smoke=dict(n=40, size=32, bs=8, epochs=1, arch='resnet50', classes=3, valid_pct=0.2, stored=32)),
    'segmentation': dict(
        gpu=dict(n=2000, size=192, bs=16, epochs=2, arch='resnet34', valid_pct=0.2),
        smoke=dict(n=24, size=32, bs=4, epochs=1, arch='resnet34', valid_pct=0.25)),
    'tabular': dict(
        gpu=dict(rows=200_000, bs=1024, epochs=3, layers=[200, 100], valid_pct=0.2),
        smoke=dict(rows=3000, bs=256, epochs=2, layers=[200, 100], valid_pct=0.2)),
    'text': dict(
        gpu=dict(n=40_000, seq=256, vocab=8000, d=384, layers=6, heads=6, classes=4, bs=64, epochs=3, valid_pct=0.2),
        smoke=dict(n=400, seq=32, vocab=200, d=32, layers=2, heads=2, classes=4, bs=16, epochs=2, valid_pct=0.2)),
    # Sized for an eager fit of ~45 s on an H100: 1,000 batches an epoch, each ~8-10 ms of the host's launches
    'text-small': dict(
        gpu=dict(n=40_000, seq=64, vocab=8000, d=128, layers=4, heads=4, classes=4, bs=32, epochs=5, valid_pct=0.2),
        smoke=dict(n=400, seq=16, vocab=200, d=16, layers=2, heads=2, classes=4, bs=16, epochs=2, valid_pct=0.2)),
    'awd-lstm': dict(
        gpu=dict(rows=6000, words=(20, 80), classes=3, bs=64, seq_len=72, epochs=3, valid_pct=0.2),
        smoke=dict(rows=120, words=(8, 16), classes=3, bs=16, seq_len=16, epochs=1, valid_pct=0.2)),
}

def describe(w:str, c:dict)->str:
    "A workflow's sizes in a few words"
    if w.startswith('vision'):
        return (f"{c['n']} JPEGs stored at {c['stored']} px, {c['classes']} classes, Resize({c['size']}) + aug_transforms, "
                f"{c['arch']} (pretrained=False), bs {c['bs']}, fine_tune({c['epochs']})")
    if w == 'segmentation':
        return (f"{c['n']} PNG images and masks at {c['size']} px, a square to find on a patterned background, aug_transforms, "
                f"unet_learner({c['arch']}, pretrained=False), bs {c['bs']}, fine_tune({c['epochs']})")
    if w == 'awd-lstm':
        return (f"{c['rows']:,} synthetic sentences of {c['words'][0]}–{c['words'][1]} words, {c['classes']} classes, "
                f"TextDataLoaders.from_df, text_classifier_learner(AWD_LSTM, pretrained=False), bs {c['bs']}, "
                f"seq_len {c['seq_len']}, fit_one_cycle({c['epochs']})")
    if w == 'tabular':
        return f"{c['rows']:,} rows, 4 categorical + 6 continuous columns, tabular_learner(layers={c['layers']}), bs {c['bs']}, fit_one_cycle({c['epochs']})"
    return (f"{c['n']:,} sequences of {c['seq']} tokens, vocab {c['vocab']}, nn.TransformerEncoder {c['layers']} layers, "
            f"d={c['d']}, {c['heads']} heads, {c['classes']} classes, bs {c['bs']}, fit_one_cycle({c['epochs']})")

def n_valid(n:int, pct:float, bs:int)->int:
    "Validation items: about `pct` of `n`, never a multiple of `bs`, so the last validation batch is smaller, as on real data"
    v = max(1, round(n*pct))
    return v - 1 if v % bs == 0 and v > 1 else v

# ---------------------------------------------------------------------------------------------------------------------
# Data written once per workflow by the driver, shared by its arms

def _pattern(kind:int, size:int, rng):
    "An image of class `kind`: stripes of one of several orientations, a checkerboard or rings, tinted and noisy"
    import numpy as np
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    f, ph = rng.uniform(3, 7) * 2 * np.pi, rng.uniform(0, 2 * np.pi)
    k = kind % 5
    if k == 0: v = np.sin(f*yy + ph)
    elif k == 1: v = np.sin(f*xx + ph)
    elif k == 2: v = np.sin(f*(xx + yy)/1.4 + ph)
    elif k == 3: v = np.sign(np.sin(f*xx + ph) * np.sin(f*yy + ph))
    else: v = np.sin(f*np.hypot(xx - rng.uniform(.3, .7), yy - rng.uniform(.3, .7)) + ph)
    color = rng.uniform(0.3, 1.0, 3) * (1 + kind // 5) # Classes past 5 repeat the patterns at another brightness
    img = (v[..., None] * 0.5 + 0.5) * color * 200 + rng.normal(0, 20, (size, size, 3))
    return img.clip(0, 255).astype(np.uint8)

def _write_images(args):
    root, items, size, seed = args
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    for split, cls, i in items:
        d = Path(root)/split/f'c{cls}'
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(_pattern(cls, size, rng)).save(d/f'{i}.jpg', quality=90)

def _in_parallel(write, root:Path, items:list, size:int)->float:
    "Seconds `write` took on chunks of `items` (image files of `size` px in `root`), in worker processes unless they are few"
    from concurrent.futures import ProcessPoolExecutor
    workers = max(1, min(8, os.cpu_count() or 1))
    chunks = [(str(root), items[j::workers*4], size, j) for j in range(workers*4)]
    t = time.perf_counter()
    if workers == 1 or len(items) < 200:
        for ch in chunks: write(ch)
    else:
        with ProcessPoolExecutor(workers) as ex: list(ex.map(write, chunks))
    return time.perf_counter() - t

def write_images(root:Path, c:dict)->dict:
    "JPEG files in `root/train/<class>` and `root/valid/<class>`, written in parallel"
    nv = n_valid(c['n'], c['valid_pct'], c['bs'])
    items = [('valid' if i < nv else 'train', i % c['classes'], i) for i in range(c['n'])]
    return dict(train=c['n'] - nv, valid=nv, write_s=_in_parallel(_write_images, root, items, c['stored']))

def _write_segmentation(args):
    root, items, size, seed = args
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    for i in items:
        img, mask = _pattern(i % 5, size, rng), np.zeros((size, size), np.uint8)
        s = rng.integers(size//6, size//3)
        x, y = rng.integers(0, size - s, 2)
        mask[y:y+s, x:x+s] = 1
        img[y:y+s, x:x+s] = (img[y:y+s, x:x+s] * 0.4 + 150).astype(np.uint8) # A lighter, flatter square
        Image.fromarray(img).save(Path(root)/'images'/f'{i}.png'); Image.fromarray(mask).save(Path(root)/'masks'/f'{i}.png')

def write_segmentation(root:Path, c:dict)->dict:
    "PNG images in `root/images` and their masks (0: background, 1: the square) in `root/masks`, written in parallel"
    for d in ('images', 'masks'): (root/d).mkdir(parents=True, exist_ok=True)
    return dict(n=c['n'], write_s=_in_parallel(_write_segmentation, root, list(range(c['n'])), c['size']))

# ---------------------------------------------------------------------------------------------------------------------
# One arm, in this process (`--child`)

def build_vision(w, c, data, device, num_workers):
    from fastai.vision.all import ImageDataLoaders, Resize, aug_transforms, vision_learner, accuracy
    import fastai.vision.all as fv
    kw = {} if num_workers is None else dict(num_workers=num_workers)
    dls = ImageDataLoaders.from_folder(data, train='train', valid='valid', item_tfms=Resize(c['size']),
                                       batch_tfms=aug_transforms(), bs=c['bs'], device=device, **kw)
    learn = vision_learner(dls, getattr(fv, c['arch']), pretrained=False, metrics=accuracy)
    if device == 'cuda': learn = learn.to_bf16()
    return learn, lambda: learn.fine_tune(c['epochs'])

def _mask_of(image:Path)->Path: return image.parent.parent/'masks'/image.name

def build_segmentation(w, c, data, device, num_workers):
    from fastai.vision.all import SegmentationDataLoaders, get_image_files, aug_transforms, unet_learner, Dice
    import fastai.vision.all as fv
    kw = {} if num_workers is None else dict(num_workers=num_workers)
    dls = SegmentationDataLoaders.from_label_func(data, get_image_files(Path(data)/'images'), _mask_of, codes=['background', 'square'],
                                                  valid_pct=c['valid_pct'], seed=0, batch_tfms=aug_transforms(), bs=c['bs'],
                                                  device=device, **kw)
    learn = unet_learner(dls, getattr(fv, c['arch']), pretrained=False, metrics=Dice())
    if device == 'cuda': learn = learn.to_bf16()
    return learn, lambda: learn.fine_tune(c['epochs'])

def tabular_frame(c:dict):
    "A DataFrame with a target that depends on categorical and continuous columns, and some missing values"
    import numpy as np, pandas as pd
    rng = np.random.default_rng(0)
    n = c['rows']
    df = pd.DataFrame()
    logit = np.zeros(n)
    for name, levels in (('shop', 12), ('region', 40), ('product', 300), ('weekday', 7)):
        idx = rng.integers(0, levels, n)
        df[name] = np.array([f'{name}{i}' for i in range(levels)])[idx]
        logit += rng.normal(0, 1, levels)[idx]
    x = rng.normal(0, 1, (n, 6)).astype(np.float32)
    logit += 0.8*x[:, 0] - 0.6*x[:, 1]*x[:, 2] + np.sin(2*x[:, 3]) + 0.3*x[:, 4]**2 + rng.normal(0, 0.5, n)
    for j in range(6): df[f'x{j}'] = x[:, j]
    df.loc[rng.random(n) < 0.05, 'x0'] = np.nan # FillMissing has something to do
    df.loc[rng.random(n) < 0.05, 'x5'] = np.nan
    df['y'] = np.where(logit > np.median(logit), 'high', 'low')
    return df

def build_tabular(w, c, data, device, num_workers):
    import numpy as np
    from fastai.tabular.all import TabularDataLoaders, Categorify, FillMissing, Normalize, CategoryBlock, tabular_learner, accuracy
    df = tabular_frame(c)
    valid_idx = np.random.default_rng(1).permutation(len(df))[:n_valid(len(df), c['valid_pct'], c['bs'])].tolist()
    kw = {} if num_workers is None else dict(num_workers=num_workers)
    dls = TabularDataLoaders.from_df(df, procs=[Categorify, FillMissing, Normalize], cat_names=['shop', 'region', 'product', 'weekday'],
                                     cont_names=[f'x{j}' for j in range(6)], y_names='y', y_block=CategoryBlock(),
                                     valid_idx=valid_idx, bs=c['bs'], device=device, **kw)
    learn = tabular_learner(dls, layers=c['layers'], metrics=accuracy)
    return learn, lambda: learn.fit_one_cycle(c['epochs'])

def build_text(w, c, data, device, num_workers):
    import numpy as np, torch
    from fastai.text.all import Transform, TensorText, Datasets, Categorize, Learner, CrossEntropyLossFlat, accuracy
    from arm import TextClassifier # A class defined in this function would leave `precompile=True` out

    class Tokens(Transform):
        "Item index -> its token ids"
        def __init__(self, toks): self.toks = toks
        def encodes(self, i:int): return TensorText(torch.from_numpy(self.toks[i]))

    class Label(Transform):
        def __init__(self, labels): self.labels = labels
        def encodes(self, i:int): return self.labels[i]

    # Random tokens; each sequence plants 8 tokens of its class's group of 8 token ids, at random places
    rng = np.random.default_rng(0)
    n, seq, k = c['n'], c['seq'], c['classes']
    toks = rng.integers(1 + 8*k, c['vocab'], (n, seq))
    labels = rng.integers(0, k, n)
    pos = np.argsort(rng.random((n, seq)), axis=1)[:, :8]
    toks[np.arange(n)[:, None], pos] = 1 + 8*labels[:, None] + rng.integers(0, 8, (n, 8))
    names = [f'class{i}' for i in labels]
    nv = n_valid(n, c['valid_pct'], c['bs'])
    dsets = Datasets(list(range(n)), tfms=[[Tokens(toks)], [Label(names), Categorize()]], splits=(list(range(nv, n)), list(range(nv))))
    kw = {} if num_workers is None else dict(num_workers=num_workers)
    dls = dsets.dataloaders(bs=c['bs'], device=device, **kw)
    model = TextClassifier(c['vocab'], seq, c['d'], c['layers'], c['heads'], k)
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    if device == 'cuda': learn = learn.to_bf16()
    return learn, lambda: learn.fit_one_cycle(c['epochs'], 1e-3)

# Words every class uses, and each class's own: a sentence mixes them, a few of its class's words among the rest
COMMON = ('the a of and to in is was it for on with as at by from this that but not all were when we there can an your '
          'which their said if do will each about how up out them then she many some so these would other into has more').split()
TOPICS = [('goal match team coach season player score league final striker keeper referee stadium fans transfer').split(),
          ('market shares profit bank price investor growth rate fund stock earnings trade debt merger budget').split(),
          ('planet orbit telescope galaxy star rocket mission comet lunar solar crater probe nebula gravity asteroid').split(),
          ('recipe oven flour butter sugar garlic onion sauce bake roast simmer pepper salad dough spice').split()]

def text_frame(c:dict):
    "A DataFrame of sentences (`text`), their class (`label`) and `is_valid`, made from the word lists above"
    import numpy as np, pandas as pd
    rng = np.random.default_rng(0)
    n, k = c['rows'], c['classes']
    labels = rng.integers(0, k, n)
    texts = []
    for y in labels:
        words = list(rng.choice(COMMON, rng.integers(*c['words'])))
        for i in rng.integers(0, len(words), max(2, len(words)//8)): words[i] = rng.choice(TOPICS[y % len(TOPICS)])
        texts.append(' '.join(words).capitalize() + '.')
    valid = np.zeros(n, bool)
    valid[:n_valid(n, c['valid_pct'], c['bs'])] = True
    return pd.DataFrame(dict(text=texts, label=[f'topic{y}' for y in labels], is_valid=valid))

def build_awd_lstm(w, c, data, device, num_workers):
    from fastai.text.all import TextDataLoaders, text_classifier_learner, AWD_LSTM, BaseTokenizer, accuracy
    try: import spacy # noqa: F401 (fastai's default tokenizer)
    except ImportError: tok = BaseTokenizer() # Splits on spaces: the same words for these sentences
    else: tok = None
    kw = {} if num_workers is None else dict(num_workers=num_workers)
    dls = TextDataLoaders.from_df(text_frame(c), text_col='text', label_col='label', valid_col='is_valid', tok_tfm=tok,
                                  seq_len=c['seq_len'], bs=c['bs'], device=device, **kw)
    learn = text_classifier_learner(dls, AWD_LSTM, pretrained=False, metrics=accuracy)
    return learn, lambda: learn.fit_one_cycle(c['epochs'])

def _num(v):
    try: return float(v)
    except Exception: return str(v)

BUILDERS = {'vision': build_vision, 'vision-big': build_vision, 'segmentation': build_segmentation, 'tabular': build_tabular,
            'text': build_text, 'text-small': build_text, 'awd-lstm': build_awd_lstm}

def fused_adamw():
    "torch's fused `AdamW` as a fastai `opt_func`, with the hyper-parameters fastai's default `Adam` has"
    import torch
    from fastai.optimizer import OptimWrapper
    # A Learner passes `lr` alone, and `fit_one_cycle` schedules `lr` and `mom` (OptimWrapper maps `mom` to `betas[0]`);
    # the rest are `Adam`'s defaults, its weight decay decoupled as AdamW's is
    return partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01))

def compile_phases()->str|None:
    "TorchDynamo's compile time by phase (tracing, AOTAutograd, inductor's code generation, cache loads), as it prints it"
    try:
        from torch._dynamo.utils import compile_times
        return compile_times(repr='str')
    except Exception: return None

def child(spec:dict)->dict:
    t_start = time.perf_counter()
    sys.path.insert(0, str(ROOT)) # The checkout's `fastxtend_compile`, installed or not
    import warnings
    import torch
    from fastai.callback.core import Callback
    import fastxtend_compile # noqa: F401 (applies the patches; `learn.compile`)
    # Every arm imports TorchDynamo before its fit is timed, once a process as a notebook does: torch's fused AdamW imports it
    # as it is made, in the eager-fused arm's fit, and `learn.compile()` before its fit (4-5 s on an H100 host)
    import torch._dynamo # noqa: F401
    w, arm, c, device = spec['workflow'], spec['arm'], spec['config'], spec['device']
    cuda = device == 'cuda'
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.zeros(1, device='cuda'); sync() # The CUDA context up front
        if spec.get('matmul_precision'): torch.set_float32_matmul_precision(spec['matmul_precision'])
    torch.manual_seed(0)
    t = time.perf_counter()
    learn, fit = BUILDERS[w](w, c, spec.get('data'), device, spec.get('num_workers'))
    if arm == 'eager-fused': learn.opt_func = fused_adamw() # The builders' Learners make their optimizer at the fit (or `fine_tune`'s freeze)
    if arm.startswith('unfrozen-'):
        from fastxtend_compile.gcfreeze import GCFreeze
        GCFreeze.on = False
    if arm.startswith('unwarmed-'):
        from fastxtend_compile.core import CompileWorkers
        CompileWorkers.on = False
    setup_s = time.perf_counter() - t

    epochs = []
    class Start(Callback):
        "Runs first at each event: epoch start, and the end of each wait for a training batch"
        order = -1000
        def before_fit(self): self.fit_i = getattr(self, 'fit_i', -1) + 1
        def before_epoch(self):
            self.rec = dict(fit=self.fit_i, epoch=self.epoch, frozen=bool(getattr(self.opt, 'frozen_idx', 0)), batches=0, data_wait_s=0.)
            self.t_epoch = time.perf_counter()
        def before_train(self): self.t_train = time.perf_counter()
        def before_batch(self):
            if self.training:
                # The first fit's first training batches, each one's start: their pace, whatever runs them (a probe's eager batches)
                if self.fit_i == 0 and self.epoch == 0 and self.rec['batches'] < 40: self.rec.setdefault('starts', []).append(time.perf_counter())
                wait = time.perf_counter() - end.mark
                if not self.rec['batches']: self.rec['first_wait_s'] = wait # The iterator's start (workers forked) and its first batch
                self.rec['data_wait_s'] += wait
                self.rec['batches'] += 1
            elif 'valid_first_s' not in self.rec: self.rec['valid_first_s'] = time.perf_counter() - self.t_valid # Likewise for validation
        def after_train(self): self.rec['data_wait_s'] += time.perf_counter() - end.mark # The iterator's end (workers stopping)
        def before_validate(self): self.t_valid = time.perf_counter()
    class End(Callback):
        "Runs last at each event: where a wait for the next training batch starts, and the synchronized ends of phases"
        order = 1000
        def before_train(self): self.mark = time.perf_counter() # Creating the iterator and the first batch count as waiting
        def after_batch(self):
            if self.training:
                self.mark = time.perf_counter()
                if self.batch_done is not None: self.batch_done()
        batch_done = None # Called at each training batch's end
        def after_train(self):
            sync() # Once a training epoch, so its time includes the GPU's work
            start.rec['train_s'] = time.perf_counter() - start.t_train
        def after_validate(self):
            sync()
            start.rec['valid_s'] = time.perf_counter() - start.t_valid
        def after_epoch(self):
            sync()
            r = start.rec
            r['wall_s'] = time.perf_counter() - start.t_epoch
            r['data_share'] = r['data_wait_s'] / r['train_s'] if r.get('train_s') else None
            vals = self.recorder.log[1:] if hasattr(self, 'recorder') else []
            r['values'] = dict(zip(self.recorder.metric_names[1:-1], [_num(v) for v in vals[:-1]])) if vals else {}
            epochs.append(r)
    start, end = Start(), End()
    learn.add_cbs([start, end])
    if spec.get('pin_bytes') is not None: # The size from which the copy ahead pins a tensor
        import fastxtend_compile.pace as pace
        pace.PIN_BYTES = spec['pin_bytes']
    if arm.startswith('noprefetch-'): # No batch copied ahead
        import fastxtend_compile.pace as pace
        pace.prefetches = lambda dl: False
    if arm.startswith('loader-'): # Every batch received from the loader's workers in the fit's thread
        import fastxtend_compile.pace as pace
        pace._workers = lambda dl: 0
    host_work = library_host_work(end, sync if spec.get('drain') else None) if ARM_MODE[arm] is not None else None
    mode = ARM_MODE[arm]
    if mode is not None:
        kw = dict(spec.get('compile_kwargs') or {}, **ARM_KWARGS.get(arm, {}))
        if spec.get('backend'): kw['backend'] = spec['backend']
        if mode != 'default': kw['mode'] = mode
        learn.compile(**kw)
        if spec.get('load_cache'): # Before the first compile
            t = time.perf_counter()
            cache_loaded = learn.load_compile_cache(spec['load_cache'])
            load_cache_s = time.perf_counter() - t
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        sync()
        t = time.perf_counter()
        with (nullcontext() if spec.get('bar') or arm.startswith('bar-') else learn.no_bar()): fit()
        sync()
        total = time.perf_counter() - t
    warns = list(dict.fromkeys(f"{x.category.__name__}: {x.message}" for x in caught
                               if not issubclass(x.category, (DeprecationWarning, FutureWarning))))
    if spec.get('get_preds'): # Inference right after the fit, as a user's next cell
        sync()
        t = time.perf_counter()
        with learn.no_bar(): learn.get_preds()
        sync()
        get_preds_s = time.perf_counter() - t
    res = dict(workflow=w, arm=arm, repeat=spec['repeat'], status='ok', device=device, config=c, smoke=spec['smoke'],
               backend=spec.get('backend') or ('inductor' if mode else None), mode=mode, compile_kwargs=spec.get('compile_kwargs'),
               num_workers=getattr(getattr(learn.dls.train, 'fake_l', None), 'num_workers', None),
               train_batches=len(learn.dls.train), valid_batches=len(learn.dls.valid),
               valid_last_batch=len(learn.dls.valid_ds) % c['bs'], total_s=total, setup_s=setup_s, epochs=epochs,
               warnings=warns[:20], env=versions(device))
    opt = getattr(learn.opt, 'opt', learn.opt) # An OptimWrapper's torch optimizer
    res['optimizer'] = f"{type(opt).__module__.split('.')[0]}.{type(opt).__name__}" + (' (fused)' if getattr(opt, 'defaults', {}).get('fused') else '')
    if cuda: res['peak_mem_gb'] = torch.cuda.max_memory_allocated() / 2**30
    if spec.get('get_preds'): res['get_preds_s'] = get_preds_s
    if host_work: res['host_work_ms'] = host_work_ms(host_work)
    if spec.get('drain'): res['drained'] = True # Synchronized after each training batch: its times are no timing run's
    try: # Inductor's cache hits and misses in this process: a warm compile hits
        from torch._dynamo.utils import counters
        res['inductor_counters'] = {k: v for k,v in counters['inductor'].items() if 'cache' in k}
        res['aot_autograd_counters'] = {k: v for k,v in counters['aot_autograd'].items() if 'cache' in k or 'autograd_cache' in k}
    except Exception: pass
    if mode is not None:
        cb = getattr(learn, 'compiler', None)
        r = getattr(cb, 'report', None)
        if r is None: res.update(status='error', reason='learn.compiler.report missing after the fit')
        else:
            def get(name, f=lambda v: v):
                try: return f(getattr(r, name))
                except Exception: return None
            res['compile'] = dict(
                compile_s=get('compile_seconds'), graphs=get('graphs'), recompiles=get('recompiles', len),
                fallbacks=get('fallbacks', len), graph_breaks=get('graph_breaks'),
                eager_calls=get('eager_calls', lambda d: sum(d.values())), compiled_step_s=get('compiled_step'),
                eager_step_s=get('eager_step'), report_data_share=get('data_share'),
                eager_times=get('eager_times', lambda v: [round(t, 5) for t in v]), # Each eager batch timed alone: the probe's first
                compiled_batches=get('batch_times', len),
                events=get('events', lambda es: [dict(kind=e.kind, frame=e.frame, seconds=e.seconds, reason=e.reason, during=e.during) for e in es]),
                gc=get('gc_pauses', lambda v: dict(n=len(v), s=round(sum(v), 3))),
                background=get('background'), payoff=r.payoff() if hasattr(r, 'payoff') else None, summary=r.summary() if hasattr(r, 'summary') else str(r),
                phases=compile_phases())
            print(res['compile']['summary'])
    if spec.get('load_cache'): res.update(cache_loaded=cache_loaded, load_cache_s=load_cache_s)
    if spec.get('save_cache'):
        f = learn.save_compile_cache(spec['save_cache'])
        res['saved_cache_mb'] = f.stat().st_size/2**20 if f else None
    res['process_s'] = time.perf_counter() - t_start # Imports not included: the driver also records the whole process
    print(f"{w} {arm}: fit {total:.1f}s; epochs " + ', '.join(f"{e['wall_s']:.2f}" for e in epochs))
    return res

# ---------------------------------------------------------------------------------------------------------------------
# Driver

def plan(workflows, arms, repeat, smoke_default=False)->list:
    "(workflow, arm, repeat) jobs, each compile-warm after its compile-cold (which runs even when not asked for)"
    # The smoke run's default: a warm process for one workflow only, as `aot_eager` has no on-disk cache to warm
    warm_for = [w for w in workflows if w == 'tabular'][:1] or workflows[:1] if smoke_default else workflows
    jobs = []
    for w in workflows:
        for rep in range(repeat):
            for a in ARMS:
                if a in COLD_OF and w not in warm_for: continue
                if a not in arms and not any(COLD_OF.get(x) == a for x in arms): continue
                jobs.append((w, a, rep))
    return jobs

def run_job(args, job, spec_base, caches:dict, tmp:Path, log, slot:int|None=None)->dict:
    "Run one arm's process; `slot` i of `--gpus`: on GPU i alone, pinned to its share of the cores"
    w, arm, rep = job
    if arm == 'compile-ro' and args.device != 'cuda':
        return dict(workflow=w, arm=arm, repeat=rep, status='skipped', reason="reduce-overhead (CUDA graphs) needs a GPU")
    if arm in COLD_OF and (w, COLD_OF[arm], rep) not in caches:
        return dict(workflow=w, arm=arm, repeat=rep, status='skipped', reason=f'its {COLD_OF[arm]} run did not run')
    cache = Path(tempfile.mkdtemp(prefix=f'{w}-{arm}-{rep}-', dir=tmp))
    # Each warm arm starts from a copy of the cache its cold run left: not from what another warm arm added to it
    if arm.endswith('-warm'): shutil.copytree(caches[(w, COLD_OF[arm], rep)], cache, dirs_exist_ok=True)
    elif arm.endswith('-cold'): caches[(w, arm, rep)] = cache
    spec = dict(spec_base[w], arm=arm, repeat=rep)
    # A cold arm saves its compile cache as a `.compile` file, which its saved arm loads
    if arm.endswith('-cold'): spec['save_cache'] = str(tmp/f'{w}-{arm}-{rep}')
    if arm.endswith('-saved'): spec['load_cache'] = str(tmp/f'{w}-{COLD_OF[arm]}-{rep}')
    spec_path, result = tmp/f'{w}-{arm}-{rep}.spec.json', tmp/f'{w}-{arm}-{rep}.json'
    spec_path.write_text(json.dumps(spec))
    cmd, env = [sys.executable, Path(__file__).resolve(), '--child', spec_path, '--result', result], arm_env(cache)
    if slot is not None:
        env['CUDA_VISIBLE_DEVICES'] = str(slot)
        if shutil.which('taskset'): cmd = ['taskset', '-c', ','.join(map(str, core_share(slot, args.gpus)))] + cmd
    fin = run_process(cmd, env, args.timeout, cwd=ROOT)
    tail = log_process(log, f"{w} {arm} run {rep} (TORCHINDUCTOR_CACHE_DIR={cache})", cmd, fin, lines=80)
    if result.exists() and fin.rc == 0: rec = json.loads(result.read_text())
    else:
        rec = dict(workflow=w, arm=arm, repeat=rep, status='timeout' if fin.timed_out else 'error',
                   reason=f'timed out after {args.timeout:.0f}s' if fin.timed_out else f'exit {fin.rc}: ' + error_line(tail)[:300],
                   log_tail=tail[-3000:])
    rec['process_wall_s'] = fin.wall
    return rec

def run_copies(args, job, spec_base, caches:dict, tmp:Path, log)->dict|list:
    "`job` once, or with `--gpus` N as N runs at once, run i on GPU i (repeat `repeat*N + i`): every run of an arm meets the same neighbours"
    if args.gpus == 1: return run_job(args, job, spec_base, caches, tmp, log)
    w, arm, rep = job
    with ThreadPoolExecutor(args.gpus) as ex:
        return list(ex.map(lambda i: run_job(args, (w, arm, rep*args.gpus + i), spec_base, caches, tmp, log, slot=i), range(args.gpus)))

def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

def library_host_work(end, drain=None)->list:
    "Seconds of the fit's thread's time each training batch spends in the library's own code, by part: `CompilerCallback`'s events, the batch copied ahead; `drain()` after each"
    from fastxtend_compile.callback import CompilerCallback
    from fastxtend_compile.pace import Prefetch
    spent, per_batch = collections.Counter(), []
    def timed(f, part=None):
        def inner(*args, **kwargs):
            t = time.perf_counter()
            try: return f(*args, **kwargs)
            finally: spent[part or args[1]] += time.perf_counter() - t # A callback's event, by its name
        return inner
    CompilerCallback.__call__ = timed(CompilerCallback.__call__)
    # The fit's thread has each batch made ready for its step; without the loader's workers it queues each batch's copy
    # too, where the copying thread queues them beside it with workers
    copy, copied = Prefetch._copy, timed(Prefetch._copy, 'batch copied')
    Prefetch._copy = lambda self, b: (copied if threading.current_thread() is threading.main_thread() else copy)(self, b)
    Prefetch._ready = timed(Prefetch._ready, 'batch ready')
    def batch_done():
        per_batch.append(dict(spent)); spent.clear()
        if drain is not None: drain() # The next batch's calls find the GPU's queue empty: none of them waits for room in it
    end.batch_done = batch_done
    return per_batch

def host_work_ms(per_batch:list)->dict:
    "The median of the library's host time a training batch over the fit's second half, and of each part's"
    half = per_batch[len(per_batch)//2:]
    parts = {k for b in half for k in b}
    return dict(median=1e3*statistics.median(sum(b.values()) for b in half), batches=len(half),
                parts={k: round(1e3*statistics.median(b.get(k, 0.) for b in half), 4) for k in sorted(parts)})

def steady_epochs(rec)->list:
    "The last fit's epochs after its first (which carries the compile): the steady state. Empty with a one-epoch fit"
    eps = rec.get('epochs') or []
    if not eps: return []
    last = [e for e in eps if e['fit'] == eps[-1]['fit']]
    return last[1:]

def summarize(rec)->dict:
    "The numbers of one run that the tables show"
    st = steady_epochs(rec)
    train_eps = st or rec.get('epochs') or []
    comp = rec.get('compile') or {}
    vals = (rec.get('epochs') or [{}])[-1].get('values', {})
    return dict(total_s=rec.get('total_s'), steady_s=median(e['wall_s'] for e in st),
                data_share=median(e.get('data_share') for e in train_eps), epochs=[e['wall_s'] for e in rec.get('epochs') or []],
                compile_s=comp.get('compile_s'), graphs=comp.get('graphs'), recompiles=comp.get('recompiles'),
                fallbacks=comp.get('fallbacks'), graph_breaks=comp.get('graph_breaks'), eager_calls=comp.get('eager_calls'),
                metric=vals.get('dice', vals.get('accuracy')), valid_loss=vals.get('valid_loss'), peak=rec.get('peak_mem_gb'))

def f(v, spec='.1f', none='—'): return none if v is None else format(v, spec)
def ratio(v, base): return v/base if v and base else None

def baseline(recs:list, arm:str)->dict|None:
    "Median total and steady epoch of `arm`'s good runs in `recs`, to divide the others' by; `None` where none ran"
    ss = [summarize(r) for r in recs if r['arm'] == arm and r.get('status') == 'ok']
    return {k: median(s[k] for s in ss) for k in ('total_s', 'steady_s')} if ss else None

def render_md(data)->str:
    env, meta, recs = data['env'], data['meta'], data['records']
    smoke = meta.get('smoke')
    L = ["# fastai workflows: eager against `learn.compile()`", ""]
    if env:
        L += [env_line(env, meta), ""]
    if smoke: L += ["**CPU smoke run: tiny sizes, timings mean nothing.**", ""]
    kinds = '; '.join(f"{', '.join(f'*{k}-{s}*' for s in starts)} with {doc}" for k, (_, doc, starts) in KINDS.items() if k != 'compile')
    L.append(f"`python bench/workflow.py {' '.join(meta.get('argv', []))}`. Each arm is a process of its own; *eager* trains with "
             "fastai's `Adam`, *eager-fused* with torch's fused `AdamW` (`OptimWrapper`, `Adam`'s defaults), each ratio (×) is "
             "against the eager arm it names; *compile-cold* and "
             "*compile-ro* (`mode='reduce-overhead'`) start with an empty `TORCHINDUCTOR_CACHE_DIR`, *compile-warm* reuses "
             "compile-cold's; *compile-saved* starts empty too, after `learn.load_compile_cache()` of the file compile-cold saved; "
             f"{kinds}. "
             "**total**: the fit's wall time (`fine_tune` or `fit_one_cycle`, synchronized at its end). **steady epoch**: median "
             "wall time of the last fit's epochs after its first (the first carries the compile), training and validation. "
             "**DataLoader share**: host time between one training batch's `after_batch` and the next one's `before_batch` "
             "(the DataLoader, fastai's `batch_tfms` and moving the batch to the device), over the training phase's wall time, in "
             "the same epochs (all epochs when there is no steady one); in the eager arms fastai's `Recorder` waits for each "
             "batch's loss, so the GPU idles that long (with `learn.compile()` too). compile s, graphs, recompiles, fallbacks (frames that hit the recompile limit and run eagerly) and "
             "graph breaks come from `learn.compiler.report`. With several runs, each number is the median over the runs. "
             + (f"The runs of each arm ran {meta['gpus']} at once, each on a GPU of its own, pinned to an equal share of the host's "
                f"cores, with the same neighbours for every arm: {meta['gpus'] - 1} more run(s) of itself. " if meta.get('gpus', 1) > 1 else "") +
             f"Backend `{meta.get('backend') or 'inductor'}`" + (", bf16 (`to_bf16`) for vision and text" if env.get('cuda') and not smoke and 'CPU' not in str(env.get('device')) else "") + ".")
    L.append("")
    for w in dict.fromkeys(r['workflow'] for r in recs):
        wr = [r for r in recs if r['workflow'] == w]
        cfg = next((r['config'] for r in wr if r.get('config')), meta.get('configs', {}).get(w))
        L += [f"## {w}", "", describe(w, cfg) if cfg else '', ""]
        ok0 = next((r for r in wr if r.get('status') == 'ok'), None)
        if ok0: L += [f"{ok0['train_batches']} training batches an epoch, {ok0['valid_batches']} validation batches (the last of "
                      f"{ok0['valid_last_batch'] or cfg['bs']}), num_workers={ok0['num_workers']}.", ""]
        # Ratios against each eager arm that ran: fastai's `Adam`, and the fused AdamW a user would pick instead
        bases = {b: base for b in EAGER if (base := baseline(wr, b))}
        cols = ''.join(f" × {b} |" for b in bases)
        L += [f"| arm | runs | total s |{cols} steady epoch s |{cols} compile s | graphs | recompiles | fallbacks "
              "| graph breaks | epoch s | DataLoader share | accuracy (Dice for segmentation) |",
              "|---|---:|---:|" + "---:|"*len(bases) + "---:|" + "---:|"*len(bases) + "---:|---:|---:|---:|---:|---|---:|---:|"]
        notes = []
        for a in ARMS:
            ar = [r for r in wr if r['arm'] == a]
            if not ar: continue
            good = [r for r in ar if r.get('status') == 'ok']
            for r in ar:
                if r.get('status') != 'ok': notes.append(f"- {a} run {r['repeat']}: **{r['status']}**: {str(r.get('reason'))[:300]}")
            if not good:
                L.append(f"| {a} | 0 | {ar[0]['status']} |" + " |"*(9 + 2*len(bases)))
                continue
            ss = [summarize(r) for r in good]
            m = {k: median(s[k] for s in ss) for k in ('total_s', 'steady_s', 'data_share', 'compile_s', 'graphs', 'recompiles',
                                                       'fallbacks', 'graph_breaks', 'metric')}
            n_ep = max(len(s['epochs']) for s in ss)
            eps = [median(s['epochs'][i] for s in ss if i < len(s['epochs'])) for i in range(n_ep)]
            total = f(m['total_s'], '.2f' if smoke else '.1f')
            if len(ss) > 1: total += f" ({min(s['total_s'] for s in ss):.1f}–{max(s['total_s'] for s in ss):.1f})"
            compiled = a not in EAGER
            rt, rs = (''.join(f" {f(ratio(m[k], b[k]), '.2f')} |" for b in bases.values()) for k in ('total_s', 'steady_s'))
            L.append(f"| {a} | {len(ss)} | {total} |{rt} {f(m['steady_s'], '.2f')} |{rs} "
                     f"{f(m['compile_s']) if compiled else ''} | {f(m['graphs'], 'g') if compiled else ''} | "
                     f"{f(m['recompiles'], 'g') if compiled else ''} | {f(m['fallbacks'], 'g') if compiled else ''} | "
                     f"{f(m['graph_breaks'], 'g') if compiled else ''} | {', '.join(f'{e:.2f}' for e in eps)} | "
                     f"{f(m['data_share'], '.0%')} | {f(m['metric'], '.3f')} |")
            for r in good[:1]:
                if compiled and (r.get('compile') or {}).get('payoff'): notes.append(f"- {a}, the report: {r['compile']['payoff']}")
                if 'cache_loaded' in r:
                    notes.append(f"- {a}: `load_compile_cache` {'loaded' if r['cache_loaded'] else 'did NOT load'} the saved cache in {r['load_cache_s']:.1f}s")
                if r.get('saved_cache_mb') is not None: notes.append(f"- {a}: `save_compile_cache` wrote {r['saved_cache_mb']:.1f} MB")
                for x in r.get('warnings', [])[:3]: notes.append(f"- {a} warned: {x[:300]}")
        L += [""] + notes + ([""] if notes else [])
        fr = [r for r in wr if r.get('status') == 'ok' and r.get('epochs') and r['epochs'][0].get('frozen')]
        if fr: L += ["fine_tune: the first epoch is the frozen one (its own fit, eager by default: `compile_frozen=False`), "
                     "then the unfrozen epochs.", ""]
    return '\n'.join(L) + '\n'

def results(meta:dict, records:list)->dict:
    "What workflow.json holds: the first arm's versions, the run's settings and every arm's record"
    return dict(env=next((r['env'] for r in records if r.get('env')), {}), meta=meta, records=records)

def write_outputs(data, out:Path):
    out.mkdir(parents=True, exist_ok=True)
    (out/'workflow.json').write_text(json.dumps(data, indent=1))
    (out/'workflow.md').write_text(render_md(data))

def fmt_progress(rec)->str:
    if rec['status'] != 'ok': return f"{rec['status'].upper()}: {str(rec.get('reason', ''))[:200]}"
    s = summarize(rec)
    line = f"fit {s['total_s']:.1f}s, epochs " + ', '.join(f'{e:.2f}' for e in s['epochs'])
    if s['compile_s'] is not None: line += f"; compile {s['compile_s']:.1f}s, {s['graphs']} graphs, {s['recompiles']} recompiles"
    if s['data_share'] is not None: line += f"; DataLoader {s['data_share']:.0%}"
    return line + f"; process {rec['process_wall_s']:.0f}s"

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--workflows', default=None, help=f"comma-separated, of {','.join(WORKFLOWS)} (default: all; with --smoke, all but text-small)")
    p.add_argument('--arms', default=None, help=f"comma-separated, of {','.join(ARMS)} (default: all; with --smoke, compile-warm "
                   "on tabular only and no tiers arms; compile-ro is skipped on the CPU, where the tiers arms compile in the background without tiers)")
    p.add_argument('--out', default=None, help='folder for workflow.json, workflow.md, arms.log (default: bench/results/workflow/latest; smoke: fxc-workflow-smoke in the temp folder)')
    p.add_argument('--repeat', type=int, default=1, help='runs of each arm (each warm arm starts from a copy of the same run\'s cold cache)')
    p.add_argument('--gpus', type=int, default=1, help='run each arm on this many GPUs at once, one process on each GPU pinned to its '
                   'share of the cores: --repeat 1 --gpus 4 gives 4 runs of each arm, every arm beside three runs of itself')
    p.add_argument('--smoke', action='store_true', help='tiny sizes on the CPU: checks that every workflow and arm runs')
    p.add_argument('--device', default=None, choices=['cuda', 'cpu'], help='default: cuda when available (cpu with --smoke)')
    p.add_argument('--num-workers', type=int, default=None, help="DataLoader workers (default: fastai's default; 0 with --smoke)")
    p.add_argument('--backend', default=None, help="torch.compile backend (default inductor; aot_eager with --smoke, as inductor's C++ compile takes minutes on a small CPU)")
    p.add_argument('--compile-kwargs', default='{}', help='extra learn.compile keyword arguments, as JSON')
    p.add_argument('--config', default='{}', help='per-workflow size overrides, as JSON: \'{"vision": {"n": 3000, "epochs": 2}}\'')
    p.add_argument('--matmul-precision', default='high', help="torch.set_float32_matmul_precision in every arm on CUDA (learn.compile sets 'high' during its fits; so does the eager arm, for a fair comparison)")
    p.add_argument('--timeout', type=float, default=None, help='seconds per arm process before it is killed (default 600; smoke 120)')
    p.add_argument('--budget', type=float, default=None, help='start no arm process after this many seconds (the rest are marked skipped)')
    p.add_argument('--data-dir', default=None, help='where to write the image files (default: a temporary folder, removed at the end)')
    p.add_argument('--get-preds', action='store_true', help='also time learn.get_preds() on the validation set after the fit')
    p.add_argument('--bar', action='store_true', help="fit with fastai's progress bar shown, as users train (default: no bar)")
    p.add_argument('--drain', action='store_true', help="wait for the GPU at each training batch's end, after it is timed: the library's "
                   "host time a batch (`host_work_ms`) without the waits of a host ahead of the GPU, whose queue is full. Not a timing run")
    p.add_argument('--pin-bytes', type=int, default=None, help="pin a tensor copied ahead from this size up (the library's `PIN_BYTES` by default)")
    p.add_argument('--child', default=None, help=argparse.SUPPRESS)
    p.add_argument('--result', default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        res = child(json.loads(Path(args.child).read_text()))
        Path(args.result).write_text(json.dumps(res, indent=1))
        return

    # A smoke run's defaults leave out what repeats another's code on the CPU: text-small is text's code at other
    # sizes, and the tiers arms are the background arms' compile there
    workflows = (args.workflows or ','.join(w for w in WORKFLOWS if not (args.smoke and w == 'text-small'))).split(',')
    arms_given = args.arms is not None
    arms = (args.arms or ','.join(ARMS)).split(',')
    for name, vals, valid in (('workflows', workflows, WORKFLOWS), ('arms', arms, ARMS)):
        if bad := [v for v in vals if v not in valid]: p.error(f"unknown {name}: {bad}")
    if args.device is None:
        if args.smoke: args.device = 'cpu'
        else:
            import torch
            args.device = 'cuda' if torch.cuda.is_available() else 'cpu'
    args.backend = args.backend or ('aot_eager' if args.smoke else None)
    if not arms_given and args.backend not in (None, 'inductor'): arms = [a for a in arms if a.split('-')[0] not in INDUCTOR_ONLY]
    if not arms_given and args.smoke: arms = [a for a in arms if not a.startswith(('tiers-', 'unfrozen-', 'unwarmed-', 'bar-'))]
    args.timeout = args.timeout or (120 if args.smoke else 600)
    num_workers = args.num_workers if args.num_workers is not None else (0 if args.smoke or args.device == 'cpu' else None)
    overrides = json.loads(args.config)
    out = Path(args.out or (Path(tempfile.gettempdir())/'fxc-workflow-smoke' if args.smoke else HERE/'results'/'workflow'/'latest'))
    out.mkdir(parents=True, exist_ok=True)
    configs = {w: {**WORKFLOWS[w]['smoke' if args.smoke else 'gpu'], **overrides.get(w, {})} for w in workflows}
    meta = dict(date=datetime.datetime.now().isoformat(timespec='seconds'), git=git_commit(), argv=sys.argv[1:], smoke=args.smoke,
                device=args.device, backend=args.backend or 'inductor', num_workers=num_workers, configs=configs, data={}, gpus=args.gpus)
    jobs = plan(workflows, arms, args.repeat, smoke_default=args.smoke and not arms_given)
    print(f"{len(jobs)*args.gpus} arm processes on {args.device}: {','.join(workflows)} x {','.join(a for a in ARMS if a in arms)}, "
          f"{args.repeat*args.gpus} run(s) each{f', {args.gpus} at once' if args.gpus > 1 else ''}; timeout {args.timeout:.0f}s each", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix='fxc-workflow-'))
    caches, t0 = {}, time.perf_counter()
    try:
        spec_base = {}
        for w in workflows:
            c = configs[w]
            spec = dict(workflow=w, config=c, device=args.device, smoke=args.smoke, backend=args.backend,
                        compile_kwargs=json.loads(args.compile_kwargs), num_workers=num_workers, matmul_precision=args.matmul_precision,
                        get_preds=args.get_preds, bar=args.bar, drain=args.drain, pin_bytes=args.pin_bytes)
            if w.startswith('vision'):
                data = Path(args.data_dir)/w if args.data_dir else tmp/f'data-{w}'
                if not (data/'train').exists():
                    meta['data'][w] = write_images(data, c)
                    print(f"{w}: wrote {c['n']} JPEG files at {c['stored']} px in {meta['data'][w]['write_s']:.1f}s "
                          f"({meta['data'][w]['valid']} for validation)", flush=True)
                spec['data'] = str(data)
            if w == 'segmentation':
                data = Path(args.data_dir)/w if args.data_dir else tmp/f'data-{w}'
                if not (data/'images').exists():
                    meta['data'][w] = write_segmentation(data, c)
                    print(f"{w}: wrote {c['n']} PNG images and masks at {c['size']} px in {meta['data'][w]['write_s']:.1f}s", flush=True)
                spec['data'] = str(data)
            spec_base[w] = spec
        with open(out/'arms.log', 'w') as log:
            records = run_jobs(jobs, ('workflow', 'arm', 'repeat'), lambda job: run_copies(args, job, spec_base, caches, tmp, log),
                               lambda recs: write_outputs(results(meta, recs), out), fmt_progress, args.budget)
    finally: shutil.rmtree(tmp, ignore_errors=True)
    write_outputs(results(meta, records), out)
    failed = [r for r in records if r['status'] in ('error', 'timeout')]
    print(f"Done in {time.perf_counter()-t0:.0f}s; {len(failed)} of {len(records)} arm processes failed. Wrote {out/'workflow.md'}, workflow.json, arms.log")
    if failed: sys.exit(1)

if __name__ == '__main__': main()
