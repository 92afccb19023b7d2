"""Speculative decoding in the real engine on the real Qwen2.5-Coder-0.5B file, on both runners:
greedy output unchanged by drafting (single and batched; exactly so on the torch runner), the
KV cache rolled back to exactly the accepted tokens, stops and limits inside an accepted run,
and sampling that keeps the model's distribution (a chi-square test). The single-prompt and
chi-square cases are marked heavy: the test command runs them trimmed (5 prompts, 192 seeds
an arm), ``--full`` at full size (20 prompts, 640 seeds an arm)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runners import runner_names  # noqa: E402

SNIPPET = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''

QUOTE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was "
         "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity.")

# Twenty varied prompts: edits and quotes (drafts are mostly right), lists, code and prose
# (drafts are mostly wrong, or there are none).
PROMPTS = [
    f"Rename the function moving_average to rolling_mean. Reply with the whole code only.\n\n{SNIPPET}",
    f"Add type hints to this function. Reply with the code only.\n\n{SNIPPET}",
    f"Change the error message to 'window must be at least 1'. Reply with the code only.\n\n{SNIPPET}",
    f"Repeat this text exactly, then say what book it is from:\n\n{QUOTE}",
    f"Quote the first sentence of this text and explain it briefly:\n\n{QUOTE}",
    "Count from 1 to 30, separated by commas.",
    "List the days of the week, twice.",
    "Write the alphabet in capital letters, separated by spaces.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a SQL query that finds the ten customers with the most orders.",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash map is in three sentences.",
    "Give three tips for writing readable code.",
    "Translate 'good morning, how are you?' into Spanish, French and German.",
    "Write a haiku about the sea.",
    "What does HTTP status 404 mean?",
    "Convert this JSON to YAML: {\"name\": \"localllm\", \"version\": 1, \"tags\": [\"a\", \"b\"]}",
    "Write a regular expression that matches an ISO date like 2024-05-17.",
    "Fix the bug: def add(a, b): return a - b",
]
# The trimmed run's five: three where drafts are mostly right (an edit of code, a change of its
# types, a text repeated), a list the prompt does not hold, an answer with no drafts at all.
TRIMMED = [PROMPTS[i] for i in (0, 1, 3, 5, 11)]
MAX_TOKENS = 40  # 64 proved no more: the answers part from the plain run, if they do, in their first 40 tokens
# How far apart (nats) the plain run's choice and the drafted run's may be where they part:
# 0.126 was seen on an AVX2-only EPYC (llama.cpp's AVX2 kernels), under 0.1 on AVX-512 ones.
NEAR_TIE = 0.2


@pytest.fixture(params=runner_names())
def engine(engines, qwen_path, request):
    return engines.get(qwen_path, request.param)


def chat(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def generate(engine: LLMEngine, prompts: list[list[int]], speculative: bool | None, **params):
    """Run prompts together; per prompt its output tokens and metrics. After every step, each
    running sequence's KV in the runner ends exactly at its computed tokens."""
    seqs = [engine.add_request(p, SamplingParams(speculative=speculative, **params)) for p in prompts]
    tokens = {s.request_id: [] for s in seqs}
    metrics, finish = {}, {}
    while engine.has_unfinished:
        for o in engine.step():
            tokens[o.request_id] += o.token_ids
            if o.finished:
                metrics[o.request_id], finish[o.request_id] = o.metrics, o.finish_reason
        for s in engine.scheduler.running:
            lo_hi = engine.runner.seq_pos_range(s.seq_id)
            assert lo_hi is not None and lo_hi[1] == s.num_computed_tokens - 1, (lo_hi, s.num_computed_tokens)
    assert engine.block_manager.num_used_blocks == 0
    return [(tokens[s.request_id], metrics[s.request_id], finish[s.request_id]) for s in seqs]


def reference(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    """Greedy outputs without drafts, and each position's five likeliest tokens with their
    logprobs. The prompts are computed once before, so that this run and the drafted one
    both find them in the prefix cache and compute the same tail of each prompt."""
    generate(engine, prompts, False, temperature=0.0, max_tokens=1)
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, speculative=False,
                                                 logprobs=True, top_logprobs=5)) for p in prompts]
    tokens = {s.request_id: [] for s in seqs}
    tops = {s.request_id: [] for s in seqs}
    while engine.has_unfinished:
        for o in engine.step():
            tokens[o.request_id] += o.token_ids
            tops[o.request_id] += o.top_logprobs
    return [(tokens[s.request_id], tops[s.request_id]) for s in seqs]


def same_or_near_tie(drafted: list[int], plain: list[int], tops: list) -> bool:
    """True when the outputs are identical. Otherwise they must part at a near-tie: the token
    the drafted run took there was within NEAR_TIE nats of the plain run's choice. llama.cpp
    computes a position's logits slightly differently in a batch of 1 + k tokens than alone
    (as it does in a batch of other sequences' tokens, and with or without a cached prefix),
    so a near-tie can flip; anything else is a wrong acceptance."""
    d = next((i for i, (a, b) in enumerate(zip(drafted, plain)) if a != b), None)
    if d is None:
        assert len(drafted) == len(plain)
        return True
    logprobs = dict(tops[d])
    assert tops[d][0][0] == plain[d] and logprobs[plain[d]] - logprobs.get(drafted[d], -1e9) < NEAR_TIE, \
        (d, tops[d], drafted[d])
    return False


@pytest.mark.heavy
def test_greedy_output_is_the_same_with_drafting_forced_on_single(engine, full):
    prompts = PROMPTS if full else TRIMMED
    num_same = proposed = accepted = 0
    for text in prompts:
        prompt = chat(engine, text)
        [(plain, tops)] = reference(engine, [prompt])
        [(drafted, m, _)] = generate(engine, [prompt], True, temperature=0.0, max_tokens=MAX_TOKENS)
        num_same += same_or_near_tie(drafted, plain, tops)
        proposed, accepted = proposed + m.num_draft_proposed, accepted + m.num_draft_accepted
    # llama.cpp: 15 of 20 on the 2-core EPYC where this was written; the torch runner computes
    # a drafted position as it decodes it (see paged_attention), so all of them.
    assert num_same >= (len(prompts) if engine.runner.name == "torch" else -(-len(prompts) * 7 // 10))
    assert accepted > 10 * len(prompts) and proposed > accepted  # drafts were made, kept and rejected


def test_greedy_output_is_the_same_with_drafting_forced_on_batched(engine):
    prompts = [chat(engine, t) for t in PROMPTS[:6]]  # five with drafts mostly right, one list
    plain = reference(engine, prompts)
    drafted = generate(engine, prompts, True, temperature=0.0, max_tokens=MAX_TOKENS)
    num_same = sum(same_or_near_tie(d, p, tops) for (d, _, _), (p, tops) in zip(drafted, plain))
    assert num_same >= (len(prompts) if engine.runner.name == "torch" else 4)
    assert sum(m.num_draft_accepted for _, m, _ in drafted) > 50


def test_stops_and_limits_inside_an_accepted_run_end_at_the_right_token(engine):
    prompt = chat(engine, f"Repeat this text exactly:\n\n{QUOTE}")  # drafts cover the whole answer
    [(full, _, _)] = generate(engine, [prompt], False, temperature=0.0, max_tokens=MAX_TOKENS)
    assert engine.tokenizer.decode(full).startswith(QUOTE[:40])
    for max_tokens in (5, 17):  # drafts are cut to the tokens max_tokens leaves
        [(on, m, reason)] = generate(engine, [prompt], True, temperature=0.0, max_tokens=max_tokens)
        assert (on, reason) == (full[:max_tokens], "length")
        assert m.num_draft_accepted >= max_tokens - 2  # all but the first and last came from drafts
    outs = []
    for speculative in (False, True):  # "age of" ends the text inside a run of accepted drafts
        seq = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["age of"],
                                                        speculative=speculative))
        merged = ""
        while engine.has_unfinished:
            for o in engine.step():
                merged += o.text
        outs.append((merged, seq.finish_reason.value, seq.num_draft_accepted))
    assert outs[0][:2] == outs[1][:2] == ("It was the best of times, it was the worst of times, it was the ", "stop")
    assert outs[1][2] > 10
    eos = [t for t in full if engine.tokenizer.is_eog(t)]
    assert not eos or full[-1] == eos[0]  # EOS ends the run like any decode step


def test_a_logit_bias_holds_in_drafted_runs(engine):
    """Drafts copy the prompt, banned token and all: verify applies the bias to every row, so the
    banned token is never emitted, and the drafts around it are still accepted."""
    prompt = chat(engine, f"Repeat this text exactly:\n\n{QUOTE}")
    [times] = engine.tokenizer.encode(" times", add_special=False)
    [(plain, _, _)] = generate(engine, [prompt], False, temperature=0.0, max_tokens=24)
    assert times in plain
    [(banned, m, _)] = generate(engine, [prompt], True, temperature=0.0, max_tokens=24, logit_bias={times: -100})
    assert times not in banned and banned[:5] == plain[:5]  # "It was the best of" and then not " times"
    assert m.num_draft_accepted > 5


@pytest.mark.heavy
@pytest.mark.parametrize("runner", runner_names())
def test_sampling_with_drafts_keeps_the_models_distribution(engines, qwen_path, runner, full):
    """The second and third sampled tokens (a separator and the second color: the draft
    guesses what followed the first color in the prompt), with drafting forced on and off,
    over 640 seeds each (192 trimmed): a two-sample chi-square test on their joint counts must not reject
    (p > 0.001). The prompt is a random list of a few colors, so drafts from it are often
    right and often wrong. (The same seeds give mostly the same draws both ways: a verify
    step takes each row's token with the draw plain sampling would use.)

    The acceptance rule is the engine's, the same for both runners; what a runner adds, the
    logits of drafted rows, is held by the greedy cases above on each runner (the torch
    runner's equal to plain decoding on every prompt). So the trimmed run tests the rule on
    llama.cpp, the default runner on a CPU, and `--full` on both."""
    if runner == "torch" and not full:
        pytest.skip("the drafted-sampling rule is tested on llama.cpp; --full tests it on the torch runner too")
    engine = engines.get(qwen_path, runner, n_ctx=8192, max_num_seqs=64)
    prompt = chat(engine, "Continue this list of random colors, one per line, with 20 more:\n"
                          "red\nblue\ngreen\nred\ngreen\nblue\nblue\nred\ngreen\nyellow\nred")
    params = dict(temperature=1.0, top_k=4, max_tokens=3)  # the third token is the last tested
    counts: dict[bool, dict[tuple[int, ...], int]] = {}
    accepted = rejected = 0
    for speculative in (False, True):
        counts[speculative] = {}
        for batch in range(10 if full else 3):
            seqs = [engine.add_request(prompt, SamplingParams(seed=1000 * batch + i, speculative=speculative, **params))
                    for i in range(64)]
            while engine.has_unfinished:
                engine.step()
            for s in seqs:
                key = tuple(s.output_token_ids[1:3])  # (the separator, the second color); () at EOS
                counts[speculative][key] = counts[speculative].get(key, 0) + 1
                accepted += s.num_draft_accepted
                rejected += s.num_draft_proposed - s.num_draft_accepted
    assert accepted > 30 and rejected > 30  # both branches of the rule were taken
    keys = sorted(set(counts[False]) | set(counts[True]))
    table = np.array([[counts[s].get(k, 0) for k in keys] for s in (False, True)])  # (2, outcomes)
    table = table[:, table.sum(axis=0) >= 10]  # outcomes too rare to test are left out
    statistic, df = chi_square(table)
    assert df >= 3 and statistic < chi_square_critical(df, z=3.09)  # z 3.09: p = 0.001


def chi_square(table: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of a (2, k) contingency table and its degrees of freedom."""
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


def chi_square_critical(df: int, z: float) -> float:
    """The chi-square quantile with df degrees of freedom at the normal quantile z
    (Wilson-Hilferty: within 1 % of the exact value for df >= 3)."""
    c = 2 / (9 * df)
    return df * (1 - c + z * c ** 0.5) ** 3
