"Diagnose the background compile on a GPU: the worker's phases timed (its log kept in $OUT), optionally alone (`wait`). python bench/background_diag.py text '{\"epochs\": 1}' wait"
import sys, time, shutil, os, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workflow as wf
import fastxtend_compile.background as bg
from fastxtend_compile import *
OUT = os.environ['OUT']
orig_end = bg.BackgroundCompile._end
def _end(self):
    if self.log and os.path.exists(self.log): shutil.copy(self.log, f"{OUT}/{sys.argv[1]}_worker_{int(time.time())}.log")
    orig_end(self)
bg.BackgroundCompile._end = _end
bg.BackgroundCompile.worker = "exec(open(%r).read()); run({path!r})" % os.path.abspath(os.path.join(os.path.dirname(__file__), 'background_diag_worker.py'))
w = sys.argv[1]; c = {**wf.WORKFLOWS[w]['gpu'], **json.loads(sys.argv[2])}
import torch; torch.set_float32_matmul_precision('high')
learn, fit = wf.build_tabular(w, c, None, 'cuda', None) if w == 'tabular' else wf.build_text(w, c, None, 'cuda', None)
learn.compile(background=True, verbose=True)
from fastai.callback.core import Callback
class Wait(Callback):
    "Hold the fit at its first training batch until the worker is done: the worker's compile time alone"
    order = 20
    def after_batch(self):
        proc = self.learn.compiler.aside.proc
        if self.training and self.iter == 0 and self.epoch == 0 and proc is not None:
            t = time.time(); proc.wait(); print('worker alone took', time.time() - t, 'after the first batch', flush=True)
if len(sys.argv) > 3: learn.add_cb(Wait())
t = time.time()
with learn.no_bar(): fit()
torch.cuda.synchronize(); print(w, 'fit', time.time() - t)
print(learn.compiler.report.summary())
