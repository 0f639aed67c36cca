"""A user's script that must type-check (mypy --strict) against the installed wheel."""

import torch
from torch import nn

import liegroup_blr as lgb

model = nn.Linear(4, 1)
opt = lgb.AffineBLR(model.parameters(), lr=1.0, scale_lr=0.05, data_size=100)
element: dict[str, torch.Tensor] = opt.group_element(model.weight)
pending: int = opt.pending_samples
version: str = lgb.__version__
