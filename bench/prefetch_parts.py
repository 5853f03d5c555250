"""The host's time to copy a training batch to the GPU ahead of its step, by part, and by way of copying.

    python bench/prefetch_parts.py [--out FILE]

A text batch (64 sequences of 256 tokens and their labels) and an image batch (64 RGB 224 px, uint8), as fastai's
`TensorText`/`TensorImage` and `TensorCategory`. Each way is timed on the host alone, the GPU left to run the copies
(a sync every 50 batches keeps the queue short), median of 5 rounds of 200 batches, in microseconds a batch:

    to_device         fastai's own: `to_device(b, 'cuda')` from pageable memory, on the current stream
    pin+to, dispatch  pinned, then copied on a side stream, through `TensorBase`'s `__torch_function__` (each op)
    pin+to, plain     the same with that dispatch off, into memory of the step's stream, after its queued work (`Prefetch._copy`, in its thread)
    pinned ring       copied into one of 3 pinned buffers kept for the fit, then to the GPU on the side stream
    ready             the step's stream waits for the side stream (`Prefetch._ready`)

With `--loader`, the same ways on the batches of `bench/workflow.py`'s text workflow's own training DataLoader, as a fit
gets them (fastai's default workers, then none), each way a pass of its own over fresh batches.
"""
import argparse, json, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastai.torch_core import TensorCategory, TensorImage, apply, to_device
from fastai.text.data import TensorText
from fastxtend_compile.pace import _ahead
from fastxtend_compile.internals import subclass_dispatch_off

def batches(kind:str, n:int)->list:
    "`n` host batches of `kind`, each a new tensor as a DataLoader makes them"
    g = torch.Generator().manual_seed(0)
    if kind == 'text': make = lambda: (TensorText(torch.randint(0, 32000, (64, 256), generator=g)), TensorCategory(torch.randint(0, 2, (64,), generator=g)))
    else: make = lambda: (TensorImage(torch.randint(0, 255, (64, 3, 224, 224), dtype=torch.uint8, generator=g)), TensorCategory(torch.randint(0, 10, (64,), generator=g)))
    return [make() for _ in range(n)]

class Ring:
    "Three pinned buffers a tensor of each shape, reused in turn once the GPU's copy out of them is done"
    def __init__(self): self.bufs, self.i = {}, 0
    def __call__(self, b, device, stream):
        self.i = (self.i + 1) % 3
        out = []
        for j, o in enumerate(b):
            key = (j, self.i, o.shape, o.dtype)
            if key not in self.bufs: self.bufs[key] = (torch.empty(o.shape, dtype=o.dtype, pin_memory=True), None)
            buf, ev = self.bufs[key]
            if ev is not None: ev.synchronize()
            with subclass_dispatch_off():
                buf.copy_(o)
                res = buf.to(device, non_blocking=True)
            ev = torch.cuda.Event(); ev.record(stream)
            self.bufs[key] = (buf, ev)
            res = res.as_subclass(type(o)); res.__dict__.update(o.__dict__)
            out.append(res)
        return tuple(out)

def timed(f, bs:list, rounds:int=5)->float:
    "Median microseconds a batch of `f(b)` on the host"
    per = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        spent = 0.
        for i, b in enumerate(bs):
            t = time.perf_counter(); f(b); spent += time.perf_counter() - t
            if i % 50 == 49: torch.cuda.synchronize()
        per.append(spent / len(bs) * 1e6)
    return statistics.median(per)

def loader_parts(ways:dict, n:int)->dict:
    "Median microseconds a batch of each way on the text workflow's training batches, with fastai's default workers and with none"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import workflow
    res = {}
    for workers in (None, 0):
        learn, _ = workflow.build_text('text', dict(workflow.WORKFLOWS['text']['gpu']), None, 'cuda', workers)
        dl = learn.dls.train
        dl.device = None # Host batches, as `Prefetch` has its loader yield them
        for name, f in ways.items():
            it, per = iter(dl), []
            for i in range(n):
                b = next(it)
                t = time.perf_counter(); f(b); per.append(time.perf_counter() - t)
                if i % 50 == 49: torch.cuda.synchronize()
            res[f"{'default' if workers is None else workers} workers, {name}"] = statistics.median(per) * 1e6
        print({k: round(v, 1) for k,v in res.items()}, flush=True)
    return res

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--out', default=None)
    ap.add_argument('--n', type=int, default=200)
    ap.add_argument('--loader', action='store_true', help="also on the text workflow's DataLoader")
    args = ap.parse_args()
    dev, side = torch.device('cuda'), torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()
    ring = Ring()
    def dispatch(b):
        with torch.cuda.stream(side): return apply(lambda o: o.pin_memory().to(dev, non_blocking=True), b)
    def plain(b):
        side.wait_stream(main_stream)
        return apply(_ahead, b, dev, side)
    def ringed(b):
        with torch.cuda.stream(side): return ring(b, dev, side)
    def ready(b):
        main_stream.wait_stream(side)
    res = {}
    for kind in ('text', 'image'):
        bs = batches(kind, args.n if kind == 'text' else args.n // 4)
        on_gpu = [to_device(b, dev) for b in bs[:len(bs)]]
        res[kind] = {'to_device': timed(lambda b: to_device(b, dev), bs), 'pin+to, dispatch': timed(dispatch, bs),
                     'pin+to, plain': timed(plain, bs), 'pinned ring': timed(ringed, bs), 'ready': timed(ready, on_gpu)}
        print(kind, {k: round(v, 1) for k,v in res[kind].items()}, flush=True)
    if args.loader: res['loader'] = loader_parts({'to_device': lambda b: to_device(b, dev), 'pin+to, plain': plain, 'pinned ring': ringed}, args.n)
    res['env'] = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name())
    if args.out: Path(args.out).write_text(json.dumps(res, indent=1))

if __name__ == '__main__': main()
