"""Where a fit's time goes: its training batches phase by phase, on the host and on the device, and what falls between.

`Phases` marks every training batch at fastai's events with the host's clock and, on a GPU, a CUDA event on the current
stream, without waiting for the GPU. It also marks the fit's own events (epochs, training, validation) and times Python's
garbage collections. `summary()` gives:
- the fit's time split into training batches, the time between them (the DataLoader, and the callbacks' `before_batch`),
  validation, and the rest (epoch boundaries, the fit's start and end);
- each batch phase's mean and median, host and device, over the batches after the first epoch;
- the slowest batches: how many took over three times the median, and the time they took beyond it;
- Python's garbage collections: how many, and how long;
- with `profile=True`, torch.profiler over 30 batches of the last epoch on this process: the device's busy time (compute
  and NCCL) and the host operations that took longest.
"""
import gc, statistics, time
import torch
from fastai.callback.core import Callback

# fastai's events in a training batch, in order; 'next' is the next training batch's start
MARKS = ('before_batch', 'after_pred', 'after_loss', 'after_backward', 'after_step', 'after_batch')
FIT_EVENTS = ('before_fit', 'before_epoch', 'before_train', 'after_train', 'before_validate', 'after_validate', 'after_epoch', 'after_fit')

class GCTimer:
    "Python's garbage collections while it's on: how many and how long, by generation"
    def __init__(self): self.t, self.n, self.s = None, [0, 0, 0], [0., 0., 0.]
    def __call__(self, phase, info):
        if phase == 'start': self.t = time.perf_counter()
        elif self.t is not None:
            g = info['generation']; self.n[g] += 1; self.s[g] += time.perf_counter() - self.t; self.t = None
    def on(self): gc.callbacks.append(self)
    def off(self):
        if self in gc.callbacks: gc.callbacks.remove(self)

class Phases(Callback):
    "Each training batch's host and device time between fastai's events, and the fit's time around its batches"
    order = 2000 # Last: `before_batch` marks the batch once every other callback prepared it, `after_batch` once they ran
    def __init__(self, profile:bool=False): # Also profile 30 batches of the last epoch
        self.profile = profile
        self.rows, self.row, self.events, self.prof, self.prof_at, self.found, self.gc = [], None, [], None, None, None, GCTimer()

    def _stamp(self)->tuple:
        "The host's clock, and a CUDA event recorded on the current stream (on a GPU)"
        ev = None
        if torch.cuda.is_available():
            ev = torch.cuda.Event(enable_timing=True); ev.record()
        return time.perf_counter(), ev

    def _event(self, name:str): self.events.append((name, getattr(self, 'epoch', 0), time.perf_counter()))

    def before_fit(self): self.gc.on(); self._event('before_fit')
    def before_epoch(self): self._event('before_epoch')
    def before_train(self): self._event('before_train')
    def after_train(self):
        if self.rows and self.rows[-1].pop('_open', False): pass # An epoch's last batch: nothing follows it in training
        self._event('after_train')
    def before_validate(self): self._event('before_validate')
    def after_validate(self): self._event('after_validate')
    def after_epoch(self): self._event('after_epoch')
    def after_fit(self): self._event('after_fit'); self.gc.off()

    def before_batch(self):
        if not self.training: return
        if self.rows and self.rows[-1].pop('_open', False): self.rows[-1]['next'] = self._stamp() # The last batch ends here
        self.row = dict(epoch=self.epoch); self.row['before_batch'] = self._stamp()
        if self.profile and self.epoch == self.n_epoch - 1 and self.iter == self.n_iter // 2:
            if torch.cuda.is_available(): torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = torch.profiler.profile(activities=acts); self.prof.__enter__(); self.prof_at = (self.iter, time.perf_counter())

    def _mark(self, name:str):
        if self.row is not None and self.training: self.row[name] = self._stamp()
    def after_pred(self): self._mark('after_pred')
    def after_loss(self): self._mark('after_loss')
    def after_backward(self): self._mark('after_backward')
    def after_step(self): self._mark('after_step')
    def after_batch(self):
        if not self.training or self.row is None: return
        self._mark('after_batch'); self.row['_open'] = True
        self.rows.append(self.row); self.row = None
        if self.prof is not None and self.iter == self.prof_at[0] + 29:
            if torch.cuda.is_available(): torch.cuda.synchronize()
            wall = time.perf_counter() - self.prof_at[1]
            self.prof.__exit__(None, None, None)
            self.found = _profile_summary(self.prof, wall, 30)
            self.prof = None

    def summary(self)->dict:
        "The fit's time split, each phase's mean and median after the first epoch, the slow batches, the collections and the profile"
        if torch.cuda.is_available(): torch.cuda.synchronize()
        rows = [r for r in self.rows if all(m in r for m in MARKS)]
        ev = {}
        for name, _, t in self.events: ev.setdefault(name, []).append(t)
        span = lambda a, b: sum(y - x for x, y in zip(ev.get(a, []), ev.get(b, [])))
        fit = span('before_fit', 'after_fit')
        in_batch = sum(r['after_batch'][0] - r['before_batch'][0] for r in rows)
        between = sum(r['next'][0] - r['after_batch'][0] for r in rows if 'next' in r)
        valid = span('before_validate', 'after_validate')
        res = dict(fit_s=_r(fit), batches=len(rows), in_batches_s=_r(in_batch), between_batches_s=_r(between), validate_s=_r(valid),
                   rest_s=_r(fit - in_batch - between - valid), first_batch_s=_r(rows[0]['before_batch'][0] - ev['before_fit'][0]) if rows and 'before_fit' in ev else None,
                   epochs_train_s=[_r(y - x) for x, y in zip(ev.get('before_train', []), ev.get('after_train', []))],
                   gc=dict(n=self.gc.n, s=[_r(s) for s in self.gc.s]))
        later = [r for r in rows if r['epoch'] > 0 and 'next' in r] or [r for r in rows if 'next' in r]
        keys = list(MARKS) + ['next']
        for a, b in zip(keys, keys[1:]):
            host = [1e3 * (r[b][0] - r[a][0]) for r in later]
            res[f'{a}->{b}'] = dict(host_mean=_r(_mean(host)), host_med=_r(_med(host)))
            if torch.cuda.is_available(): res[f'{a}->{b}']['device_med'] = _r(_med([r[a][1].elapsed_time(r[b][1]) for r in later[-400:]]))
        whole = [1e3 * (r['next'][0] - r['before_batch'][0]) for r in later]
        if whole:
            m = _med(whole); slow = [w for w in whole if w > 3 * m]
            res['batch_ms'] = dict(mean=_r(_mean(whole)), med=_r(m), p90=_r(sorted(whole)[int(.9 * len(whole))]), max=_r(max(whole)),
                                   slow=len(slow), slow_extra_s=_r(sum(w - m for w in slow) / 1e3))
        if self.found is not None: res['profile'] = self.found
        return res

def _r(x): return None if x is None else round(x, 3)
def _med(xs:list)->float|None: return statistics.median(xs) if xs else None
def _mean(xs:list)->float|None: return statistics.fmean(xs) if xs else None

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
