"""Whether inductor's on-disk cache, filled by a compile on one GPU, serves the same model on another GPU of the host.

    python bench/cache_across_devices.py --devices cuda:0 cuda:1 cuda:0 --out OUT

Compiles bench/arm.py's `TextClassifier` (the DDP first run's model, bf16 autocast), forward and backward, once in a new
process for each device named, in turn, all on one inductor cache (a fresh one in OUT). Each process prints, and writes
to OUT/cache_across_devices.json, its compile time and inductor's FX graph cache hits and misses.
"""
import argparse, json, os, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent

def compile_once(device:str, cfg:dict)->dict:
    "In this process: compile the model's training step on `device`; seconds and inductor's cache counters"
    sys.path.insert(0, str(HERE))
    import torch
    from arm import TextClassifier
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    dev = torch.device(device)
    if dev.type == 'cuda': torch.cuda.set_device(dev)
    model = TextClassifier(cfg['vocab'], cfg['seq'], cfg['d'], cfg['layers'], cfg['heads'], 4).to(dev)
    x = torch.randint(0, cfg['vocab'], (cfg['bs'], cfg['seq']), device=dev)
    step = torch.compile(model)
    sync = torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)
    t0 = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16): out = step(x)
    out.float().sum().backward()
    sync()
    return dict(device=device, compile_s=time.perf_counter() - t0,
                inductor={k: v for k,v in counters['inductor'].items() if 'cache' in k},
                aot_autograd={k: v for k,v in counters['aot_autograd'].items() if 'cache' in k})

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--devices', nargs='+', default=['cuda:0', 'cuda:1', 'cuda:0'])
    ap.add_argument('--config', default='{"vocab": 8000, "seq": 256, "d": 512, "layers": 6, "heads": 8, "bs": 32}')
    ap.add_argument('--out', default='bench/results/ddp/latest_cache_across_devices')
    ap.add_argument('--one'); a = ap.parse_args()
    if a.one: return print('RESULT ' + json.dumps(compile_once(a.one, json.loads(a.config))))
    out = Path(a.out).resolve(); out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(out/'inductor_cache'))
    runs = []
    for d in a.devices:
        p = subprocess.run([sys.executable, __file__, '--one', d, '--config', a.config], env=env, capture_output=True, text=True)
        line = next((l for l in p.stdout.splitlines() if l.startswith('RESULT ')), None)
        runs.append(json.loads(line[7:]) if line else dict(device=d, error=p.stderr[-2000:]))
        print(runs[-1], flush=True)
    (out/'cache_across_devices.json').write_text(json.dumps(runs, indent=1))

if __name__ == '__main__': main()
