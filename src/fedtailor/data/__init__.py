"""Real image datasets (pooled train+test records) and federated partitions (``docs/data.md``)."""

from fedtailor.data.datasets import (
    DatasetInfo,
    DatasetNotAvailable,
    ImageDataset,
    available_datasets,
    load_cifar10,
    load_dataset,
    load_idx,
)
from fedtailor.data.partition import (
    ClientIndices,
    FederatedPartition,
    class_histogram,
    dirichlet_equal_partition,
    dirichlet_per_class_partition,
    federated_partition,
    format_partition_table,
    iid_partition,
    plot_partition,
)

__all__ = [
    "ClientIndices",
    "DatasetInfo",
    "DatasetNotAvailable",
    "FederatedPartition",
    "ImageDataset",
    "available_datasets",
    "class_histogram",
    "dirichlet_equal_partition",
    "dirichlet_per_class_partition",
    "federated_partition",
    "format_partition_table",
    "iid_partition",
    "load_cifar10",
    "load_dataset",
    "load_idx",
    "plot_partition",
]
