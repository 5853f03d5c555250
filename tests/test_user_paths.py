"What a fastai user meets, compiled as eager: fastai's own usage patterns, diagnostics that tell the truth, refusals the Learner recovers from"
import random, warnings
import numpy as np, pytest, torch
from torch import nn, Tensor
from fastai.learner import Learner
from fastai.callback.mixup import MixUp
from fastai.losses import CrossEntropyLossFlat
from fastai.torch_core import set_seed
from fastxtend_compile import *
from conftest import two_conv_cnn, digits_dls

BACKEND = 'aot_eager' # Traces forward and backward like inductor without its C++ compile time

def _mixup_by_hand(learn, dls):
    "fastai's MixUp documentation's pattern: a Learner as a context manager, its events called one by one"
    learn.epoch, learn.training = 0, True
    learn.dl = dls.train
    learn._split(dls.valid.one_batch()) # Not shuffled: the same batch for each Learner
    learn('before_train')
    learn('before_batch')
    return learn.xb[0]

def test_events_called_by_hand_run_as_eager(digits):
    "Events called one by one, outside a fit (no `iter` or `n_iter`), run as on an eager Learner"
    xbs = []
    for compiled in (False, True):
        set_seed(0)
        learn = Learner(digits, two_conv_cnn(), loss_func=CrossEntropyLossFlat(), cbs=MixUp())
        if compiled: learn.compile(backend=BACKEND)
        with learn: xbs.append(_mixup_by_hand(learn, digits))
    torch.testing.assert_close(xbs[1], xbs[0])
