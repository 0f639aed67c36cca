"""Networks of the paper's experiments, initialised as in the reference code.

Weights of dense and convolutional layers are drawn from a normal distribution truncated
at ±2σ with σ = 1/√fan_in; ResNet convolutions use He initialisation (σ = √(2/fan_in),
corrected for the truncation); dense biases start at 0.05 (MLP, CNN), others at 0.

The convolutional networks take ``channels_last``: weights and inputs in NHWC memory layout,
the same function with other strides (results agree to float rounding, not bit for bit). On
one CPU thread it makes the narrowed CNN's training step 1.3× and its evaluation 1.5–1.9×
faster, and ResNet-20's step 1.0–1.1× (docs/performance.md): on by default for the CNN only.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "elu": nn.ELU,
}

# He initialisation: σ = √(2/fan_in), divided by the std of a standard normal cut at ±2
HE = math.sqrt(2.0) / 0.87962566103423978


def _init_(layer: nn.Linear | nn.Conv2d, factor: float = 1.0, bias: float = 0.0) -> None:
    """Normal weights with σ = factor/√fan_in truncated at ±2σ; constant bias."""
    std = factor / math.sqrt(layer.weight[0].numel())
    nn.init.trunc_normal_(layer.weight, 0.0, std, -2 * std, 2 * std)
    if layer.bias is not None:
        nn.init.constant_(layer.bias, bias)


def _channels_last(model: nn.Module) -> None:
    """Put ``model``'s 4-d parameters in NHWC memory layout (inputs follow in ``forward``)."""
    for p in model.parameters():
        if p.dim() == 4:
            p.data = p.data.contiguous(memory_format=torch.channels_last)


def _output_size(module: nn.Module, input_shape: Sequence[int]) -> int:
    """Number of features ``module`` produces for one input of ``input_shape``."""
    with torch.no_grad():
        return module(torch.zeros(1, *input_shape)).numel()


INITS = ("truncated_normal", "torch")
"""An MLP's initialisations: the reference's (weights N(0, 1/fan_in) truncated at ±2σ, biases
0.05) or torch's ``nn.Linear`` default (weights and biases U(±1/√fan_in))."""


class MLP(nn.Module):
    """Fully connected network: flatten, then (Linear, activation) per width, then Linear;
    initialised as ``init`` (:data:`INITS`)."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        widths: Sequence[int] = (1024, 512, 256, 256, 256),
        activation: str = "tanh",
        init: str = "truncated_normal",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid: {sorted(ACTIVATIONS)}")
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}; valid: {INITS}")
        layers: list[nn.Module] = [nn.Flatten()]
        fan_in = math.prod(input_shape)
        for width in widths:
            layers += [nn.Linear(fan_in, width), ACTIVATIONS[activation]()]
            fan_in = width
        layers.append(nn.Linear(fan_in, num_classes))
        self.net = nn.Sequential(*layers)
        for layer in self.net:
            if isinstance(layer, nn.Linear) and init == "truncated_normal":
                _init_(layer, bias=0.05)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class CNN(nn.Module):
    """LeNet-like CNN: three (5×5 conv, ELU, 3×3 stride-2 max-pool) blocks, two dense layers.

    Channels 32w, 64w, 128w and dense widths 128w, 64w; the reference uses w = 4
    (128/256/512 filters, dense 512/256). ``channels_last``: NHWC memory layout (module doc).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        width: int = 4,
        channels_last: bool = True,
    ) -> None:
        super().__init__()
        self.channels_last = channels_last
        channels = [input_shape[0], 32 * width, 64 * width, 128 * width]
        blocks: list[nn.Module] = []
        for c_in, c_out in itertools.pairwise(channels):
            blocks += [nn.Conv2d(c_in, c_out, 5, padding=2), nn.ELU(), nn.MaxPool2d(3, 2)]
        self.features = nn.Sequential(*blocks, nn.Flatten())
        self.classifier = nn.Sequential(
            nn.Linear(_output_size(self.features, input_shape), 128 * width),
            nn.ELU(),
            nn.Linear(128 * width, 64 * width),
            nn.ELU(),
            nn.Linear(64 * width, num_classes),
        )
        for layer in self.modules():
            if isinstance(layer, nn.Conv2d):
                _init_(layer)
            elif isinstance(layer, nn.Linear):
                _init_(layer, bias=0.05)
        if channels_last:
            _channels_last(self)

    def forward(self, x: Tensor) -> Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.classifier(self.features(x))


class FilterResponseNorm(nn.Module):
    """Filter response normalisation with thresholded linear unit (Singh & Krishnan, 2020).

    x̂ = x / √(mean_{h,w} x² + ε),  y = max(γ x̂ + β, τ); per-channel γ, β, τ, no batch statistics.
    """

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.tau = nn.Parameter(torch.zeros(1, channels, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        nu2 = x.square().mean(dim=(2, 3), keepdim=True)
        return torch.maximum(self.gamma * x * torch.rsqrt(nu2 + self.eps) + self.beta, self.tau)


def _conv_frn(c_in: int, c_out: int, kernel: int = 3, stride: int = 1) -> nn.Sequential:
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2)
    _init_(conv, HE)
    return nn.Sequential(conv, FilterResponseNorm(c_out))


class ResidualBlock(nn.Module):
    """Two conv-FRN layers plus the input (through a 1×1 conv-FRN projection when downsampling)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv_frn(c_in, c_out, stride=stride), _conv_frn(c_out, c_out))
        self.shortcut = (
            _conv_frn(c_in, c_out, kernel=1, stride=stride) if stride != 1 else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.shortcut(x) + self.body(x)


class ResNet(nn.Module):
    """ResNet of depth 6n+2 with FRN (no batch statistics), as the reference's ResNet-20-FRN.

    A conv-FRN stem with ``width`` filters, three stacks of n residual blocks with width,
    2·width, 4·width filters (stride 2 at the start of stacks 2 and 3), average pooling
    over 8×8 windows (the whole map for 32×32 inputs), a dense output layer.
    ``channels_last``: NHWC memory layout (module doc).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        depth: int = 20,
        width: int = 16,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.channels_last = channels_last
        if depth < 8 or (depth - 2) % 6 != 0:
            raise ValueError(
                f"ResNet depth must be 6n+2 with n >= 1 (20, 32, 44, ...), got {depth}"
            )
        blocks_per_stack = (depth - 2) // 6
        layers: list[nn.Module] = [_conv_frn(input_shape[0], width)]
        c_in = width
        for stack in range(3):
            c_out = width * 2**stack
            for block in range(blocks_per_stack):
                stride = 2 if stack > 0 and block == 0 else 1
                layers.append(ResidualBlock(c_in, c_out, stride))
                c_in = c_out
        self.features = nn.Sequential(*layers)
        side = math.ceil(math.ceil(input_shape[-1] / 2) / 2)
        self.pool = nn.Sequential(nn.AvgPool2d(min(8, side)), nn.Flatten())
        self.head = nn.Linear(
            _output_size(nn.Sequential(self.features, self.pool), input_shape), num_classes
        )
        _init_(self.head, HE)
        if channels_last:
            _channels_last(self)

    def forward(self, x: Tensor) -> Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.head(self.pool(self.features(x)))


MODELS: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn": CNN, "resnet": ResNet}


def model_options(name: str) -> dict[str, object]:
    """The configurable options of model ``name`` with their defaults."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {sorted(MODELS)}")
    params = inspect.signature(MODELS[name].__init__).parameters
    skip = {"self", "input_shape", "num_classes"}
    return {k: p.default for k, p in params.items() if k not in skip}


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, **options: object
) -> nn.Module:
    """Instantiate model ``name`` (one of :data:`MODELS`) for inputs of ``input_shape``."""
    valid = model_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for model {name!r}; valid: {sorted(valid)}")
    return MODELS[name](input_shape, num_classes, **options)
