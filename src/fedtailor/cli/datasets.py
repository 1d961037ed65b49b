"""``fedtailor datasets`` (installed data) and ``fedtailor partition`` (a federated split's summary)."""

from __future__ import annotations

import argparse

from fedtailor.cli.checks import nonnegative_int, open_unit, positive_float, positive_int
from fedtailor.data.datasets import DATASET_NAMES, available_datasets, load_dataset
from fedtailor.data.partition import SCHEMES, federated_partition, format_partition_table, plot_partition


def _datasets(args: argparse.Namespace) -> int:
    rows = [("name", "available", "records", "install / where from")]
    for info in available_datasets():
        records = f"{info.num_records:,}" if info.num_records is not None else "?"
        rows.append((info.name, "yes" if info.available else "no", records, info.install_hint))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print(f"{r[0].ljust(widths[0])}  {r[1].ljust(widths[1])}  {r[2].rjust(widths[2])}  {r[3]}")
    print("also: idx:<images-file>,<labels-file> for any pair of IDX files (gzip or raw)")
    return 0


def _partition(args: argparse.Namespace) -> int:
    if args.unseen >= args.clients:
        raise ValueError(
            f"--unseen {args.unseen} must be smaller than --clients {args.clients} (some "
            "clients must be seen); lower --unseen or raise --clients."
        )
    dataset = load_dataset(args.dataset, root=args.root)
    partition = federated_partition(
        dataset.y,
        num_clients=args.clients,
        num_unseen=args.unseen,
        alpha=args.alpha,
        scheme=args.scheme,
        eval_fraction=args.eval_fraction,
        context_size=args.context_size,
        seed=args.seed,
    )
    print(
        f"{dataset.name}: {len(dataset)} records, {dataset.num_classes} classes; scheme={args.scheme} "
        f"alpha={args.alpha} seed={args.seed}"
    )
    print(format_partition_table(dataset.y, partition, max_rows=args.max_rows))
    if args.plot is not None:
        print(f"plot written to {plot_partition(dataset.y, partition, args.plot)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``datasets`` and ``partition`` subcommands."""
    p = subparsers.add_parser("datasets", help="list the datasets, whether each is installed, how to install it")
    p.set_defaults(func=_datasets)

    p = subparsers.add_parser(
        "partition",
        help="federated split of a dataset: per-client class histogram table (and plot)",
        description="Partition a dataset (the data protocol of docs/data.md) and print one row per client.",
    )
    p.add_argument(
        "--dataset",
        default="mnist",
        help=f"one of {', '.join(DATASET_NAMES)} or idx:<images>,<labels> (default mnist)",
    )
    p.add_argument("--root", default=None, help="folder/file of the dataset when not in its default place")
    p.add_argument("--clients", type=positive_int, default=50, help="number of clients (default 50)")
    p.add_argument(
        "--unseen",
        type=nonnegative_int,
        default=10,
        help="unseen (Future) clients among them, fewer than --clients (default 10)",
    )
    p.add_argument("--alpha", type=positive_float, default=0.5, help="Dirichlet concentration (default 0.5)")
    p.add_argument("--scheme", choices=SCHEMES, default="dirichlet-equal", help="partition scheme")
    p.add_argument(
        "--eval-fraction", type=open_unit, default=0.2, help="seen clients' eval share, in (0, 1) (default 0.2)"
    )
    p.add_argument("--context-size", type=nonnegative_int, default=333, help="conditioning set size m_c (default 333)")
    p.add_argument("--seed", type=int, required=True, help="seed (the reported runs use 41..45)")
    p.add_argument("--max-rows", type=positive_int, default=60, help="clients shown in the table (default 60)")
    p.add_argument("--plot", default=None, help="write a stacked-bar PNG of class shares to this path")
    p.set_defaults(func=_partition)
