"""sentence-transformers' own token ids and vectors of the embedding tests' sentences, written
once to tests/data/minilm_reference.json so the test suite compares the Embedder against the
reference implementation without importing it (sentence-transformers pulls transformers,
scikit-learn and scipy: about half a minute of every CI run).

    pip install 'sentence-transformers>=3.0'   # the `bench` extra
    python scripts/minilm_reference.py

Run it again when the sentences (tests/integration/test_embeddings.py) or the test model change.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "integration"), str(ROOT / "scripts")]

import test_models  # noqa: E402
from localllm.files import write_atomic  # noqa: E402

OUT = ROOT / "tests" / "data" / "minilm_reference.json"


def main() -> None:
    import sentence_transformers as st
    import torch
    from test_embeddings import SENTENCES

    torch.set_num_threads(2)
    test_models.ensure("all-minilm-l6-v2", test_models.default_dest())
    folder = test_models.source_dir("all-minilm-l6-v2")
    model = st.SentenceTransformer(str(folder), device="cpu")
    vectors = model.encode(SENTENCES, batch_size=len(SENTENCES), convert_to_numpy=True)
    data = {
        "made_by": f"sentence-transformers {st.__version__}, torch {torch.__version__}, "
                   "scripts/minilm_reference.py",
        "model": "all-MiniLM-L6-v2 (the safetensors folder scripts/test_models.py unpacks)",
        "sentences": SENTENCES,
        "token_ids": [model.tokenizer(s)["input_ids"] for s in SENTENCES],
        "vectors": [[float(f"{x:.7g}") for x in v] for v in vectors.tolist()],
    }
    write_atomic(OUT, json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode())
    print(f"wrote {OUT} ({len(SENTENCES)} sentences)")


if __name__ == "__main__":
    main()
