"""What a compiled fit's steady training batch spends on the host, by taking parts away: one process a variant, warm on
one shared inductor cache (the first variant compiles it cold), each epoch's training time synchronized.

    python3 bench/batch_host.py --workflow text-small --epochs 3 --variants base,file_system,dispatch,workers0,eager --out OUT
    python3 bench/batch_host.py --smoke                       # every variant tiny, on the CPU

Variants, each on top of `learn.compile()` unless it says otherwise:
- `base`: `learn.compile()` as it ships;
- `file_system`: the loader's workers share their batches' memory by file name (torch's `file_system` strategy), not by
  passing a file descriptor over a socket for each tensor;
- `dispatch`: fastai's `Learner` calls at each event only the callbacks with a method for it, in an order sorted once;
- `device_metrics`: fastai's `AvgLoss` and `AvgMetric` sum each batch's value on its device, not copied to the host a batch;
- `workers0`: the loader makes its batches in the fit's process (`num_workers=0`);
- `eager`: no compile, torch's fused AdamW (every variant uses it).

With `--validate N`, the compiled variants compile evaluation too (`compile_valid=True`), and `learn.validate()` runs N
times after the fit, each timed; `base`'s last is profiled with cProfile, into `valid_profile_<round>.txt`.

Prints and writes `batch_host.json`: each variant's epochs (training seconds, batches), its steady epochs' median
milliseconds a training batch (the epochs after the first), and its `validate` seconds."""
import argparse, json, shutil, statistics, sys, tempfile, time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from procs import arm_env, run_process

def fast_dispatch():
    "fastai's `Learner._call_one`, calling only the callbacks with a method for the event, in the order sorted once per list of callbacks"
    from fastai.learner import Learner
    from fastai.callback.core import event
    call_one, handlers = Learner._call_one, {}
    def _call_one(self, event_name):
        if not hasattr(event, event_name): return call_one(self, event_name) # fastai's own error for an unknown event
        key = (event_name, tuple(map(id, self.cbs)))
        if (cbs := handlers.get(key)) is None:
            cbs = handlers[key] = [cb for cb in self.cbs.sorted('order') if hasattr(type(cb), event_name) or event_name in cb.__dict__]
        for cb in cbs: cb(event_name)
    Learner._call_one = _call_one

def device_metrics():
    "fastai's `AvgLoss` and `AvgMetric` summing each batch's value on its device: their `accumulate`, its values not copied to the host"
    from fastai.learner import Learner, AvgLoss, AvgMetric
    def on_device(accumulate):
        def wrapped(self, learn):
            learn.to_detach = partial(Learner.to_detach, learn, cpu=False) # For this call: the instance's, over the class's
            try: accumulate(self, learn)
            finally: del learn.to_detach
        return wrapped
    for c in (AvgLoss, AvgMetric): c.accumulate = on_device(c.accumulate)

def child(variant:str, workflow:str, epochs:int, smoke:bool, validate:int=0)->dict:
    import torch
    from workflow import BUILDERS, WORKFLOWS, fused_adamw
    import fastxtend_compile # noqa: F401
    from fastai.callback.core import Callback
    cuda = torch.cuda.is_available() and not smoke
    if variant == 'file_system': torch.multiprocessing.set_sharing_strategy('file_system')
    if variant == 'dispatch': fast_dispatch()
    if variant == 'device_metrics': device_metrics()
    c = dict(WORKFLOWS[workflow]['smoke' if smoke else 'gpu'], epochs=epochs)
    torch.manual_seed(0)
    workers = 0 if variant == 'workers0' or not cuda else None
    learn, fit = BUILDERS[workflow](workflow, c, None, 'cuda' if cuda else 'cpu', workers)
    learn.opt_func = fused_adamw()
    if variant != 'eager': learn.compile(**({} if cuda else dict(backend='aot_eager', background=False)), compile_valid=validate > 0)
    rows = []
    class Epochs(Callback):
        order = 1999
        def before_train(self): self.t = time.perf_counter()
        def after_train(self):
            if cuda: torch.cuda.synchronize()
            rows.append(dict(epoch=self.epoch, train_s=time.perf_counter() - self.t, batches=self.n_iter))
    learn.add_cb(Epochs())
    t = time.perf_counter()
    with learn.no_bar(): fit()
    fit_s = time.perf_counter() - t
    valid = []
    for i in range(validate):
        if i == validate - 1 and variant == 'base':
            import cProfile, pstats, io
            pr = cProfile.Profile(); pr.enable()
        tv = time.perf_counter()
        with learn.no_bar(): vals = learn.validate()
        if cuda: torch.cuda.synchronize()
        valid.append(time.perf_counter() - tv)
        if i == validate - 1 and variant == 'base':
            pr.disable(); o = io.StringIO(); pstats.Stats(pr, stream=o).sort_stats('cumulative').print_stats(45)
            print('\n'.join(l[:200] for l in o.getvalue().splitlines()[4:]), file=sys.stderr)
    steady = [1e3*r['train_s']/r['batches'] for r in rows[1:]] or [1e3*rows[0]['train_s']/rows[0]['batches']]
    return dict(variant=variant, fit_s=fit_s, epochs=rows, batch_ms=statistics.median(steady), valid_s=valid,
                valid_batches=len(learn.dls.valid), values=[float(v) for v in vals] if validate else None)

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--child', default=None, help=argparse.SUPPRESS)
    p.add_argument('--workflow', default='text-small')
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--variants', default='base,file_system,dispatch,workers0,eager')
    p.add_argument('--rounds', type=int, default=1, help="times each variant runs, in turn")
    p.add_argument('--smoke', action='store_true')
    p.add_argument('--validate', type=int, default=0, help="after the fit, time `learn.validate()` this many times (evaluation compiled in the fit's path); `base` profiles its last")
    p.add_argument('--timeout', type=int, default=300)
    p.add_argument('--out', default=None)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.workflow, args.epochs, args.smoke, args.validate)))
        return
    out = Path(args.out or tempfile.mkdtemp(prefix='fxc-batch-host-'))
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix='fxc-batch-host-cache-'))
    runs = []
    try:
        for r in range(args.rounds):
            for v in args.variants.split(','):
                cmd = [sys.executable, __file__, '--child', v, '--workflow', args.workflow, '--epochs', str(args.epochs), '--validate', str(args.validate)] + (['--smoke'] if args.smoke else [])
                fin = run_process(cmd, arm_env(cache), args.timeout) # Its output and errors, the result its last line
                lines = (fin.out or '').strip().splitlines() or ['']
                if args.validate and v == 'base': (out/f'valid_profile_{r}.txt').write_text('\n'.join(lines[:-1])[-20000:])
                if fin.rc or fin.timed_out: rec = dict(variant=v, status='failed', error=fin.tail(30))
                else: rec = dict(json.loads(lines[-1]), status='ok')
                rec['round'] = r
                runs.append(rec)
                print(f"{v:<12} " + (f"{rec['batch_ms']:.2f} ms a steady training batch; epochs " +
                      ', '.join(f"{e['train_s']:.2f}s" for e in rec['epochs']) + f"; fit {rec['fit_s']:.1f}s" + (f"; validate " + ', '.join(f"{x:.2f}s" for x in rec['valid_s']) if rec['valid_s'] else '') if rec['status'] == 'ok'
                      else 'FAILED ' + rec['error']), flush=True)
                (out/'batch_host.json').write_text(json.dumps(dict(argv=sys.argv[1:], runs=runs), indent=1))
    finally: shutil.rmtree(cache, ignore_errors=True)

if __name__ == '__main__': main()
