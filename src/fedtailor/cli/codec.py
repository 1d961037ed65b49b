"""``fedtailor codec``: round trips of stored vectors through a codec, and the codec benchmark table.

* ``fedtailor codec roundtrip --codec lrsuq --sigma S --input U.npy --seed N --out OUT.npz``: each row of U
  (shape (n, d); a (d,) vector is one row) is one release with key ``release_key(seed, client, row)``; the npz
  holds ``decoded`` (n, d), ``bits`` (n,) (message lengths), ``keys`` (n,) and the settings.
* ``fedtailor codec bench``: the side-by-side table of docs/codecs.md (bpc, encode/decode ms per release).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np

from fedtailor.cli.checks import positive_float as _positive_float
from fedtailor.cli.checks import positive_int as _positive_int
from fedtailor.codecs import CODEC_NAMES, get_codec, release_key
from fedtailor.codecs.bench import bench_codecs, bench_notes, markdown, single_thread


def _alpha(text: str) -> float:
    """PPR's alpha: a float above 1, or inf."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"alpha must be a number above 1 or inf, got {text!r}") from None
    if not value > 1.0:
        raise argparse.ArgumentTypeError(f"alpha must be above 1 (or inf), got {text!r}")
    return value


def _codec_options(args: argparse.Namespace) -> dict[str, object]:
    options: dict[str, object] = {}
    if args.codec == "lrsuq":
        options = {"block_size": args.block_size, "lattice": args.lattice, "coder": args.coder or "elias"}
    elif args.codec == "layered":
        options = {"coder": args.coder or "elias"}
    elif args.codec == "ppr":
        options = {"block_size": args.block_size, "alpha": args.alpha, "clip": args.clip, "spread": args.spread}
        options["coder"] = args.coder or "ans"
    return options


def roundtrip(
    inputs: np.ndarray,
    *,
    codec_name: str,
    options: dict[str, object],
    sigma: float,
    seed: int,
    client: int = 0,
) -> dict[str, np.ndarray]:
    """Encode and decode every row as one release; returns decoded rows, message bits and the 256-bit keys (as
    64-digit hex strings)."""
    rows = np.atleast_2d(np.asarray(inputs, dtype=np.float64))
    if rows.ndim != 2:
        raise ValueError(f"input must have shape (n, d) or (d,), got {np.shape(inputs)}")
    codec = get_codec(codec_name, **options)
    decoded = np.empty_like(rows)
    bits = np.empty(rows.shape[0], dtype=np.int64)
    keys = []
    for r, u in enumerate(rows):
        key = release_key(seed, client, r)
        msg = codec.encode(u, key=key, sigma=sigma)
        decoded[r] = codec.decode(msg, key=key, sigma=sigma, dim=u.size)
        bits[r] = 8 * len(msg)
        keys.append(f"{key:064x}")
    return {"decoded": decoded, "bits": bits, "keys": np.array(keys)}


def _cmd_roundtrip(args: argparse.Namespace) -> int:
    path = Path(args.input)
    if not path.is_file():
        raise FileNotFoundError(f"input file {path} not found (expected a .npy array of shape (n, d))")
    try:
        inputs = np.load(path, allow_pickle=False)
    except Exception as err:
        raise ValueError(
            f"{path} is not a .npy array file ({type(err).__name__}); save the inputs with "
            "numpy.save(path, array) as a float array of shape (n, d) or (d,)."
        ) from None
    if not isinstance(inputs, np.ndarray) or inputs.ndim not in (1, 2) or inputs.size == 0:
        shape = getattr(inputs, "shape", None)
        raise ValueError(
            f"{path} holds an array of shape {shape}; expected a non-empty float array of shape (n, d) or (d,)."
        )
    if not np.issubdtype(inputs.dtype, np.number) or np.iscomplexobj(inputs):
        raise ValueError(f"{path} holds {inputs.dtype} values; expected real numbers (float64 or float32).")
    if not np.all(np.isfinite(inputs)):
        raise ValueError(f"{path} contains NaN or infinite values; a release needs finite inputs.")
    options = _codec_options(args)
    out = roundtrip(
        inputs, codec_name=args.codec, options=options, sigma=args.sigma, seed=args.seed, client=args.client
    )
    np.savez(
        args.out,
        **out,
        codec=np.array(args.codec),
        options=np.array(json.dumps(options)),
        sigma=np.array(args.sigma),
        seed=np.array(args.seed),
        client=np.array(args.client),
    )
    rows = np.atleast_2d(inputs)
    err = out["decoded"] - rows
    print(
        f"{rows.shape[0]} release(s) of d = {rows.shape[1]} through {args.codec} {options}: "
        f"{out['bits'].mean() / rows.shape[1]:.4f} bits per coefficient, "
        f"rms(decoded - input) / sigma = {np.sqrt(np.mean(err**2)) / args.sigma:.4f}; wrote {args.out}"
    )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    with single_thread():
        rows = bench_codecs(k=args.k, sigma=args.sigma, norm=args.norm, releases=args.releases, seed=args.seed)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"machine: {platform.platform()}, {platform.processor() or 'cpu'}, numpy {np.__version__}, one thread")
    print(markdown(rows))
    print(bench_notes(k=args.k, sigma=args.sigma, norm=args.norm))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fedtailor codec roundtrip`` and ``fedtailor codec bench``."""
    codec = subparsers.add_parser("codec", help="communication codecs: DG FP32, DG+Q12, layered, LRSUQ, PPR")
    sub = codec.add_subparsers(dest="codec_command", required=True, metavar="SUBCOMMAND")
    rt = sub.add_parser(
        "roundtrip",
        help="encode and decode each row of a .npy array as one release",
        description="Each row of --input (shape (n, d)) is one release with key release_key(seed, client, row); "
        "writes the decoded rows, the message length in bits of each release and the keys to --out (.npz).",
    )
    rt.add_argument("--codec", choices=CODEC_NAMES, default="lrsuq", help="codec (default lrsuq)")
    rt.add_argument("--sigma", type=_positive_float, required=True, help="noise standard deviation")
    rt.add_argument("--input", required=True, help=".npy file with the inputs, shape (n, d)")
    rt.add_argument("--seed", type=int, required=True, help="run secret from which release keys are derived")
    rt.add_argument("--client", type=int, default=0, help="client id in the release keys (default 0)")
    rt.add_argument("--out", required=True, help="output .npz")
    rt.add_argument("--block-size", type=_positive_int, default=4, help="lrsuq/ppr block size b (default 4)")
    rt.add_argument("--lattice", choices=("Z", "D4"), default="Z", help="lrsuq lattice (default Z)")
    rt.add_argument(
        "--coder", choices=("elias", "ans"), help="entropy coder (default: elias for lrsuq/layered, ans for ppr)"
    )
    rt.add_argument("--alpha", type=_alpha, default=8.0, help="ppr's alpha, > 1 or inf (default 8)")
    rt.add_argument("--clip", type=_positive_float, default=1.0, help="ppr: the public bound on ||u|| (default 1)")
    rt.add_argument("--spread", type=_positive_float, default=2.5, help="ppr: proposal spread (default 2.5)")
    rt.set_defaults(func=_cmd_roundtrip)
    bench = sub.add_parser(
        "bench",
        help="bits per coefficient and encode/decode time of every codec, side by side",
        description="Times one encode and one decode per release (median over releases, one thread) at the "
        "eps = 16 setting and prints the markdown table with the floor and the figures of *Privacy-Aligned "
        "Personalized Federated Learning with Compact Adaptation and Variable-Length Gaussian "
        "Communication*.",
    )
    bench.add_argument("--k", type=_positive_int, default=16384, help="coefficients per release (default 16384)")
    bench.add_argument("--sigma", type=_positive_float, default=0.01468, help="noise std (default 0.01468)")
    bench.add_argument("--norm", type=_positive_float, default=1.0, help="||u|| of each release (default 1)")
    bench.add_argument("--releases", type=_positive_int, default=20, help="releases per codec (default 20)")
    bench.add_argument("--seed", type=int, default=0, help="seed of inputs and keys (default 0)")
    bench.add_argument("--json", action="store_true", help="print the rows as JSON")
    bench.set_defaults(func=_cmd_bench)
