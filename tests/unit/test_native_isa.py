"""The native kernels' instruction-set switch (native/isa.c, LOCALLLM_NATIVE_ISA): every tier
this CPU has runs when forced, and computes what the portable C loops compute: the block
matmul of every format bit for bit (integer block sums, the float part in one order), attention
bit-identically whatever the drafts beside a position. A tier the CPU lacks, or a name that is no tier, is refused with the fix. Each tier
runs in a process of its own: the switch is the process's, read when the kernels load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from localllm.errors import UsageError  # noqa: E402
from localllm.runners.torch import native  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason="localllm._native was not built here")
ORDER = ["scalar", "avx2", "avxvnni", "avx512vnni"]

# Run in the forced process: the tier in use, and what its kernels compute on fixed inputs.
PROBE = r"""
import json, numpy as np, torch, gguf
from localllm.runners.torch import native
from localllm.runners.torch.attention import AttnBatch, KVPool, block_slots, paged_attention
rng = np.random.default_rng(0)
out = {"isa": native.isa(), "detected": native.isa_detected(), "wide": native.wide_kernels(),
       "k_quants": native.vector_loops(), "mm": {}, "y": {}}
x = torch.from_numpy(rng.standard_normal((5, 768)).astype(np.float32))
for kind in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
    if kind.endswith("_K"):  # random bytes with small finite scales reach every weight, scale and min
        raw = rng.integers(0, 256, (72, 3, native.SUPER_BYTES[kind]), dtype=np.uint8)
        for at in ([208] if kind == "Q6_K" else [0, 2]):
            raw[:, :, at:at + 2] = (rng.random((72, 3, 1)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
        blocks = torch.from_numpy(raw.reshape(72, -1).copy())
    else:
        w = rng.standard_normal((72, 736)).astype(np.float32)  # 23 blocks: an odd last one
        blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]))
    xk = x[:, :768 if kind.endswith("_K") else 736].contiguous()
    got, scalar = native.qmatmul(xk, blocks, kind), native.qmatmul(xk, blocks, kind, force_scalar=True)
    out["mm"][kind] = float((got - scalar).abs().max())
    out["y"][kind] = got.flatten().tolist()
    if kind != "Q5_K":  # 8 rows interleaved, on every tier (72 rows: 9 groups)
        rows8 = native.repack(blocks, kind, packed=kind + "R")
        got = native.qmatmul(xk, rows8, kind + "R")
        out["mm"][kind + "R"] = float((got - native.qmatmul(xk, rows8, kind + "R", force_scalar=True)).abs().max())
        out["y"][kind + "R"] = got.flatten().tolist()
    for packed in {"Q4_0": ["Q4_0P"], "Q5_0": ["Q5_0P", "Q5_0X"]}.get(kind, []) if native.vector_loops() else []:
        # pairs (an even count), in every layout on every tier: the file's blocks' bits
        even, xe = blocks[:, :22 * native.BLOCK_BYTES[kind]].contiguous(), xk[:, :704].contiguous()
        pairs = native.qmatmul(xe, native.repack(even, kind, packed=packed), packed)
        out["mm"][packed] = float((pairs - native.qmatmul(xe, even, kind, force_scalar=True)).abs().max())
gate = torch.from_numpy(rng.standard_normal((3, 205)).astype(np.float32) * 8)  # the vector loop and its tail
out["y"]["silu_mul"] = native.silu_mul(gate, gate.flip(0)).flatten().tolist()
g = torch.Generator().manual_seed(1)
pool = KVPool(1, num_blocks=8, block_size=16, n_kv_heads=2, head_dim=64, dtype=torch.float16)
table = list(range(8))[::-1]
pool.write(0, block_slots(table, 100, 16), torch.randn(100, 2, 64, generator=g), torch.randn(100, 2, 64, generator=g))
q = torch.randn(100, 14, 64, generator=g)
attend = lambda start, num: paged_attention(q[start:start + num], pool, 0,
                                            AttnBatch.build([(table, start, num, True)], 16, "cpu"), 0.125)
alone = attend(90, 1)
out["attn_same_among_drafts"] = all(torch.equal(attend(90, 1 + k)[:1], alone) for k in (1, 4))
out["attn"] = alone.flatten()[:8].tolist()
print(json.dumps(out))
"""


def run_forced(tier: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LOCALLLM_NATIVE_ISA=tier)
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)


def tiers_here() -> list[str]:
    return native.isa_tiers()


def test_every_tier_the_cpu_has_runs_when_forced_and_computes_what_the_portable_loops_do():
    reports = {}
    for tier in tiers_here():
        proc = run_forced(tier)
        assert proc.returncode == 0, proc.stderr
        report = reports[tier] = json.loads(proc.stdout)
        assert (report["isa"], report["detected"]) == (tier, native.isa_detected())
        assert report["wide"] == (tier == "avx512vnni")
        assert report["k_quants"] == (tier != "scalar")
        # The same bits as the portable loop, in the same process and across processes.
        kinds = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0R", "Q5_0R", "Q8_0R", "Q4_KR", "Q6_KR"]
        kinds += ["Q4_0P", "Q5_0P", "Q5_0X"] if tier != "scalar" else []
        assert report["mm"] == dict.fromkeys(kinds, 0.0), tier
        assert report["y"] == reports["scalar"]["y"], tier
        assert report["attn_same_among_drafts"], tier
    first = reports["scalar"]["attn"]
    for tier, report in reports.items():
        torch.testing.assert_close(torch.tensor(report["attn"]), torch.tensor(first), atol=1e-5, rtol=1e-5)


def test_a_tier_the_cpu_lacks_or_no_tier_is_refused_with_the_fix():
    # What the library's load does with LOCALLLM_NATIVE_ISA; a refused name changes nothing.
    lib, before = native.library(), native.isa()
    lacking = next((t for t in ORDER if t not in tiers_here()), None)
    if lacking:
        with pytest.raises(UsageError, match=f"LOCALLLM_NATIVE_ISA={lacking}: this CPU lacks that tier "
                                             f"\\(its best is {native.isa_detected()}\\); force a lower one"):
            native._force_isa(lib, lacking)
    with pytest.raises(UsageError, match="names no tier of the native kernels; use one of scalar, avx2, avxvnni, avx512vnni"):
        native._force_isa(lib, "avx3000")
    native._force_isa(lib, "")  # unset: the CPU's best
    assert native.isa() == before


def test_doctor_names_the_tier_in_use_and_the_cpus_own():
    from localllm.commands.doctor import _tier

    assert _tier({"isa": "avx2", "isa_detected": "avx2"}) == "avx2"
    assert _tier({"isa": "scalar", "isa_detected": "avx512vnni"}) == \
        "scalar (forced by LOCALLLM_NATIVE_ISA; the CPU's best is avx512vnni)"
