"A compile worker that logs how long each phase takes (used by background_diag.py)"
import os, sys, time, io
T0 = time.time()
def log(*a): print(f"[{time.time()-T0:6.2f}s]", *a, flush=True)
def run(path):
    if os.environ.get('FXC_NICE'): os.nice(int(os.environ['FXC_NICE']))
    log('start nice', os.nice(0))
    import torch, cloudpickle
    log('torch imported')
    from fastxtend_compile.background import _loss
    from fastxtend_compile.core import compile_model
    from contextlib import nullcontext
    log('fastxtend_compile imported')
    with open(path, 'rb') as f: job = cloudpickle.load(f)
    model = cloudpickle.loads(job['model'])
    torch.set_float32_matmul_precision(job['matmul_precision'])
    xb = [t.to(job['device']) for t in torch.load(io.BytesIO(job['inputs']), weights_only=True)]
    torch.cuda.synchronize(); log('model loaded', type(model).__name__, [tuple(x.shape) for x in xb], job['autocast'])
    model = compile_model(model, job['regional'], **job['settings'])
    autocast = torch.autocast(job['device_type'], dtype=job['autocast']) if job['autocast'] else nullcontext()
    with torch.set_grad_enabled(job['grad']):
        with autocast: out = model(*xb)
        torch.cuda.synchronize(); log('forward compiled')
        if (loss := _loss(out)) is not None: loss.backward()
    torch.cuda.synchronize(); log('backward compiled')
    from torch._dynamo.utils import counters
    log(dict(counters['inductor']), dict(counters['aot_autograd']))
