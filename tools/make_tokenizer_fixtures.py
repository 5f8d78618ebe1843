#!/usr/bin/env python3
"""Expected token ids for nibble's tokenizer tests, produced by Hugging Face `tokenizers`.

Runs where the `tokenizers` package is installed (the device machine):
    python3 tools/make_tokenizer_fixtures.py --tokenizers DIR --out tests/fixtures/tokenizer
DIR holds one sub-folder per tokenizer (qwen3/, gpt-oss/) with a tokenizer.json each (plain or .xz).
Writes <name>.json: [{"text": ..., "ids": [...], "decoded": ...}, ...] for every test string.
"""
import argparse
import json
import lzma
import os
import random

from tokenizers import Tokenizer


def test_strings():
    s = []
    # Code in several languages, with the indentation and operators BPE vocabularies are built around.
    s += [
        "def add(a, b):\n    return a + b\n",
        "import numpy as np\nx = np.arange(10)\nprint(x.sum())",
        "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}",
        "#include <stdio.h>\nint main(void) { printf(\"hello, world\\n\"); return 0; }",
        "fn main() -> Result<(), Box<dyn Error>> {\n    let v: Vec<u8> = vec![1, 2, 3];\n    Ok(())\n}",
        "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
        "const f = async (x) => { await fetch(`/api/${x}`); };",
        "class Foo(Base):\n    '''Docstring.'''\n    def __init__(self):\n        super().__init__()\n",
        "if x != y and not z:\n        pass\n    elif x <= 3:\n        raise ValueError('bad')",
        "<html><body><div class=\"a\">Hi &amp; bye</div></body></html>",
        "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
        "x=1;y=2;z=x**y//3%4",
        "    \n\n\t\t  \r\n",
        "a\r\nb\rc\nd",
        "lambda_: __dunder__ ___triple___",
        "$ ls -la | grep '^d' > out.txt 2>&1 && echo done",
        "public static void main(String[] args) { System.out.println(args.length); }",
        "@decorator(arg=1)\nasync def g(*args, **kwargs) -> None: ...",
        "matrix[i][j] += alpha * (b[k] - c[k]) / 2.0f;",
        "// comment\n/* block\n   comment */\n# python comment\n-- sql comment",
        "git commit -m \"Fix: handle 'quotes' properly\"",
        "0x7fffffff 0b1010 0o777 1_000_000 3.14159e-10",
        "std::vector<std::pair<int, std::string>> v{{1, \"a\"}};",
        "print(f\"{name!r:>10} = {value:.3f}\")",
        "   leading spaces and trailing   ",
        "tab\tseparated\tvalues\t\t",
    ]
    # Multilingual prose, scripts with and without spaces, combining marks, RTL.
    s += [
        "The quick brown fox jumps over the lazy dog.",
        "Größenwahn über Äpfel und Öl — straße.",
        "Le cœur a ses raisons que la raison ne connaît point.",
        "¿Dónde está la biblioteca? ¡Aquí!",
        "Москва — столица России. Привет, мир!",
        "Ελληνικά: Καλημέρα κόσμε",
        "日本語のテキストです。東京は大きい都市です。",
        "中文测试：你好，世界！今天天气很好。",
        "한국어 문장입니다. 안녕하세요!",
        "हिन्दी में लिखा गया वाक्य।",
        "العربية: مرحبا بالعالم",
        "עברית: שלום עולם",
        "ไทย: สวัสดีชาวโลก",
        "Tiếng Việt: Xin chào thế giới",
        "Türkçe: İstanbul'da ılık bir gün",
        "e\u0301 vs \u00e9 (combining acute vs precomposed)",
        "Å \u212b \u0041\u030a angstrom forms",
        "ﬁ ligature and full-width ＡＢＣ１２３",
        "Ελληνικά και English mixed 中文 mixed",
        "I'm sure they'll say it's what we'd've done, DON'T YOU'LL?",
        "naïve café résumé coöperate",
        "Ünïcödé ÇÀPS ÀND lowercase",
    ]
    # Emoji: single code points, ZWJ sequences, flags, skin tones, variation selectors.
    s += [
        "😀 😃 😄 😁",
        "👨‍👩‍👧‍👦 family",
        "🇩🇪🇺🇸🇯🇵 flags",
        "👍🏽 thumbs up with tone",
        "❤️ red heart with VS16",
        "🤖🚀✨🔥💯",
        "emoji inside words: ab😀cd",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters 𝟙𝟚𝟛",
    ]
    # Whitespace runs of every kind.
    s += [
        " ", "  ", "   ", "    x", "x    ", "\n", "\n\n\n", "\t", " \t \n ", "a  b   c    d",
        "\u00a0non-breaking\u00a0space", "\u3000ideographic space", "line1\n\n\nline2",
        "    def f():\n        return 1\n\n\n",
    ]
    # Digits: lengths 1..12, grouped, decimals, mixed with letters.
    s += ["1", "12", "123", "1234", "12345", "123456", "1234567890", "123456789012",
          "3.14159", "1,234,567.89", "v1.2.3", "abc123def456", "٣٤٥ Arabic-Indic digits",
          "Ⅻ roman numeral", "²³ superscripts", "2024-11-22T07:31:00Z"]
    # Special and added tokens inside text.
    s += [
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>",
        "text<|endoftext|>more text",
        "<think>\nreasoning\n</think>\n\nanswer",
        "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
        "<|start|>system<|message|>You are ChatGPT.<|end|>",
        "<|start|>assistant<|channel|>analysis<|message|>thinking<|end|>",
        "<|return|><|call|><|constrain|>",
        "<|startoftext|>hi",
        "<|im_start|><|im_start|>double",
        "<|im_start",  # incomplete, must not match
        "< |im_start| >",
        "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    ]
    # Punctuation runs and odd bytes.
    s += ["!!!???...", "---===+++", "''''", "\"\"\"", "a.b.c", "....\n\n", "(-_-)", "~`@#$%^&*",
          "'s 't 're 've 'm 'll 'd", "'S 'T 'RE", "it's", "IT'S", "x's", "\u200bzero width",
          "\u0000nul", "\x7fdel", "\ufeffbom", "tab\u000bvtab", "soft\u00adhyphen"]
    rng = random.Random(1234)
    alphabet = ("abcXYZ019 _-.,:;()[]{}<>\n\t'\"/\\éüß中文日本ёж😀🚀"
                "\u0301\u200d ")
    while len(s) < 220:
        n = rng.randint(1, 40)
        s.append("".join(rng.choice(alphabet) for _ in range(n)))
    return s


def load_tokenizer(folder):
    plain = os.path.join(folder, "tokenizer.json")
    if os.path.exists(plain):
        return Tokenizer.from_file(plain)
    with lzma.open(plain + ".xz", "rt", encoding="utf-8") as f:
        return Tokenizer.from_str(f.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizers", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    strings = test_strings()
    for name in sorted(os.listdir(args.tokenizers)):
        folder = os.path.join(args.tokenizers, name)
        if not os.path.isdir(folder):
            continue
        tok = load_tokenizer(folder)
        cases = []
        for text in strings:
            ids = tok.encode(text, add_special_tokens=False).ids
            decoded = tok.decode(ids, skip_special_tokens=False)
            cases.append({"text": text, "ids": ids, "decoded": decoded})
        with open(os.path.join(args.out, name + ".json"), "w", encoding="utf-8") as f:
            json.dump(cases, f, ensure_ascii=False, indent=0)
        print(f"{name}: {len(cases)} strings, {sum(len(c['ids']) for c in cases)} ids")


if __name__ == "__main__":
    main()
