"""Hostile chat templates (a GGUF's tokenizer.chat_template is untrusted code): each is stopped
by the sandbox, its time limit or its size limit with one TemplateLimitError, quickly, without
building anything large; and the same Tokenizer renders a normal chat right after."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest

from localllm import chat_template
from localllm.chat_template import TemplateLimitError
from localllm.errors import LocalLLMError, TemplateError, UsageError
from localllm.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TIMEOUT_S = 0.5
MAX_CHARS = 1 << 20


class ByteVocab:
    """Each byte is a token; no control tokens (the limits do not depend on the vocabulary)."""

    n_vocab, bos_id, eos_id, add_bos, bos_text, eos_text = 256, None, None, False, "", ""
    fim_pre_id = fim_suf_id = fim_mid_id = None

    def __init__(self, chat_template):
        self.chat_template = chat_template

    def tokenize(self, text, add_special, parse_special):
        return list(text)

    def token_to_piece(self, token_id):
        return bytes([token_id])

    def is_eog(self, token_id):
        return False


def tokenizer(template: str) -> Tokenizer:
    return Tokenizer(ByteVocab(template), name="hostile.gguf", render_timeout_s=TIMEOUT_S,
                     max_template_chars=MAX_CHARS)


CHAT = [{"role": "user", "content": "hi"}]

# (template, what the error must say); every one is the template's fault: TemplateLimitError.
HOSTILE = {
    # reaching Python internals
    "mro": ("{{ ''.__class__.__mro__ }}", "unsafe"),
    "subclasses": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "attr filter": ("{{ messages|attr('__class__') }}", "unsafe"),
    "cycler globals": ("{{ cycler.__init__.__globals__ }}", "unsafe"),
    "joiner globals": ("{{ joiner.__init__.__globals__.os }}", "unsafe"),
    "namespace init": ("{{ namespace.__init__ }}", "unsafe"),
    "self context": ("{{ self._TemplateReference__context }}", "unsafe"),
    "lipsum globals": ("{{ lipsum.__globals__['os'].popen('id').read() }}", "unsafe"),
    "raise_exception globals": ("{{ raise_exception.__globals__ }}", "unsafe"),
    "format escape": ("{{ '{0.__class__.__mro__}'.format(messages) }}", "unsafe"),
    "format_map escape": ("{{ '{m.__class__}'.format_map({'m': messages}) }}", "unsafe"),
    "mutate messages": ("{{ messages.append(1) }}", "unsafe"),
    "dict update": ("{{ {}.update({'a': 1}) }}", "unsafe"),
    "loop internals": ("{% for m in messages %}{{ loop._iterator }}{% endfor %}", "unsafe"),
    "strftime globals": ("{{ strftime_now.__globals__ }}", "unsafe"),
    # reading files
    "include": ("{% include '/etc/passwd' %}", "may not read other templates or files"),
    "import": ("{% import '/etc/passwd' as p %}", "may not read other templates or files"),
    "from import": ("{% from 'x.j2' import y %}", "may not read other templates or files"),
    "extends": ("{% extends '/etc/passwd' %}", "may not read other templates or files"),
    # looping forever
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "ran for more than 0.5 s"),
    "nested loops over one range": ("{% set r = range(100000) %}{% for a in r %}{% for b in r %}"
                                    "{% endfor %}{% endfor %}", "ran for more than 0.5 s"),
    "loop with filter test": ("{% for a in range(100000) %}{% for b in range(100000) if b < 0 %}"
                              "{% endfor %}{% endfor %}", "ran for more than 0.5 s"),
    "binary macro recursion": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                               "{{ f(60) }}", "ran for more than 0.5 s"),
    "endless macro recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "was stopped"),
    "recursive loop": ("{% for x in [[1]] recursive %}{{ loop([x] * 2) }}{% endfor %}", "was stopped"),
    "filter chain loop": ("{% for i in range(100000) %}{{ range(100000)|map('string')|list|length }}"
                          "{% endfor %}", "was stopped"),
    "sort loop": ("{% for i in range(100000) %}{{ range(100000)|sort|first }}{% endfor %}",
                  "ran for more than 0.5 s"),
    # building huge values
    "string times": ("{{ 'a' * 10**9 }}", "more than the 1048576"),
    "string times literal": ("{{ 'a' * 1000000000 }}", "more than the 1048576"),
    "list times": ("{{ [1] * 10**9 }}", "more than the 1048576"),
    "power": ("{{ 10 ** (10 ** 10) }}", "too large a number"),
    "power tower": ("{{ 2 ** 100000 }}", "too large a number"),
    "product": ("{% set ns = namespace(x=2) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
                "{% endfor %}{{ ns.x }}", "numbers too large"),
    "tilde doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}", "~-joined string"),
    "plus doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}{{ ns.s|length }}", "more than the 1048576"),
    "macro doubling": ("{% macro d(s, n) %}{{ d(s ~ s, n - 1) if n else s|length }}{% endmacro %}{{ d('ab', 64) }}",
                       "more than the 1048576"),
    "join huge range": ("{{ range(100000)|join('x' * 100000) }}", "joined string"),
    "join huge map": ("{{ range(100000)|map('string')|join('x' * 100000) }}", "was stopped"),
    "join repeated": ("{{ (['a' * 100000] * 1000)|join }}", "more than the 1048576"),
    "tojson indent": ("{{ range(100000)|list|tojson(indent=100000) }}", "indent of 100000"),
    "tojson indent text": ("{{ messages|tojson(indent=' ' * 1000) }}", "indent of 1000 characters"),
    "center": ("{{ 'a'|center(1000000000) }}", "center width"),
    "indent": ("{{ ('a\\n' * 100000)|indent(1000) }}", "indented string"),
    "str center": ("{{ 'a'.center(1000000000) }}", "str.center() result"),
    "str ljust": ("{{ 'a'.ljust(10 ** 9) }}", "more than the 1048576"),
    "str zfill": ("{{ '1'.zfill(10 ** 9) }}", "more than the 1048576"),
    "str expandtabs": ("{{ ('\\t' * 100000).expandtabs(100000) }}", "expandtabs"),
    "str replace": ("{{ ('a' * 100000).replace('a', 'b' * 100000) }}", "replace"),
    "str replace empty": ("{{ ('a' * 100000).replace('', 'b' * 1000) }}", "replace"),
    "str join": ("{{ ('x' * 100000).join(['a'] * 1000) }}", "str.join() result"),
    "format width": ("{{ '{:>1000000000}'.format(1) }}", "formatted field"),
    "format nested width": ("{{ '{:>{}}'.format(1, 1000000000) }}", "nested {} width"),
    "printf width": ("{{ '%1000000000d' % 1 }}", "%-formatted field"),
    "printf star": ("{{ '%*d' % (1000000000, 1) }}", "'*' width"),
    "format filter": ("{{ '%1000000000s'|format('a') }}", "%-formatted field"),
    "wordwrap": ("{{ 'a b'|wordwrap(1000000000) }}", "wordwrap width"),
    "output flood": ("{% for i in range(100000) %}{{ 'a' * 100000 }}{% endfor %}", "output passed 1048576"),
    "replace filter": ("{{ ('a' * 100000)|replace('a', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb') }}", "replace"),
    "sum of lists": ("{{ ([[0] * 100000] * 100)|sum(start=[]) }}", "more than the 1048576"),
}


@pytest.mark.parametrize("template, expected", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_is_stopped(template, expected):
    tok = tokenizer(template)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TemplateLimitError) as e:
            if tok.template_error is not None:
                raise tok.template_error
            tok.apply_chat_template(CHAT)
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(e.value)
    assert expected in message, message
    assert message.startswith("the chat template of model 'hostile.gguf' ")
    assert "\n" not in message
    assert e.value.exit_code == 2
    # Stopped at its deadline (plus the machine's slack), having allocated little.
    assert elapsed < TIMEOUT_S * 2 + 2.0, elapsed
    assert peak < 64 << 20, peak


def test_hostile_template_leaves_the_tokenizer_working():
    """The same Tokenizer (and environment) renders a good chat after a hostile one: the budget
    of the stopped render does not leak into the next."""
    tok = Tokenizer(ByteVocab("{% if messages[0].content == 'loop' %}{% for i in range(100000) %}"
                              "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}" + CHATML),
                    render_timeout_s=TIMEOUT_S)
    with pytest.raises(TemplateLimitError, match="ran for more than"):
        tok.apply_chat_template([{"role": "user", "content": "loop"}])
    assert bytes(tok.apply_chat_template(CHAT)) == b"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_concurrent_renders_keep_their_own_deadlines():
    """The server renders in threads: one hostile render must not stop a good one."""
    tok = Tokenizer(ByteVocab("{% if messages[0].content == 'loop' %}{% for i in range(100000) %}"
                              "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}" + CHATML),
                    render_timeout_s=chat_template.DEFAULT_TIMEOUT_S)
    # The product's deadline (2 s), not the other tests' 0.5 s: the good renders share the GIL
    # with the hostile one, and one of them once waited past 0.5 s on a 2-vCPU CI machine.
    errors, results = [], []

    def hostile():
        try:
            tok.apply_chat_template([{"role": "user", "content": "loop"}])
        except TemplateLimitError as e:
            errors.append(e)

    thread = threading.Thread(target=hostile)
    thread.start()
    while thread.is_alive():
        results.append(tok.apply_chat_template(CHAT))
    thread.join()
    assert len(errors) == 1 and results
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("template", [
    "{% for m in messages %}",  # unclosed block
    "{{ messages[0]. }}",
    "{% macro %}{% endmacro %}",
])
def test_template_that_does_not_compile_fails_at_load_and_at_each_chat(template):
    tok = tokenizer(template)
    assert isinstance(tok.template_error, TemplateLimitError)
    assert "does not compile" in str(tok.template_error)
    with pytest.raises(TemplateLimitError, match="does not compile"):
        tok.apply_chat_template(CHAT)
    assert tok.encode("plain prompts still work") == list(b"plain prompts still work")


def test_a_template_refusing_a_chat_is_the_requests_fault():
    """raise_exception() and render errors on odd messages stay plain TemplateErrors (HTTP 400),
    not TemplateLimitErrors (the model's fault)."""
    tok = tokenizer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError) as e:
        tok.apply_chat_template(CHAT)
    assert not isinstance(e.value, TemplateLimitError)
    tok = tokenizer("{{ messages[5].content }}")
    with pytest.raises(TemplateError) as e:
        tok.apply_chat_template(CHAT)
    assert not isinstance(e.value, TemplateLimitError)


def test_a_chat_too_large_to_render_is_a_usage_error():
    tok = tokenizer(CHATML)
    with pytest.raises(UsageError, match="more than the 524288 localllm renders"):
        tok.apply_chat_template([{"role": "user", "content": "a" * (MAX_CHARS // 2 + 1)}])
    assert len(tok.apply_chat_template([{"role": "user", "content": "a" * (MAX_CHARS // 4)}])) > MAX_CHARS // 4


@pytest.mark.parametrize("template, output", [
    ("{{ 'ab' * 3 }}", "ababab"),
    ("{{ [1, 2] * 2 }}", "[1, 2, 1, 2]"),
    ("{{ 2 ** 10 }}|{{ 7 // 2 }}|{{ 7 % 3 }}|{{ 'x' + 'y' }}", "1024|3|1|xy"),
    ("{{ '%05.1f|%s' % (3.14159, 'a') }}", "003.1|a"),
    ("{{ '{:>5}|{}'.format('a', 1) }}", "    a|1"),
    ("{{ messages|tojson(indent=2) }}", '[\n  {\n    "role": "user",\n    "content": "hi"\n  }\n]'),
    ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ m.role ~ ':' ~ m.content }}{% endfor %}", "1/1user:hi"),
    ("{% for x in [3, 1, 2]|sort if x > 1 %}{{ x }}{% else %}none{% endfor %}", "23"),
    ("{% for x in [] %}{{ x }}{% else %}none{% endfor %}", "none"),
    ("{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}{% endfor %}",
     "123"),
    ("{% set ns = namespace(n=0) %}{% for m in messages * 3 %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", "3"),
    ("{{ 'a\\tb'.expandtabs(4) }}|{{ 'abc'.replace('b', 'xx') }}|{{ '-'.join(['a', 'b']) }}", "a   b|axxc|a-b"),
    ("{{ 'a'|center(5) }}|{{ 'x'.zfill(3) }}", "  a  |00x"),
    ("{{ (range(3)|map('string')|join(', ')) }}", "0, 1, 2"),
])
def test_ordinary_template_features_still_work(template, output):
    assert bytes(tokenizer(template).apply_chat_template(CHAT)).decode() == output


def test_errors_are_local_llm_errors():
    assert issubclass(TemplateLimitError, TemplateError) and issubclass(TemplateError, LocalLLMError)
