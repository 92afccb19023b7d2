"""Converted weights kept on disk: the second load of a GGUF reads one safetensors file
instead of dequantizing and re-packing every tensor.

The file is named by what its bytes depend on: the GGUF's identity (path, size, mtime), the
weight scheme, the torch version and the CPU capability torch packs int4 for (its packed
layout differs between AVX2 and AVX-512). It is written like every file localllm keeps
(temporary file, fsync, rename); one that cannot be read back is deleted with one warning
and the weights are converted again. Safetensors holds tensors and a string header only:
nothing in it is executed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("localllm.weight_cache")
FORMAT = 4  # 2: gguf-blocks keeps Q4_K / Q6_K as blocks where the native kernels read them; 3: Q5_K too;
# 4: only what was converted (blocks read in place come from the GGUF itself)


class WeightCache:
    def __init__(self, directory: Path, gguf_path: Path, scheme: str):
        st = Path(gguf_path).stat()
        capability = torch.backends.cpu.get_cpu_capability()
        identity = (f"{Path(gguf_path).resolve()}|{st.st_size}|{st.st_mtime_ns}|{scheme}|torch {torch.__version__}|"
                    f"{capability}|format {FORMAT}")
        key = hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()
        self.path = Path(directory) / f"{Path(gguf_path).stem}-{key}.safetensors"

    def load(self) -> dict[str, torch.Tensor] | None:
        """The converted tensors, or None (not cached yet, or unreadable: then deleted)."""
        if not self.path.exists():
            return None
        from safetensors.torch import load_file

        try:
            # Copies, not the file's mapping: torch's packed int4 kernel needs its weights on
            # the allocator's aligned memory (on a mapped, 8-byte-aligned tensor it crashes).
            return {name: t.clone() for name, t in load_file(self.path).items()}
        except Exception as e:  # safetensors raises its own errors on a damaged file
            log.warning("dropped the converted weights %s (%s); converting again", self.path.name, e)
            self.path.unlink(missing_ok=True)
            return None

    def save(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write them atomically; a failure (a full disk) is one warning, the model runs."""
        from safetensors.torch import save_file

        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".safetensors")
            os.close(fd)
            save_file({k: t.contiguous() for k, t in tensors.items()}, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not keep the converted weights in %s (%s); the next load converts again",
                        self.path.parent, e.strerror or e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
