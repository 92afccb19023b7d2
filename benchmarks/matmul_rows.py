"""The torch runner's native matmuls on one model's own matrices, at 1, 2, 3, 4 and 8 rows of x (--rows):
what a step of n tokens costs in its matmuls alone (a draft's check, a batch of streams), per
block format, against one row.

    python benchmarks/matmul_rows.py [--model qwen2.5-coder-0.5b] [--threads 2] [--rounds 5]
                                     [--rows 1,2,3,4,8] [--against OTHER_BUILD.so] [--against-layout]

Every matrix of the model is multiplied in turn (as a step does: each one read from memory),
rounds times; the figures are medians per matrix, summed over the model. --against names
another build of localllm._native (e.g. one built from an earlier commit with `python setup.py
build_ext` and copied away): both builds multiply the same matrices, alternating, in one run, so
the two columns compare kernels on the same machine state (each build's whole sweep in turn,
since each has its own pool of workers); LOCALLLM_NATIVE_ISA holds both builds to one tier.
--against-layout compares, in the same build, the matrices kept with 8 rows interleaved (Q4_0R,
Q5_0R, Q8_0R: native/rows8.c) with the same matrices in the layout they had before it (the
file's blocks, or Q4_0 / Q5_0 in pairs).
Run it on a quiet machine: it times microseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from collections import defaultdict

import torch
from _common import machine, median, model_path

from localllm.config import CacheConfig, EngineConfig
from localllm.runners.torch import native, quant
from localllm.runners.torch.runner import TorchRunner

ROWS = (1, 2, 3, 4, 8)


def block_layers(model) -> list[quant.BlockLinear]:
    """The model's matrices kept in blocks, in the order a step multiplies them."""
    out = []
    for layer in model.layers:
        for value in layer.values():
            groups = [g for g, _ in value.groups] if hasattr(value, "groups") else [value]
            out += [g for g in groups if isinstance(g, quant.BlockLinear)]
    if isinstance(model.lm_head, quant.BlockLinear):
        out.append(model.lm_head)
    return out


def timed(fn, layer: quant.BlockLinear, x: torch.Tensor, threads: int) -> float:
    y = torch.empty(x.shape[0], layer.matmul.n)
    start = time.perf_counter()
    rc = fn(x.data_ptr(), x.shape[0], layer.in_features, layer.matmul.w, layer.matmul.code, layer.matmul.n,
            y.data_ptr(), threads, 0)
    seconds = time.perf_counter() - start
    if rc:
        raise RuntimeError(f"lm_qmatmul failed ({rc})")
    return seconds


class _Matrix:
    """A matrix in another layout, as timed() reads it."""

    def __init__(self, blocks, kind: str, k: int):
        self.kind, self.in_features, self.matmul = kind, k, native.QMatmul(blocks.contiguous(), kind, k)


def earlier_layout(layer: quant.BlockLinear):
    """``layer`` in the layout it had before the rows were interleaved: the file's blocks, or
    Q4_0 / Q5_0 in pairs where the tier's vector loops read them."""
    if not layer.kind.endswith("R"):
        return layer
    kind = native.UNPACKED[layer.kind]
    blocks = native.repack(layer.blocks, kind, reverse=True, packed=layer.kind)
    packed = native.pairs_kind(kind) if native.vector_loops() and layer.in_features % 64 == 0 else None
    if packed:
        blocks, kind = native.repack(blocks, kind, packed=packed), packed
    return _Matrix(blocks, kind, layer.in_features)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", help="another build of localllm._native to compare with")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="the counts of rows of x, comma-separated")
    parser.add_argument("--against-layout", action="store_true",
                        help="compare with the layouts of before the 8 interleaved rows, in this build")
    args = parser.parse_args()
    rows = tuple(int(r) for r in args.rows.split(","))
    torch.set_num_threads(args.threads)
    config = EngineConfig(model_path=model_path(args.model), n_threads=args.threads, runner="torch",
                          cache=CacheConfig(n_ctx=512))
    runner = TorchRunner(config)
    layers = block_layers(runner.model)
    builds = {"this build": native.library().lm_qmatmul}
    of_build = {"this build": layers}
    if args.against_layout:
        builds = {"--against": native.library().lm_qmatmul, **builds}
        of_build["--against"] = [earlier_layout(layer) for layer in layers]
    elif args.against:
        lib = ctypes.CDLL(args.against)
        native._force_isa(lib, os.environ.get(native.ISA_VARIABLE, ""))  # the same tier as this build
        other = lib.lm_qmatmul
        other.restype = ctypes.c_int
        other.argtypes = native.library().lm_qmatmul.argtypes
        builds = {"--against": other, **builds}
        of_build["--against"] = layers
    # seconds[build][rows][(kind, n, k)] -> per-round sums over the matrices of that shape
    seconds: dict = {b: {m: defaultdict(list) for m in rows} for b in builds}
    g = torch.Generator().manual_seed(0)
    xs = {m: {k: torch.randn(m, k, generator=g) for k in {layer.in_features for layer in layers}} for m in rows}
    for _ in range(args.rounds):
        for name, fn in builds.items():
            time.sleep(0.01)  # the other build's pool workers spin 50 us after their last call, then sleep
            for m in rows:
                per_shape: dict = defaultdict(float)
                for layer in of_build[name]:
                    per_shape[(layer.kind, layer.matmul.n, layer.in_features)] += timed(
                        fn, layer, xs[m][layer.in_features], args.threads)
                for shape, s in per_shape.items():
                    seconds[name][m][shape].append(s)
    print(f"{machine()}; {args.threads} threads; {args.model}: {len(layers)} matrices in blocks; "
          f"kernels' tier {native.isa()}; medians of {args.rounds} rounds")
    for name in builds:
        shapes = sorted(seconds[name][1])
        print(f"\n{name}: milliseconds a step spends in each kind of matrix, by rows of x")
        print("| matrix (kind, out x in, count summed) | " + " | ".join(f"{m} row{'s' * (m > 1)}" for m in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for shape in shapes + ["all"]:
            cells = []
            for m in rows:
                if shape == "all":
                    v = sum(median(seconds[name][m][s]) for s in shapes)
                    one = sum(median(seconds[name][1][s]) for s in shapes)
                else:
                    v, one = median(seconds[name][m][shape]), median(seconds[name][1][shape])
                cells.append(f"{v * 1e3:.2f}" + (f" ({v / one:.2f}x)" if m > 1 else ""))
            label = "all" if shape == "all" else f"{shape[0]} {shape[1]} x {shape[2]}"
            print(f"| {label} | " + " | ".join(cells) + " |")
    if len(builds) > 1:
        def total(name, m):
            return sum(median(v) for v in seconds[name][m].values())
        print("\nthis build against --against, all matrices: " + ", ".join(
            f"{m} row{'s' * (m > 1)} {total('this build', m) / total('--against', m):.2f}x" for m in rows))
    runner.close()


if __name__ == "__main__":
    main()
