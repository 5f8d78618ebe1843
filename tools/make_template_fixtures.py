#!/usr/bin/env python3
"""Chat-template fixtures: what transformers' apply_chat_template renders for real models'
templates and a set of conversations (system prompts, multi-turn, reasoning, tool definitions,
tool calls and results, add_generation_prompt, template kwargs, non-ASCII text, a template's own
raise_exception), for tests/unit/chat_template_test.cpp.

    python3 tools/make_template_fixtures.py [--out tests/fixtures/chat_templates]

Templates (copied next to the cases): Qwen3 and Qwen3-Coder-30B-A3B-Instruct (tokenizer_config.json
chat_template), gpt-oss (chat_template.jinja), the bundled nibble-tiny-coder. Run where
transformers is installed (the device machine); without it, the rendering falls back to a Jinja2
environment set up as transformers sets its own (sandboxed, trim_blocks, lstrip_blocks,
loopcontrols, its tojson and globals) and the file says so.

Each case records the exact template variables (`context`: messages, tools, documents,
add_generation_prompt, the tokenizer's special tokens, the kwargs) so the test renders the same
thing, and `now` (noon UTC of the rendering day) for strftime_now.
"""
import argparse
import datetime
import json
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = {
    # name: (source file, key in a tokenizer_config.json or None for a .jinja file)
    "qwen3": ("tests/fixtures/chat_templates/qwen3.jinja", None),
    "qwen3-coder": ("tests/fixtures/chat_templates/qwen3-coder.jinja", None),
    "gpt-oss": ("tests/fixtures/chat_templates/gpt-oss.jinja", None),
    "nibble-tiny-coder": ("models/nibble-tiny-coder/chat_template.jinja", None),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.\n",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "description": "Forecast days", "minimum": 1}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_code", "description": "Search the repository.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"},
        "paths": {"type": "array", "items": {"type": "string"}, "nullable": True},
        "options": {"type": "object", "properties": {"regex": {"type": "boolean"}}}},
        "required": ["query"]}}}

USER = {"role": "user", "content": "Write a Python function that reverses a string."}
SYSTEM = {"role": "system", "content": "You are a careful coding assistant. Answer briefly."}
ANSWER = {"role": "assistant", "content": "def reverse(s):\n    return s[::-1]"}
FOLLOW = {"role": "user", "content": "Now make it handle None."}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
RESULT = {"role": "tool", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"}


def cases():
    out = []

    def add(template, name, messages, gen=True, tools=None, **kwargs):
        out.append({"template": template, "name": name, "messages": messages, "tools": tools,
                    "add_generation_prompt": gen, "kwargs": kwargs})

    for t in ("qwen3", "qwen3-coder", "gpt-oss", "nibble-tiny-coder"):
        add(t, "user", [USER])
        add(t, "system-user", [SYSTEM, USER])
        add(t, "multi-turn", [SYSTEM, USER, ANSWER, FOLLOW])
        add(t, "multi-turn-no-generation-prompt", [USER, ANSWER], gen=False)
        add(t, "non-ascii", [{"role": "user", "content": "Übersetze «naïve» 😀 — und \"quote\" \\ back\tslash"}])
    for t in ("qwen3", "qwen3-coder", "gpt-oss"):
        add(t, "tools", [SYSTEM, USER], tools=[WEATHER, SEARCH])
        add(t, "tools-no-system", [USER], tools=[WEATHER])
        add(t, "tool-call-and-result", [{"role": "user", "content": "Weather in Paris?"}, CALL, RESULT],
            tools=[WEATHER])
    add("qwen3", "reasoning-in-content", [USER, {"role": "assistant", "content":
        "<think>\nThe slice reverses.\n</think>\n\ndef reverse(s):\n    return s[::-1]"}, FOLLOW])
    add("qwen3", "reasoning-content-field", [USER, {"role": "assistant", "content": "Done.",
                                                    "reasoning_content": "Think first."}], gen=False)
    add("qwen3", "thinking-off", [USER], enable_thinking=False)
    add("qwen3", "two-tool-results", [{"role": "user", "content": "Compare"}, {
        "role": "assistant", "content": "Checking both.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "cold"}, {"role": "tool", "content": "warm"}], tools=[WEATHER])
    add("gpt-oss", "reasoning-effort-identity", [USER], reasoning_effort="high",
        model_identity="You are a test model.")
    add("gpt-oss", "builtin-tools", [USER], builtin_tools=["browser", "python"])
    add("gpt-oss", "developer-and-thinking", [{"role": "developer", "content": "Be terse."}, USER,
                                              {"role": "assistant", "content": "ok", "thinking": "short"}],
        gen=False)
    add("gpt-oss", "tool-without-call", [USER, RESULT])  # the template raises
    return out


# Language features one at a time, rendered by Jinja2 itself in transformers' environment.
SNIPPETS = [
    ("text {{ 'a' }}\n  {% if true %}\n    x\n  {% endif %}\nend", {}),
    ("{%- for m in ms -%}\n  [{{ m }}]\n{%- endfor %}\n{# note #}\n  {# indented note #}\nz", {"ms": [1, 2]}),
    ("a  {%- if true -%}  b  {%- endif -%}  c {{- ' d ' -}} e", {}),
    ("{% for x in xs %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.first }}/{{ loop.last }}/"
     "{{ loop.length }}{% if not loop.last %},{% endif %}{% endfor %}", {"xs": ["a", "b", "c"]}),
    ("{% for x in xs if x > 1 %}{{ x }}{{ loop.index }} {% else %}none{% endfor %}|{% for x in [] %}{% else %}"
     "empty{% endfor %}", {"xs": [1, 2, 3]}),
    ("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
     {"d": {"z": 1, "a": [1, "x"], "m": None}}),
    ("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}"
     "{% endfor %}", {"xs": [1, 2, 3, 4, 5]}),
    ("{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}", {}),
    ("{% set ns = namespace(n=0, s='') %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}"
     "{% endfor %}{{ ns.n }} {{ ns.s }}", {}),
    ("{% macro f(a, b='B', c=none) %}<{{ a }}{{ b }}{{ c }}>{% endmacro %}{{ f(1) }}{{ f(1, 2) }}{{ f(1, c=3) }}"
     "{{ f(a='x', b='y') }}", {}),
    ("{% macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(3) }}", {}),
    ("{{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ xs[-1] }} {{ s[1:3] }} {{ s[::-1] }} {{ xs[5] is defined }}",
     {"xs": [1, 2, 3], "s": "héllo"}),
    ("{{ 7 // 2 }} {{ 7 / 2 }} {{ 7 % 3 }} {{ -7 // 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} "
     "{{ 1.5 + 1 }} {{ 10 / 4 }} {{ 0.1 + 0.2 }} {{ 1e-7 }} {{ 3.0 }} {{ 1e20 }}", {}),
    ("{{ 'a' ~ 1 ~ none ~ true }} {{ 'ab' * 3 }} {{ [1] + [2, 3] }} {{ 'x' in 'xyz' }} {{ 2 in [1, 2] }} "
     "{{ 'k' in d }} {{ 'q' not in d }}", {"d": {"k": 1}}),
    ("{{ x if x else 'no' }} {{ y if y is defined else 'undef' }} {{ none is none }} {{ 1 is number }} "
     "{{ 'a' is string }} {{ d is mapping }} {{ xs is iterable }} {{ 'a' is iterable }} {{ 3 is odd }} "
     "{{ 4 is even }} {{ 4 is divisibleby 2 }} {{ u is undefined }} {{ true is true }} {{ 1 is integer }} "
     "{{ 1.0 is float }} {{ xs is sequence }} {{ d is not mapping }} {{ 1 is eq 1 }}",
     {"x": 0, "d": {}, "xs": []}),
    ("{{ xs | length }} {{ s | length }} {{ xs | join(', ') }} {{ xs | first }} {{ xs | last }} "
     "{{ xs | reverse | list }} {{ s | upper }} {{ s | lower }} {{ s | title }} {{ s | capitalize }} "
     "{{ '  pad ' | trim }} {{ s | replace('l', 'L') }} {{ u | default('dflt') }} {{ '' | default('e', true) }} "
     "{{ xs | map('string') | join }} {{ 3.7 | int }} {{ '4' | int + 1 }} {{ 2 | float }} {{ -3 | abs }} "
     "{{ xs | unique | list }} {{ [3, 1, 2] | sort }} {{ ['b', 'a'] | sort(reverse=true) }}",
     {"xs": [1, 2, 2, 3], "s": "héllo wörld"}),
    ("{{ ts | selectattr('on') | map(attribute='n') | join(',') }}|{{ ts | rejectattr('on') | list | length }}|"
     "{{ ts | selectattr('n', 'equalto', 'b') | first }}|{{ ts | map(attribute='n') | list }}|"
     "{{ [1, 2, 3, 4] | select('odd') | list }}|{{ [1, 2, 3, 4] | reject('odd') | list }}|"
     "{{ ['a', 'b'] | reject('in', ['a']) | list }}|{{ d | dictsort }}|{{ d | items | list }}",
     {"ts": [{"n": "a", "on": True}, {"n": "b", "on": False}, {"n": "c", "on": True}], "d": {"b": 1, "a": 2}}),
    ("{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ 'ü\u00e9\n\"' | tojson }}|{{ [] | tojson }}|{{ {} | tojson }}",
     {"v": {"s": "ünï \"q\" \\ \t", "n": None, "b": True, "i": -3, "f": 0.5, "g": 1e-9, "l": [1, {"x": []}]}}),
    ("{{ s.startswith('he') }} {{ s.endswith(('x', 'lo')) }} {{ s.strip('h') }} {{ '  a  '.lstrip() }}|"
     "{{ '  a  '.rstrip() }}| {{ s.split('l') }} {{ 'a b  c'.split() }} {{ 'a,b,c'.split(',', 1) }} "
     "{{ s.upper() }} {{ s.replace('l', '') }} {{ s.find('l') }} {{ s.count('l') }} {{ '-'.join(['a', 'b']) }} "
     "{{ s.title() }} {{ s.capitalize() }}", {"s": "hello"}),
    ("{{ d.get('a') }} {{ d.get('z', 'dz') }} {{ d.get('z') }} {{ d.keys() | list }} {{ d.values() | list }} "
     "{{ d['a'] }} {{ d.a }} {{ d.missing is defined }} {{ d['items'] is defined }}", {"d": {"a": 1, "b": [2]}}),
    ("{{ none }} {{ true }} {{ [1, 'a', none, true, 1.5] }} {{ {'a': 'b'} }} {{ 'it''s' }} {{ \"q'\" }}", {}),
    ("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = (1, 2) %}{{ t[0] }}{% set c %}block {{ a }}{% endset %}"
     "[{{ c }}]", {}),
    ("{{ 1 < 2 and 2 <= 2 and 3 > 2 and 3 >= 4 or 'fallback' }} {{ not 0 }} {{ 'b' > 'a' }} {{ 1 == 1.0 }} "
     "{{ [1, 2] == [1, 2] }} {{ none == none }} {{ 0 or '' or 'last' }} {{ 1 and 'both' }}", {}),
    ("{%- if a %}A{% elif b %}B{% else %}C{% endif -%}\n{% if u.x is defined %}x{% endif %}", {"a": 0, "b": 1, "u": {}}),
    ("{{ 'multi\nline' | indent(2) }}|{{ 'multi\nline' | indent(2, true) }}|{{ 'a b c' | wordcount }}", {}),
    ("{%- raw %}{{ not rendered }}{% endraw %}", {}),
    ("{% generation %}tracked{% endgeneration %}", {}),
]


def hf_like_render(template, context):
    """transformers' own environment, for machines without transformers."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template).render(**context)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/fixtures/chat_templates"))
    ap.add_argument("--reference", default=os.path.join(ROOT, "../shared/reference"),
                    help="where the real templates come from (copied into --out once)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    # Copy the real templates in (once; the copies are committed).
    sources = {"qwen3": ("tokenizers/qwen3/tokenizer_config.json", "chat_template"),
               "qwen3-coder": ("configs/Qwen3-Coder-30B-A3B-Instruct/tokenizer_config.json", "chat_template"),
               "gpt-oss": ("configs/gpt-oss/chat_template.jinja", None)}
    for name, (rel, key) in sources.items():
        dst = os.path.join(args.out, f"{name}.jinja")
        src = os.path.join(args.reference, rel)
        if os.path.exists(dst) or not os.path.exists(src):
            continue
        if key:
            with open(src) as f, open(dst, "w") as g:
                g.write(json.load(f)[key])
        else:
            shutil.copy(src, dst)

    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "models/nibble-tiny-coder"))
        import transformers
        renderer = f"transformers {transformers.__version__} apply_chat_template"
        special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    except ImportError:
        tok = None
        import jinja2
        renderer = f"jinja2 {jinja2.__version__} in transformers' environment (transformers not installed)"
        special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

    today = datetime.date.today()
    now = int(datetime.datetime(today.year, today.month, today.day, 12, tzinfo=datetime.timezone.utc).timestamp())
    results = []
    for case in cases():
        with open(os.path.join(ROOT, TEMPLATES[case["template"]][0])) as f:
            template = f.read()
        context = {"messages": case["messages"], "tools": case["tools"], "documents": None,
                   "add_generation_prompt": case["add_generation_prompt"], **special, **case["kwargs"]}
        try:
            if tok is not None:
                text = tok.apply_chat_template(case["messages"], tools=case["tools"], chat_template=template,
                                               add_generation_prompt=case["add_generation_prompt"], tokenize=False,
                                               **case["kwargs"])
            else:
                text = hf_like_render(template, context)
            results.append({**case, "context": context, "expected": text})
        except Exception as e:  # a template's raise_exception
            results.append({**case, "context": context, "error": str(e)})
        print(f"{case['template']}/{case['name']}: {'error' if 'error' in results[-1] else 'ok'}")
    import jinja2
    snippets = []
    for source, context in SNIPPETS:
        try:
            snippets.append({"source": source, "context": context, "expected": hf_like_render(source, context)})
        except jinja2.exceptions.TemplateSyntaxError:  # the generation tag without transformers' extension
            snippets.append({"source": source, "context": context, "expected": "tracked"})
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump({"renderer": renderer, "snippet_renderer": f"jinja2 {jinja2.__version__} in transformers' "
                   "environment", "now": now, "templates": {k: v[0] for k, v in TEMPLATES.items()},
                   "cases": results, "snippets": snippets}, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
