"""Shape-alike GGUF models: a real model's metadata and tensor layout, random tensor contents.

    python scripts/shape_alike_gguf.py skeleton SRC.gguf DEST.gguf
    python scripts/shape_alike_gguf.py build SKELETON.gguf DEST.gguf [--seed 0]

`skeleton` keeps every metadata key/value of SRC (the whole tokenizer and chat template
included) and, under the key `localllm.shape_alike.tensors`, a JSON list of
``[name, ggml type name, shape]`` for every tensor in file order (the shape as the GGUF stores
it, fastest dimension first); no tensor data, so a few MB. `build` writes the full-size file
back from it: the same metadata in the same order, the same tensors with the same types,
shapes and offsets (so the same file size as SRC), and random contents of a sane size:
quantized blocks are random bytes whose float16 scales are set so that weights dequantize to
about 0.04 in standard deviation; 1-D float tensors named ``*norm.weight`` are 1.0, other
float tensors normal(0, 0.02). Such a file loads and runs like the real one (speed, memory,
every structural test) but says nothing of output quality.

The skeleton is for carrying a model's shape where its weights cannot go (a machine without
network). The metadata section is read here directly, not with gguf.GGUFReader, which builds
numpy views of every vocabulary string (seconds for a 262k-token vocabulary); it is written
with gguf.GGUFWriter.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

TENSORS_KEY = "localllm.shape_alike.tensors"
ARCH_KEY = "general.architecture"
ALIGNMENT_KEY = "general.alignment"
DEFAULT_ALIGNMENT = 32

# GGUF value type id -> numpy dtype of its scalars (8: string and 9: array are read apart).
_SCALAR_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
                  10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _BOOL = 8, 9, 7

# ggml type name -> (bytes per block, byte offsets of the block's float16 scale fields, the
# value of those scales). Scales are drawn from [0.5, 1.5) times the value, chosen so that a
# block of random bytes dequantizes to a standard deviation of about 0.04 (for the K-quants
# the min scale, the second field, is set so the mean is about 0).
QUANT_BLOCKS = {
    "Q4_0": (18, (0,), (0.009,)),               # d, then 16 bytes of 4-bit values: d * (q - 8)
    "Q5_0": (22, (0,), (0.0045,)),              # d, qh[4], qs[16]: d * (q - 16)
    "Q8_0": (34, (0,), (0.00055,)),             # d, then 32 int8: d * q
    "Q4_K": (144, (0, 2), (1.5e-4, 1.1e-3)),    # d, dmin, scales[12], qs[128]: d * sc * q - dmin * m
    "Q5_K": (176, (0, 2), (7.5e-5, 1.15e-3)),   # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": (210, (208,), (3e-5,)),             # ql[128], qh[64], int8 scales[16], d: d * sc * (q - 32)
}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


class ShapeAlikeError(Exception):
    pass


class Metadata:
    """A GGUF file's key/values (in file order, as ``(key, type id, value, item type id)``:
    strings as bytes, arrays as lists) and tensor table (``[name, type name, shape]``)."""

    def __init__(self, kvs: list[tuple], tensors: list[list], alignment: int, data_start: int):
        self.kvs, self.tensors, self.alignment, self.data_start = kvs, tensors, alignment, data_start

    def value(self, key: str):
        return next((value for k, _, value, _ in self.kvs if k == key), None)


def read_metadata(path: Path) -> Metadata:
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def unpack(fmt: str):
            nonlocal pos
            values = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return values

        def string() -> bytes:
            nonlocal pos
            (n,) = unpack("<Q")
            pos += n
            return bytes(buf[pos - n:pos])

        def scalar(vtype: int):
            nonlocal pos
            dtype = np.dtype(_SCALAR_DTYPES[vtype])
            value = np.frombuffer(buf, dtype, 1, pos)[0].item()
            pos += dtype.itemsize
            return bool(value) if vtype == _BOOL else value

        magic, version, num_tensors, num_kv = unpack("<4sIQQ")
        if magic != b"GGUF" or version != 3:
            raise ShapeAlikeError(f"{path}: not a GGUF version 3 file (magic {magic!r}, version {version})")
        kvs = []
        for _ in range(num_kv):
            key = string().decode()
            (vtype,) = unpack("<I")
            if vtype == _STRING:
                kvs.append((key, vtype, string(), None))
            elif vtype == _ARRAY:
                item_type, count = unpack("<IQ")
                if item_type == _STRING:
                    items = [string() for _ in range(count)]
                elif item_type in _SCALAR_DTYPES:
                    dtype = np.dtype(_SCALAR_DTYPES[item_type])
                    items = np.frombuffer(buf, dtype, count, pos).tolist()
                    pos += count * dtype.itemsize
                    if item_type == _BOOL:
                        items = [bool(v) for v in items]
                else:
                    raise ShapeAlikeError(f"{path}: {key} is an array of arrays, which this script "
                                          "does not copy")
                kvs.append((key, vtype, items, item_type))
            else:
                kvs.append((key, vtype, scalar(vtype), None))
        tensors = []
        for _ in range(num_tensors):
            name = string().decode()
            (n_dims,) = unpack("<I")
            shape = list(unpack(f"<{n_dims}Q"))
            type_id, _offset = unpack("<IQ")
            tensors.append([name, gguf.GGMLQuantizationType(type_id).name, shape])
    alignment = next((int(v) for k, _, v, _ in kvs if k == ALIGNMENT_KEY), DEFAULT_ALIGNMENT)
    return Metadata(kvs, tensors, alignment, -(-pos // alignment) * alignment)


def _writer(dest: Path, meta: Metadata):
    """A GGUFWriter holding ``meta``'s key/values in their order."""
    import gguf

    arch = meta.value(ARCH_KEY)
    if not isinstance(arch, bytes):
        raise ShapeAlikeError(f"the model does not say its architecture ({ARCH_KEY})")
    writer = gguf.GGUFWriter(dest, arch.decode())
    writer.data_alignment = meta.alignment
    writer.kv_data[0].clear()  # the writer adds general.architecture first; keep the file's order
    for key, vtype, value, item_type in meta.kvs:
        if vtype == _ARRAY and not value:
            raise ShapeAlikeError(f"{key} is an empty array, which gguf.GGUFWriter cannot write")
        writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                             sub_type=None if item_type is None else gguf.GGUFValueType(item_type))
    return writer


def skeleton(src: Path, dest: Path) -> Metadata:
    meta = read_metadata(src)
    meta.kvs = [kv for kv in meta.kvs if kv[0] != TENSORS_KEY]
    meta.kvs.append((TENSORS_KEY, _STRING, json.dumps(meta.tensors, separators=(",", ":")).encode(), None))
    writer = _writer(dest, meta)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return meta


def tensor_nbytes(type_name: str, shape: list[int]) -> int:
    import gguf

    block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if shape[0] % block_size:
        raise ShapeAlikeError(f"a {type_name} tensor of shape {shape} is not whole blocks of {block_size}")
    return int(np.prod(shape, dtype=np.int64)) // block_size * block_bytes


def check_type(name: str, type_name: str) -> None:
    if type_name not in FLOAT_TYPES and type_name not in QUANT_BLOCKS:
        raise ShapeAlikeError(f"tensor {name} is of type {type_name}, which this script cannot fill; "
                              f"it knows {', '.join([*FLOAT_TYPES, *QUANT_BLOCKS])}")


def random_tensor(name: str, type_name: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    """The contents of one tensor: float (``np.float32``/``np.float16``, numpy's order) or the
    raw bytes of its quantized blocks."""
    count = int(np.prod(shape, dtype=np.int64))
    if type_name in FLOAT_TYPES:
        dtype = FLOAT_TYPES[type_name]
        if len(shape) == 1 and name.endswith("norm.weight"):
            return np.ones(count, dtype=dtype)
        return rng.normal(0.0, 0.02, count).astype(dtype).reshape(tuple(reversed(shape)))
    check_type(name, type_name)
    block_bytes, offsets, scales = QUANT_BLOCKS[type_name]
    nbytes = tensor_nbytes(type_name, shape)
    blocks = rng.integers(0, 256, nbytes, dtype=np.uint8).reshape(-1, block_bytes)  # (n_blocks, block_bytes)
    for offset, scale in zip(offsets, scales):
        d = (scale * rng.uniform(0.5, 1.5, len(blocks))).astype(np.float16)  # (n_blocks,)
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def build(skeleton_path: Path, dest: Path, seed: int = 0) -> Metadata:
    import gguf

    meta = read_metadata(skeleton_path)
    listing = meta.value(TENSORS_KEY)
    if listing is None:
        raise ShapeAlikeError(f"{skeleton_path} is not a skeleton (it has no {TENSORS_KEY}); make one "
                              "with: python scripts/shape_alike_gguf.py skeleton SRC.gguf DEST.gguf")
    meta.kvs = [kv for kv in meta.kvs if kv[0] != TENSORS_KEY]
    meta.tensors = json.loads(listing)
    for name, type_name, _ in meta.tensors:  # fail before writing anything
        check_type(name, type_name)
    partial = dest.with_name(dest.name + ".partial")
    writer = _writer(partial, meta)
    for name, type_name, shape in meta.tensors:
        qtype = gguf.GGMLQuantizationType[type_name]
        dtype = np.dtype(FLOAT_TYPES.get(type_name, np.float32))
        writer.add_tensor_info(name, tuple(reversed(shape)), dtype, tensor_nbytes(type_name, shape),
                               raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, type_name, shape in meta.tensors:  # one tensor in memory at a time
        writer.write_tensor_data(random_tensor(name, type_name, shape, rng))
    writer.close()
    os.replace(partial, dest)
    return meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("skeleton", help="a real model's metadata and tensor list, no tensor data")
    one.add_argument("src", type=Path)
    one.add_argument("dest", type=Path)
    two = commands.add_parser("build", help="the full-size file, random contents, from a skeleton")
    two.add_argument("skeleton", type=Path)
    two.add_argument("dest", type=Path)
    two.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    try:
        if args.command == "skeleton":
            meta = skeleton(args.src, args.dest)
        else:
            meta = build(args.skeleton, args.dest, args.seed)
    except ShapeAlikeError as e:
        print(f"shape_alike_gguf: {e}", file=sys.stderr)
        return 1
    print(f"{args.dest}: {len(meta.kvs)} keys, {len(meta.tensors)} tensors, "
          f"{args.dest.stat().st_size:,} bytes in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
