"""A user's script with one type error, which mypy must report against the installed wheel:
group_element returns dict[str, Tensor], not a Tensor."""

import torch
from torch import nn

import liegroup_blr as lgb

model = nn.Linear(4, 1)
opt = lgb.AdditiveBLR(model.parameters(), lr=0.05, data_size=100)
scale: torch.Tensor = opt.group_element(model.weight)
