"torch.compile backends for the tier tests: a worker process imports them by this module's name"
import os, time

def sleepy(gm, example_inputs):
    "Run the traced graph as it is, 100 ms late at each call: slower than any other backend"
    def run(*args):
        time.sleep(0.1)
        return gm(*args)
    return run

def refused(gm, example_inputs):
    "A backend that can't compile: the tier it serves fails in the worker"
    raise RuntimeError('this tier has no kernels for the model')

def slow_to_compile(gm, example_inputs):
    "A backend that takes a minute to compile: a fit ends before the worker is done"
    time.sleep(60)
    return gm

def worker_only(gm, example_inputs):
    "A backend that compiles in the worker process alone: in the training process the tier it serves fails"
    if 'FXC_WORKER_STARTED' not in os.environ: raise RuntimeError('no kernels in the training process')
    return gm

def flaky(gm, example_inputs):
    "A backend whose code runs until `FXC_TIER_FAILS` is set in the training process: a kept tier that fails in a later fit"
    def run(*args):
        if 'FXC_TIER_FAILS' in os.environ and 'FXC_WORKER_STARTED' not in os.environ: raise RuntimeError('the tier fails now')
        return gm(*args)
    return run

def reports_imports(gm, example_inputs):
    "A backend that, in a worker process, writes which of fastai, its heavy imports and inductor the process has to `FXC_TEST_IMPORTS`"
    import json, sys
    if 'FXC_WORKER_STARTED' in os.environ:
        with open(os.environ['FXC_TEST_IMPORTS'], 'w') as f:
            heavy = {m.split('.')[0] for m in sys.modules} & {'fastai', 'sklearn', 'matplotlib', 'pandas'}
            json.dump(sorted(heavy | ({'inductor'} if 'torch._inductor.compile_fx' in sys.modules else set())), f)
    return gm

class IdleMeter:
    "A busy meter for the CPU: the measured eager steps found the device idle throughout"
    measures = staticmethod(lambda device: True)
    def __init__(self): self.started = False
    def start(self, device, hold_s): self.started = True; return True
    def stop(self, device): return 0. if self.started else None
    def peak_bytes(self, device): return 0
