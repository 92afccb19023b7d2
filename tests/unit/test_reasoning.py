"""The reasoning split: whole text and stream agree however the stream is cut.

The chat templates under tests/data/chat_templates/ are verbatim copies of the models' own
templates, as llama.cpp vendors them in models/templates/:
- Qwen-Qwen3-0.6B.jinja: the chat_template of Qwen/Qwen3-0.6B's tokenizer_config.json
  (Apache-2.0), copied from llama.cpp's models/templates/Qwen-Qwen3-0.6B.jinja (read from the
  mirror github.com/Indras-Mirror/llama.cpp-turboq-mtp at 76d2e27).
- deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja: the chat_template of
  deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (MIT), from github.com/ggml-org/llama.cpp at 20bdc4f.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest

from localllm import chat_template
from localllm.gguf import read_info
from localllm.reasoning import ReasoningMarkers, ReasoningParser, reasoning_markers, split_reasoning

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
THINK = ReasoningMarkers("<think>", "</think>", starts_inside=False)
INSIDE = ReasoningMarkers("<think>", "</think>", starts_inside=True)
LONG = ReasoningMarkers("<|begin_of_thought|>", "<|end_of_thought|>", starts_inside=False)

# (markers, model output, (reasoning, content) of the whole text)
CASES = [
    # Qwen3 as it writes: "<think>\n" first, "</think>\n\n" before the answer.
    (THINK, "<think>\nThe user says hi.\n</think>\n\nHello! How can I help?",
     ("The user says hi.\n", "Hello! How can I help?")),
    (THINK, "Hello there.", (None, "Hello there.")),  # no block: all content
    (THINK, "\n <think>a</think>b", ("a", "b")),  # the block may follow whitespace
    (THINK, "Sure. <think>x</think> y", (None, "Sure. <think>x</think> y")),  # a late block
    (THINK, "<think>\n\n</think>\n\nHi", (None, "Hi")),  # an empty block
    (THINK, "<think></think>", (None, "")),
    (THINK, "<think>\nstill on it </thi", ("still on it </thi", "")),  # never closed
    (THINK, "<think>r</think>\n\nUse <think> and </think> tags.",
     ("r", "Use <think> and </think> tags.")),  # markers in the content: content as written
    (THINK, "<think>a <think> b</think>c", ("a <think> b", "c")),
    (THINK, "<think>a </thin b < /think></think>c", ("a </thin b < /think>", "c")),
    (THINK, "<think>a <</</think>c", ("a <</", "c")),
    (THINK, "<thinking>no</thinking>", (None, "<thinking>no</thinking>")),  # a near miss
    (THINK, "<thi", (None, "<thi")),  # a start marker cut short is content
    (THINK, "<<think>x", (None, "<<think>x")),
    (THINK, "", (None, "")),
    (THINK, " \n\t", (None, "")),
    (THINK, "<think>日本語で考える 🤔</think>\n答え：４", ("日本語で考える 🤔", "答え：４")),
    (THINK, "\u3000<think>x</think>\u3000\u00a0y 🤔", ("x", "y 🤔")),  # Unicode whitespace
    # The R1 distills: the prompt ended with "<think>\n", the output starts as reasoning.
    (INSIDE, "Okay, so 2+2.\n</think>\n\nThe answer is 4.", ("Okay, so 2+2.\n", "The answer is 4.")),
    (INSIDE, "Hmm, let me think", ("Hmm, let me think", "")),  # never closed
    (INSIDE, "\n<think>\nx</think>y", ("x", "y")),  # the start marker repeated: dropped
    (INSIDE, "</think>\n\nDirect answer", (None, "Direct answer")),
    (INSIDE, "r</think>a</think><think>b", ("r", "a</think><think>b")),
    (INSIDE, "a <think> b </think", ("a <think> b </think", "")),
    (INSIDE, "<thi", ("<thi", "")),
    (INSIDE, "", (None, "")),
    (LONG, "<|begin_of_thought|>x <|end_of_thou y<|end_of_thought|>\n\nz <|begin_of_thought|>",
     ("x <|end_of_thou y", "z <|begin_of_thought|>")),
    (LONG, "<|begin_of_thou", (None, "<|begin_of_thou")),
]
IDS = [f"{i}-{m.start}{'-inside' if m.starts_inside else ''}" for i, (m, _, _) in enumerate(CASES)]


def stream(markers: ReasoningMarkers, pieces: list[str]) -> tuple[str, str]:
    """Feeds pieces one by one; checks each step's hold-back; returns the joined deltas."""
    parser = ReasoningParser(markers)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
        # What finish() would still flush is only a possible marker start.
        r, c = copy.deepcopy(parser).finish()
        assert len(r) + len(c) <= max(len(markers.start), len(markers.end)) - 1
    r, c = parser.finish()
    return reasoning + r, content + c


def cuts(text: str, num_pieces: int) -> list[list[str]]:
    return [[text[i:j] for i, j in zip((0, *points), (*points, len(text)))]
            for points in itertools.combinations_with_replacement(range(len(text) + 1), num_pieces - 1)]


@pytest.mark.parametrize(("markers", "text", "expected"), CASES, ids=IDS)
def test_whole_text(markers, text, expected):
    assert split_reasoning(text, markers) == expected


@pytest.mark.parametrize(("markers", "text", "expected"), CASES, ids=IDS)
def test_stream_at_every_cut(markers, text, expected):
    reasoning, content = expected
    expected = (reasoning or "", content)
    splits = [[text], list(text), *cuts(text, 2)]
    if len(text) <= 60:
        splits += cuts(text, 3)
    for pieces in splits:
        assert stream(markers, pieces) == expected, pieces


@pytest.mark.parametrize(("markers", "text", "expected"), CASES, ids=IDS)
def test_content_never_holds_the_block(markers, text, expected):
    """Content is the output's tail as written; what comes before it is only the block: its
    markers, its reasoning and whitespace."""
    reasoning, content = expected
    assert text.endswith(content)
    dropped = text[: len(text) - len(content)]
    if reasoning is not None:
        assert reasoning in dropped
        dropped = dropped.replace(reasoning, "", 1)
    if dropped.lstrip().startswith(markers.start):  # the block opened in the output
        dropped = dropped.lstrip()[len(markers.start):]
    if markers.end in dropped:  # the block closed: its end marker is dropped
        assert dropped.rstrip().endswith(markers.end)
        dropped = dropped.rstrip()[: -len(markers.end)]
    assert dropped.strip() == ""


def test_stream_releases_content_at_once():
    """Inside the content nothing is held: a marker start there is content already."""
    parser = ReasoningParser(THINK)
    assert parser.feed("<think>a</think>\n\nb <") == ("a", "b <")
    assert parser.feed("/think") == ("", "/think")
    assert parser.finish() == ("", "")


def test_stream_holds_only_a_possible_end_marker():
    parser = ReasoningParser(INSIDE)
    assert parser.feed("\nOkay, 2 < 3 </th") == ("Okay, 2 < 3 ", "")
    assert parser.feed("ought") == ("</thought", "")
    assert parser.feed("</") == ("", "")
    assert parser.feed("think>\n") == ("", "")
    assert parser.feed("\n4") == ("", "4")
    assert parser.finish() == ("", "")


def test_an_unclosed_block_flushes_as_reasoning():
    parser = ReasoningParser(THINK)
    assert parser.feed("<think>\nwait </think") == ("wait ", "")
    assert parser.finish() == ("</think", "")


# -- reasoning_markers on the real templates --------------------------------------------------


def render(template_text: str, **context) -> str:
    template = chat_template.SandboxEnvironment().from_string(template_text)
    context = {"messages": [{"role": "user", "content": "What is 2+2?"}],
               "add_generation_prompt": True, "bos_token": "", "eos_token": "", **context}
    return chat_template.render(template, context)


def test_qwen3_thinks_and_its_prompt_leaves_the_block_to_the_model():
    template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    prompt = render(template)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert reasoning_markers(template) == THINK
    assert reasoning_markers(template, prompt) == THINK


def test_qwen3_with_thinking_off_closes_the_block_in_the_prompt():
    template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    prompt = render(template, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reasoning_markers(template, prompt) == THINK
    assert split_reasoning("The answer is 4.", THINK) == (None, "The answer is 4.")


def test_r1_distill_opens_the_block_in_the_prompt():
    template = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text(encoding="utf-8")
    prompt = render(template)
    assert prompt.endswith("<｜Assistant｜><think>\n")
    assert reasoning_markers(template, prompt) == INSIDE
    assert reasoning_markers(template, prompt[-8:]) == INSIDE  # the tail alone is enough
    assert reasoning_markers(template) == THINK  # without the prompt there is no telling


def test_templates_that_do_not_think():
    assert reasoning_markers(None) is None
    assert reasoning_markers(None, "<think>\n") is None
    assert reasoning_markers("") is None
    # Only one of the two markers: not a thinking template.
    assert reasoning_markers("{{ '<think>' }}", "<think>") is None


@pytest.mark.model
def test_qwen25_does_not_think(qwen_path):
    template = read_info(qwen_path).chat_template
    assert template and "<|im_start|>" in template
    assert reasoning_markers(template) is None
    assert reasoning_markers(template, render(template)) is None
