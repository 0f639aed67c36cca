"""``TrainingState`` in one process (the sharded runs are tests/distributed/test_sharded.py):
a run saved with ``torch.distributed.checkpoint`` and loaded into a new model and optimizer
resumes bit for bit, its noise generators included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from liegroup_blr.optim import TrainingState
from tests.shared import closure_for, make_problem


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_run_saved_and_loaded_with_dcp_resumes_bit_for_bit(problem, make_optimizer, tmp_path):
    model, x, y = problem
    opt = make_optimizer("affine", model.parameters(), seed=3)
    closure = closure_for(opt, model, x, y)
    for _ in range(2):
        opt.step(closure)
    dcp.save({"train": TrainingState(model, opt)}, checkpoint_id=tmp_path)
    for _ in range(2):
        opt.step(closure)

    model_again, _, _ = make_problem(seed=1)  # other weights, other noise, all overwritten
    opt_again = make_optimizer("affine", model_again.parameters(), seed=4)
    dcp.load({"train": TrainingState(model_again, opt_again)}, checkpoint_id=tmp_path)
    closure = closure_for(opt_again, model_again, x, y)
    for _ in range(2):
        opt_again.step(closure)
    for p, q in zip(model.parameters(), model_again.parameters(), strict=True):
        assert torch.equal(p, q)
        assert all(torch.equal(v, opt_again.state[q][k]) for k, v in opt.state[p].items())
