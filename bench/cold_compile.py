"""Where a cold compile of the text workflow's model goes, when a fit compiles it in its path: inductor's import (and its
pool of compile workers), the forward, the backward, CUDA graphs' recording.

Each arm is a process of its own with an empty inductor cache (`procs.py`); the model is bench/workflow.py's text model
(token and position embeddings, a pre-norm transformer encoder), trained under bf16 autocast with torch's fused AdamW,
its forward compiled as `learn.compile()`'s CUDA-graph tier compiles it (`mode='reduce-overhead'`):

- *plain*: the first compiled step imports inductor and starts its compile workers, as a fit's first compile does;
- *imported*: inductor imported and its compile workers ready before the first compiled step (each timed apart);
- *default*: as *plain*, `mode='default'` (no CUDA graphs);
- *no-pointwise-tuning*: as *plain*, inductor's pointwise kernels compiled with one configuration each.

    python3 bench/cold_compile.py --out OUT [--sizes text,small] [--repeat 2] [--arms plain,imported] [--smoke]

Writes `OUT/cold_compile.json` and `OUT/arms.log`, and prints each run's seconds.
"""
from __future__ import annotations
import argparse, itertools, json, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from procs import arm_env, run_process, log_process, versions, git_commit

ARMS = ('plain', 'imported', 'default', 'no-pointwise-tuning')
# bench/workflow.py's text (GPU-bound) and text-small (launch-bound) models, and a tiny one for `--smoke`
SIZES = dict(text=dict(vocab=8000, seq=256, d=384, layers=6, heads=6, bs=64), small=dict(vocab=8000, seq=64, d=128, layers=4, heads=4, bs=32),
             smoke=dict(vocab=100, seq=16, d=32, layers=2, heads=2, bs=4))

def _synced(device):
    import torch
    if device == 'cuda': torch.cuda.synchronize()
    return time.perf_counter()

def child(arm:str, size:str, smoke:bool)->dict:
    "One arm's measure, in this process"
    t0 = time.perf_counter()
    import torch, torch.nn.functional as F
    from arm import TextClassifier
    device = 'cpu' if smoke else 'cuda'
    s = SIZES['smoke' if smoke else size]
    res = dict(arm=arm, size=size, import_torch_s=time.perf_counter() - t0)
    model = TextClassifier(s['vocab'], s['seq'], s['d'], s['layers'], s['heads'], 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == 'cuda')
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, s['vocab'], (s['bs'], s['seq']), generator=g).to(device),
                torch.randint(0, 4, (s['bs'],), generator=g).to(device)) for _ in range(4)]
    def step(m, i, mark=False):
        x, y = batches[i % len(batches)]
        if mark: torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16): out = m(x)
        loss = F.cross_entropy(out.float(), y)
        return out, loss
    def train(m, i, mark=False):
        out, loss = step(m, i, mark)
        loss.backward(); opt.step(); opt.zero_grad()
    for i in range(5): train(model, i) # Eager warm-up: CUDA's context, cuBLAS, the fused optimizer
    t = _synced(device)
    for i in range(20): train(model, i)
    res['eager_step_ms'] = (_synced(device) - t) / 20 * 1e3
    if arm == 'imported':
        t = time.perf_counter()
        import torch._inductor.compile_fx # noqa: F401 (what a first compile imports)
        res['import_inductor_s'] = time.perf_counter() - t
        from torch._inductor.async_compile import AsyncCompile
        t = time.perf_counter()
        AsyncCompile.wait_pool_ready()
        res['pool_ready_s'] = time.perf_counter() - t
    if arm == 'no-pointwise-tuning':
        from torch._inductor import config
        config.triton.autotune_pointwise = False
    mode = 'default' if arm == 'default' or smoke else 'reduce-overhead'
    cm = torch.compile(model, mode=mode)
    mark = mode == 'reduce-overhead'
    t = _synced(device)
    out, loss = step(cm, 0, mark)
    res['first_forward_s'] = _synced(device) - t
    t = _synced(device)
    loss.backward()
    res['first_backward_s'] = _synced(device) - t
    opt.step(); opt.zero_grad()
    t = _synced(device)
    for i in range(1, 4): train(cm, i, mark) # CUDA graphs: warm-up runs, then the recording
    res['next_3_steps_s'] = _synced(device) - t
    times = []
    for i in range(30):
        t = _synced(device); train(cm, i, mark); times.append(_synced(device) - t)
    res['compiled_step_ms'] = statistics.median(times) * 1e3
    try:
        from torch._dynamo.utils import compile_times
        res['phases'] = compile_times(repr='str')
    except Exception as e: res['phases'] = repr(e)
    try:
        from torch._dynamo.utils import counters
        res['inductor_counters'] = {k: v for k, v in counters['inductor'].items() if 'cache' in k}
    except Exception: pass
    return res

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--out', required=True)
    p.add_argument('--arms', default=','.join(ARMS))
    p.add_argument('--sizes', default='text', help=f"comma-separated, of {','.join(k for k in SIZES if k != 'smoke')}")
    p.add_argument('--repeat', type=int, default=1)
    p.add_argument('--timeout', type=float, default=150)
    p.add_argument('--smoke', action='store_true')
    p.add_argument('--child')
    a = p.parse_args()
    if a.child:
        res = child(a.child, a.sizes, a.smoke)
        Path(a.out).write_text(json.dumps(res))
        return
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    runs, log = [], open(out/'arms.log', 'a')
    meta = dict(versions=versions('cpu' if a.smoke else 'cuda'), commit=git_commit(), argv=sys.argv[1:])
    for r, size, arm in itertools.product(range(a.repeat), a.sizes.split(','), a.arms.split(',')):
        with tempfile.TemporaryDirectory(prefix='fxc-cold-') as tmp:
            res_path = Path(tmp)/'res.json'
            cmd = [sys.executable, __file__, '--child', arm, '--sizes', size, '--out', res_path] + (['--smoke'] if a.smoke else [])
            fin = run_process(cmd, arm_env(Path(tmp)/'cache'), a.timeout)
            log_process(log, f'{size} {arm} run {r}', cmd, fin)
            res = json.loads(res_path.read_text()) if res_path.exists() else dict(arm=arm, error=fin.tail(5))
            res.update(run=r, process_s=fin.wall)
            runs.append(res)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items() if k != 'phases'}), flush=True)
            (out/'cold_compile.json').write_text(json.dumps(dict(meta=meta, runs=runs), indent=1))
    for res in runs: print(f"\n== {res.get('size')} {res['arm']} run {res['run']}\n{res.get('phases')}")

if __name__ == '__main__': main()
