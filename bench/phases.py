"""Where a fit's training batches spend their time, phase by phase, on the host and on the device.

`Phases` marks each training batch of the last epoch at fastai's events, with the host's clock and, on a GPU, a CUDA
event on the current stream, without waiting for the GPU. Its summary gives each phase's median over the batches:
the host's time in it, and the GPU stream's time between its marks (the work the phase queued, and any wait on it).
With `profile=True` it also runs torch.profiler over 30 later batches and sums what their device ran (compute, NCCL)
and the host operations that took longest.
"""
import statistics, time
import torch
from fastai.callback.core import Callback

# fastai's events in a training batch, in order; 'next' is the next batch's start (the DataLoader and `before_batch`)
MARKS = ('before_batch', 'after_pred', 'after_loss', 'after_backward', 'after_step', 'after_batch')

class Phases(Callback):
    "Each training batch's host and device time between fastai's events, over the last epoch"
    order = 2000 # Last: `before_batch` marks the batch once every other callback prepared it, `after_batch` once they ran
    def __init__(self,
        skip:int=50, # The epoch's first batches, left out
        n:int=300, # The batches timed
        profile:bool=False, # Also profile 30 batches after them
    ):
        self.skip, self.n, self.profile = skip, n, profile
        self.rows, self.row, self.prof, self.prof_at, self.found = [], None, None, None, None

    def _on(self)->bool: return self.training and self.epoch == self.n_epoch - 1 and self.skip <= self.iter < self.skip + self.n

    def _stamp(self)->tuple:
        "The host's clock, and a CUDA event recorded on the current stream (on a GPU)"
        ev = None
        if torch.cuda.is_available():
            ev = torch.cuda.Event(enable_timing=True); ev.record()
        return time.perf_counter(), ev

    def _mark(self, name:str):
        if self.row is not None: self.row[name] = self._stamp()

    def before_batch(self):
        if self.rows and self.rows[-1].pop('_open', False): self.rows[-1]['next'] = self._stamp() # The last batch ends here
        if self._on(): self.row = {}; self._mark('before_batch')
        if self.profile and self.training and self.epoch == self.n_epoch - 1 and self.iter == self.skip + self.n + 10:
            if torch.cuda.is_available(): torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = torch.profiler.profile(activities=acts); self.prof.__enter__(); self.prof_at = (self.iter, time.perf_counter())

    def after_pred(self): self._mark('after_pred')
    def after_loss(self): self._mark('after_loss')
    def after_backward(self): self._mark('after_backward')
    def after_step(self): self._mark('after_step')
    def after_batch(self):
        if self.row is not None:
            self._mark('after_batch'); self.row['_open'] = True
            self.rows.append(self.row); self.row = None
        if self.prof is not None and self.iter == self.prof_at[0] + 29:
            if torch.cuda.is_available(): torch.cuda.synchronize()
            wall = time.perf_counter() - self.prof_at[1]
            self.prof.__exit__(None, None, None)
            self.found = _profile_summary(self.prof, wall, 30)
            self.prof = None

    def summary(self)->dict:
        "Each phase's median host and device milliseconds a batch, and the profile's summary"
        if torch.cuda.is_available(): torch.cuda.synchronize()
        rows = [r for r in self.rows if 'next' in r and all(m in r for m in MARKS)]
        names = list(MARKS[1:]) + ['next']
        keys = [MARKS[0]] + names
        res = {'batches': len(rows)}
        for a, b in zip(keys, keys[1:]):
            host = [1e3 * (r[b][0] - r[a][0]) for r in rows]
            res[f'{a}->{b}'] = dict(host_ms=_med(host), **({'device_ms': _med([r[a][1].elapsed_time(r[b][1]) for r in rows])} if torch.cuda.is_available() else {}))
        res['batch_host_ms'] = _med([1e3 * (r['next'][0] - r['before_batch'][0]) for r in rows])
        if self.found is not None: res['profile'] = self.found
        return res

def _med(xs:list)->float|None: return round(statistics.median(xs), 3) if xs else None

def _profile_summary(prof, wall:float, n:int)->dict:
    "A batch's device time (compute and NCCL) and its longest host operations, from `prof`'s events over `n` batches"
    ev = prof.key_averages()
    dev = [e for e in ev if e.device_type.name == 'CUDA']
    nccl = sum(e.self_device_time_total for e in dev if 'nccl' in e.key.lower()) / 1e3 / n
    busy = sum(e.self_device_time_total for e in dev) / 1e3 / n
    host = sorted((e for e in ev if e.device_type.name == 'CPU'), key=lambda e: -e.self_cpu_time_total)[:25]
    return dict(wall_ms=round(1e3 * wall / n, 3), device_busy_ms=round(busy, 3), nccl_ms=round(nccl, 3),
                kernels=sorted(((e.key[:80], round(e.self_device_time_total / 1e3 / n, 3), e.count // n) for e in dev),
                               key=lambda t: -t[1])[:15],
                host=[(e.key[:80], round(e.self_cpu_time_total / 1e3 / n, 3), e.count // n) for e in host])
