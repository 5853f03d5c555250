"""Compiling in the background under DDP when each rank pads its batches to their own longest item: the ranks' batches, and
so the model states they come to an agreement with, differ. Two CPU processes on `gloo`, started here; tests/ddp_ragged.py
is what each runs, and the checks read what they wrote.

A rank whose batch at an agreement had a settled state, were it to skip the agreement's collective while another rank,
whose batch there was padded to another length, waited in it, would hang the fit (rank 0 in DDP's all-reduce, rank 1 in the
agreement, until its 600s timeout). Here that fails the launch at `TIMEOUT`.
"""
import re
from pathlib import Path
import pytest, torch
from test_distributed import launch_ranks # Fails a rank still running after its timeout: a hang fails, not blocks CI

pytest.importorskip('accelerate')
# Slow: each launch starts its ranks' processes (`pytest --slow`)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                                     reason="needs torch.distributed with gloo")]

# Seconds for the whole launch: 2 ranks, each 4 fits (~30s in all on 2 idle CPU cores, 180s and more on 2 cores that another
# test run shares, where each worker's start-up alone took 40-50s). A hang lasts 600s (the agreement's timeout)
TIMEOUT = 480
# How much longer than the same eager DDP fit a background fit may take. It takes ~8s longer on 2 cores: the worker's start-up
# (importing torch and inductor, ~5s) and its compile of the state (<1s), which rank 0 waits for at the end of the batch and
# rank 1 in DDP's next all-reduce, then TorchDynamo's compile in the fit's path as the compiled code takes over (~2.5s).
# On 2 cores that another test run shares, the worker's start-up alone took up to 50s. 180s leaves room for that, and is
# still a third of a hang
SLACK_S = 180
SCENARIOS = ('agreement', 'random')

@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp('ddp_ragged')
    ranks = launch_ranks(out, 2, Path(__file__).parent/'ddp_ragged.py', timeout=TIMEOUT)
    assert not list(out.glob('fxc-background-*')), "a worker's folder outlived its fit"
    return ranks

def _took_over(notes:list)->int:
    "The training batch of the fit at which the compiled code took over from the worker, from rank 0's report (one epoch)"
    found = [int(m.group(1)) for n in notes if (m := re.search(r'took over at epoch 0, batch (\d+)', n))]
    assert found, f"no state compiled in the worker took over: {notes}"
    return found[0]

def test_batches_are_padded_as_the_scenario_plans(ranks):
    "What each rank's model saw: the lengths each scenario is built on"
    every = ranks[0]['every'] # The ranks agree at every training batch whose `train_iter` is a multiple of this
    for r in ranks:
        for s in SCENARIOS:
            assert r[s]['background']['lengths'] == r[s]['eager']['lengths'] == r[s]['planned'], s
    r0, r1 = (r['agreement']['planned'] for r in ranks)
    differ = [k for k,(a,b) in enumerate(zip(r0, r1)) if a != b]
    agreed = ranks[0]['agreement']['background']['agreed_at']
    # Agreement batches after the first two: the ranks' 3rd agreement finds rank 1's new state, which rank 0 alone may judge
    # and never meets, so the 4th comes twice as far (`agreement.next_gap`)
    assert differ == [k for k in range(2*every, len(r0), every)], differ # The scenario's plan, which the library is checked on:
    assert agreed == [0, every, 2*every], agreed

@pytest.mark.parametrize('scenario', SCENARIOS)
def test_the_first_state_settles_before_the_ranks_states_differ_at_an_agreement(ranks, scenario):
    "The compiled code takes over before an agreement where one rank's state is settled and the other's isn't: the case that hung"
    r0, r1 = (r[scenario]['planned'] for r in ranks)
    bg, every = ranks[0][scenario]['background'], ranks[0]['every']
    assert bg['graphs'] >= 1
    took_over = _took_over(bg['notes'])
    settled = r0[took_over] # The state the ranks settled on: rank 0's batch has it as the compiled code takes over
    agreed = bg['agreed_at'] # The training batches of the ranks' agreements, the same on both
    assert agreed == ranks[1][scenario]['background']['agreed_at'] and agreed[:3] == [0, every, 2*every], agreed
    assert any(r0[k] == r1[k] == settled for k in agreed if k < took_over) # Agreed on at an agreement both came to with it
    later = [k for k in agreed if k >= took_over and (r0[k] == settled) != (r1[k] == settled)]
    assert later, f"no agreement after the take-over at batch {took_over} where one rank's state is settled and the other's is not"

@pytest.mark.parametrize('scenario', SCENARIOS)
def test_the_fit_ends_in_about_the_time_of_eager_ddp(ranks, scenario):
    for r in ranks:
        eager, bg = r[scenario]['eager']['fit_s'], r[scenario]['background']['fit_s']
        assert bg <= eager + SLACK_S, f"rank {r['rank']}: background fit {bg:.1f}s, eager DDP fit {eager:.1f}s"

@pytest.mark.parametrize('scenario', SCENARIOS)
def test_every_rank_trains_the_same_model_as_eager_ddp(ranks, scenario):
    r0, r1 = (r[scenario]['background'] for r in ranks)
    for k,v in r0['params'].items(): assert torch.equal(r1['params'][k], v), k # Every rank ends with the same weights
    for r in ranks: # aot_eager runs eager's arithmetic, whichever batches ran compiled: as in tests/test_distributed.py, exactly
        for k,v in r[scenario]['eager']['params'].items(): assert torch.equal(r[scenario]['background']['params'][k], v), (r['rank'], k)
    assert all(r[scenario]['background']['compiled_after_fit'] for r in ranks)
