"""What every benchmark suite here shares: each arm runs in a process of its own.

An arm's process gets its own inductor cache (`TORCHINDUCTOR_CACHE_DIR`, with `TRITON_CACHE_DIR` inside it): a fresh
one for a cold compile, a cold arm's for a warm start. It runs in a process group of its own, so that a timeout also
ends inductor's compile workers, the DataLoader's workers and torchrun's ranks. The driver writes each process's
command and the end of its output to the suite's `arms.log`, and rewrites its results after every arm, so a run killed
at a time limit keeps what it measured.
"""
from __future__ import annotations
import os, platform, re, signal, subprocess, sys, time
from pathlib import Path
from typing import NamedTuple

CPP_FRAME = re.compile(r'frame #\d+: ') # A line of the stack torch's C++ errors print after their message
ROOT = Path(__file__).resolve().parents[1] # The checkout: its `fastxtend_compile` is the one measured, installed or not

def arm_env(cache=None, **extra)->dict:
    "The environment of an arm's process: `cache` as its inductor (and triton) cache, the checkout first on PYTHONPATH"
    env = dict(os.environ, PYTHONUNBUFFERED='1', **extra)
    if cache is not None: env.update(TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(Path(cache)/'triton'))
    env['PYTHONPATH'] = os.pathsep.join([str(ROOT)] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p])
    return env

class Finished(NamedTuple):
    "How an arm's process ended: its exit code, its output (None when not captured), seconds, whether it was killed"
    rc: int|None
    out: str|None
    wall: float
    timed_out: bool

    def tail(self, n=60)->str:
        "The last `n` lines of the output, C++ stack frames left out: they would push a C++ error's message out of view"
        return '\n'.join([l for l in (self.out or '').splitlines() if not CPP_FRAME.match(l)][-n:])

def run_process(cmd:list, env:dict, timeout:float, cwd=None, capture=True)->Finished:
    "Run `cmd` in a process group of its own; kill the whole group after `timeout` seconds"
    t0 = time.perf_counter()
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT) if capture else {}
    p = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, text=True, start_new_session=True, **pipe)
    timed_out = False
    try: out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        timed_out = True
    return Finished(p.returncode, out, time.perf_counter() - t0, timed_out)

def error_line(out:str)->str:
    "The line of `out` that names its error: the last one with `Error` or `error` in it, else its last line"
    lines = out.strip().splitlines() or ['']
    return next((l for l in reversed(lines) if 'rror' in l), lines[-1])

def log_process(log, title:str, cmd:list, fin:Finished, lines=60)->str:
    "Write `cmd` and the end of its output to `log` under `title`; that end of the output"
    tail = fin.tail(lines)
    log.write(f"\n===== {title} ({fin.wall:.1f}s, {'timed out' if fin.timed_out else f'exit {fin.rc}'})\n"
              f"$ {' '.join(map(str, cmd))}\n{tail}\n")
    log.flush()
    return tail

def run_jobs(jobs:list, keys:tuple, run_one, write, progress, budget:float|None=None)->list:
    "The records `run_one(job)` returns for each job (one, or a list of copies run at once), in order; after each job, print `progress(record)` and `write(records)`"
    records, t0 = [], time.perf_counter()
    for i, job in enumerate(jobs):
        print(f"[{i+1}/{len(jobs)} {time.perf_counter()-t0:4.0f}s] {' '.join(map(str, job)):<46}", end=' ', flush=True)
        if budget and time.perf_counter() - t0 > budget:
            recs = dict(zip(keys, job), status='skipped', reason=f'over the --budget of {budget:.0f}s')
        else: recs = run_one(job)
        recs = recs if isinstance(recs, list) else [recs]
        records += recs
        print(' | '.join(progress(r) if r.get('status') == 'ok' else f"{r['status'].upper()}: {str(r.get('reason', ''))[:200]}" for r in recs), flush=True)
        write(records) # So a killed run leaves what it measured
    return records

def core_share(slot:int, slots:int)->list:
    "The cores of this process that the `slot`-th of `slots` processes run at once is pinned to: an equal share, in order"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else list(range(os.cpu_count() or 1))
    n = max(len(cores) // slots, 1)
    return cores[slot*n:(slot+1)*n] or cores[-n:]

def git_commit()->str|None:
    "The checkout's short commit, `+dirty` when the library has uncommitted changes"
    try:
        git = dict(cwd=ROOT, capture_output=True, text=True)
        sha = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], check=True, **git).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--', 'fastxtend_compile'], **git).stdout.strip()
        return sha + ('+dirty' if dirty else '')
    except Exception: return None

def library_version()->str:
    "fastxtend_compile's version; from settings.ini when it is imported from the checkout rather than installed"
    try:
        import fastxtend_compile
        v = getattr(fastxtend_compile, '__version__', 'unknown')
    except Exception as e: return f'not importable: {e}'
    if v != 'unknown': return v
    import configparser
    cp = configparser.ConfigParser()
    cp.read(ROOT/'settings.ini')
    return cp.get('DEFAULT', 'version', fallback='unknown') + ' (checkout)'

def versions(device:str='cpu')->dict:
    "The device's name and the versions a result depends on, as an arm's process sees them"
    import torch, fastai
    def version(name):
        try: return __import__(name).__version__
        except Exception: return None
    cuda = str(device).startswith('cuda')
    return dict(device=torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
                torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if cuda else None,
                triton=version('triton'), fastai=fastai.__version__, torchvision=version('torchvision'),
                accelerate=version('accelerate'), python=platform.python_version(), fastxtend_compile=library_version())

def env_line(env:dict, meta:dict)->str:
    "One line for a results file: device, versions, the library's commit and the date"
    return (f"**{env.get('device')}** · torch {env.get('torch')} (CUDA {env.get('cuda')}) · triton {env.get('triton')} · "
            f"fastai {env.get('fastai')} · torchvision {env.get('torchvision')} · Python {env.get('python')} · "
            f"fastxtend_compile {env.get('fastxtend_compile')} (git {meta.get('git') or 'unknown'}) · {meta.get('date')}")
