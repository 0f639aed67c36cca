"""The optimizers in a real skorch ``NeuralNetClassifier`` (the ``test`` extra installs skorch):
skorch steps with a closure, and ``EarlyStopping(load_best=True)`` loads the best epoch's
weights into the module at the end of ``fit``; the next ``partial_fit`` must start from them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import liegroup_blr as lgb
from liegroup_blr.distributions import Dirac
from tests.integrations.training_loops import Recorder, make_net, task

skorch = pytest.importorskip("skorch")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Module(nn.Module):
    """:func:`make_net` whose first layer is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.recorder = Recorder().attach(self.net[0])

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def classifier(**options: Any) -> Any:
    """SGD-like steps (a Dirac base: each sample is the point estimate), an ever-rising
    validation loss (a large step), early stopping that restores the best epoch."""
    return skorch.NeuralNetClassifier(
        Module,
        criterion=nn.CrossEntropyLoss,
        optimizer=lgb.AdditiveBLR,
        optimizer__lr=3.0,
        optimizer__base=Dirac(0.0),
        optimizer__seed=0,
        max_epochs=8,
        batch_size=16,
        train_split=skorch.dataset.ValidSplit(4, stratified=False),
        callbacks=[skorch.callbacks.EarlyStopping(patience=2, load_best=True)],
        iterator_train__shuffle=False,
        verbose=0,
        **options,
    )


def test_partial_fit_after_early_stopping_with_load_best_starts_from_the_best_weights():
    x, y = task(128)
    torch.manual_seed(0)
    net = classifier()
    net.fit(x.numpy(), y.numpy())
    best = {k: v.clone() for k, v in net.module_.state_dict().items()}
    history = net.history[:, "valid_loss"]
    assert min(history) < history[-1]  # early stopping restored an earlier epoch
    optimizer = net.optimizer_
    count = len(net.module_.recorder.weights)
    net.partial_fit(x.numpy(), y.numpy(), epochs=1)
    first = net.module_.recorder.weights[count]  # the first training forward after it
    assert torch.equal(first, best["net.0.weight"])  # a Dirac base: the sample is the point
    element = optimizer.group_element(net.module_.net[0].weight)["m"]
    assert not torch.equal(element, best["net.0.weight"])  # and it trained on from there
