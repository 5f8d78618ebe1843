#!/usr/bin/env python3
"""Trains nibble's bundled default model: a small qwen3_moe causal LM on the Python sources and
docs found on the machine it runs on (the standard library and installed packages), with a
byte-level BPE tokenizer trained on the same corpus. Writes a normal Hugging Face checkpoint
directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML
chat_template, generation_config.json) plus train_stats.json and a model card (README.md).

Runs on a GPU in under 10 minutes (the device machine: torch, transformers, tokenizers):
    python3 tools/train_default_model.py --out OUT_DIR [--minutes 6.5]
Then `nibble quantize -m OUT_DIR -o OUT_DIR-int4` makes the INT4 variant. A model this small loses
a lot to round-to-nearest INT4, so the last part of training (--qat-fraction) runs with its Linear
weights fake-quantized exactly as `nibble quantize` will quantize them (quantization-aware
training with a straight-through gradient); the checkpoint keeps the full-precision weights.

The corpus is read in sorted path order and split into train / held-out by a hash of each file's
path, so a rerun on the same machine sees the same data; the training windows are drawn with a
fixed seed. A toy for demos and tests: it writes Python-looking text, nothing more.
"""
import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time

import torch
from torch.nn.utils import parametrize
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

# Qwen2/Qwen3's pre-tokenizer split, so the tokenizer has the layout nibble's Qwen tokenizers have.
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML as Qwen models use it: a default system prompt when none is given.
CHAT_TEMPLATE = (
    "{%- if messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful coding assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SYSTEM = "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n"


class FakeInt4(torch.nn.Module):
    """What `nibble quantize` (round to nearest, symmetric, GPTQ conventions: scale = 2·max|w|/15
    rounded to f16, codes -8..7 per group of `group` inputs along the last dimension) does to a
    weight, with a straight-through gradient: the forward pass sees the INT4 weight, the update
    goes to the full-precision one."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, w):
        k = w.shape[-1]
        g = self.group if 0 < self.group < k else k
        wg = w.float().reshape(*w.shape[:-1], k // g, g)
        amax = wg.abs().amax(-1, keepdim=True)
        amax = torch.where(amax == 0, torch.ones_like(amax), amax)
        scale = (2 * amax / 15).to(torch.float16).float().clamp_min(1.2e-7)
        q = (torch.clamp(torch.round(wg / scale), -8, 7) * scale).reshape(w.shape).to(w.dtype)
        return w + (q - w).detach()


def quantized_weights(model):
    """(module, parameter name) of every weight `nibble quantize` turns into INT4: the Linear
    layers of the decoder (attention projections) and the experts' fused gate/up and down
    tensors; not the router, embeddings, norms or the (tied) lm_head."""
    out = []
    for name, module in model.named_modules():
        if not name.startswith("model.layers."):
            continue
        if name.endswith("_proj") and isinstance(module, torch.nn.Linear):
            out.append((module, "weight"))
        elif name.endswith("mlp.experts"):
            out.extend((module, p) for p in ("gate_up_proj", "down_proj"))
    return out


def set_fake_int4(model, group):
    """Turns fake quantization on (group > 0) or off (group == 0, keeping the latent weights)."""
    for module, pname in quantized_weights(model):
        if group > 0:
            parametrize.register_parametrization(module, pname, FakeInt4(group))
        elif parametrize.is_parametrized(module, pname):
            parametrize.remove_parametrizations(module, pname, leave_parametrized=False)


def held_out_loss(model, val_ids, args, dev):
    vgen = torch.Generator().manual_seed(args.seed + 1)
    vals = []
    with torch.no_grad(), torch.autocast(device_type=dev, dtype=torch.bfloat16), parametrize.cached():
        for _ in range(40):
            x = batches(val_ids, 16, args.seq, vgen).to(dev)
            logits = model(input_ids=x[:, :-1]).logits.float()
            vals.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                          x[:, 1:].reshape(-1)).item())
    return sum(vals) / len(vals)


def corpus_files(max_bytes):
    """(path, text) of .py/.rst/.md/.txt files under the stdlib and site-packages, sorted."""
    roots = sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]})
    found = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith((".py", ".rst", ".md", ".txt")):
                    found.append(os.path.join(dirpath, name))
    files, total = [], 0
    for path in found:
        try:
            size = os.path.getsize(path)
            if size < 200 or size > 400_000:
                continue
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        files.append((path, text))
        total += len(text)
        if total >= max_bytes:
            break
    return files


def held_out(path):
    return int(hashlib.sha1(path.encode()).hexdigest(), 16) % 50 == 0


def documents(files, rng):
    """Raw files, and for a fifth of the .py files a chat turn that asks for the file to be
    continued and answers with it, so chat prompts get code back."""
    docs = []
    for path, text in files:
        docs.append(text)
        if path.endswith(".py") and rng.random() < 0.2:
            head = text[:300].rsplit("\n", 1)[0]
            docs.append(SYSTEM + "<|im_start|>user\nContinue this Python code:\n```python\n" + head +
                        "\n```<|im_end|>\n<|im_start|>assistant\n```python\n" + text[:2000] + "\n```<|im_end|>\n")
    return docs


def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_all(tok, docs, eot):
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def batches(data, batch, seq, gen):
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    x = torch.stack([data[s:s + seq + 1].long() for s in starts.tolist()])
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=11.0, help="training time budget")
    ap.add_argument("--corpus-mb", type=float, default=120.0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--qat-fraction", type=float, default=0.3,
                    help="last fraction of the steps trained with INT4 fake-quantized weights")
    ap.add_argument("--qat-group", type=int, default=128, help="group size of that quantization "
                    "(use the same --group-size with nibble quantize)")
    args = ap.parse_args()
    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    files = corpus_files(int(args.corpus_mb * 1e6))
    train_files = [f for f in files if not held_out(f[0])]
    val_files = [f for f in files if held_out(f[0])]
    train_docs, val_docs = documents(train_files, rng), documents(val_files, rng)
    print(f"corpus: {len(files)} files, {sum(len(t) for _, t in files) / 1e6:.1f} M chars "
          f"({len(val_files)} held out)", flush=True)
    tok = train_tokenizer(train_docs, args.vocab)
    eot = tok.token_to_id("<|endoftext|>")
    train_ids, val_ids = encode_all(tok, train_docs, eot), encode_all(tok, val_docs, eot)
    print(f"tokens: train {len(train_ids) / 1e6:.1f} M, held out {len(val_ids) / 1e6:.2f} M "
          f"({time.time() - t0:.0f} s)", flush=True)

    config = Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=2048, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        output_router_logits=True, router_aux_loss_coef=0.01, bos_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=eot)
    model = Qwen3MoeForCausalLM(config).to(dev)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60
    start = time.time()
    # The schedule runs on the clock, not on a step count: the learning rate follows a cosine over
    # the time budget (to a tenth of its peak) and quantization-aware training takes its last
    # --qat-fraction, so the budget is used whatever the machine's speed (QAT steps are slower).
    warmup, step, losses = 100, 0, []
    qat_start, qat_on = None, False
    model.train()
    while True:
        progress = (time.time() - start) / budget
        if progress >= 1.0:
            break
        if args.qat_fraction > 0 and progress >= 1 - args.qat_fraction and not qat_on:
            set_fake_int4(model, args.qat_group)
            qat_start, qat_on = step, True
            print(f"step {step}: INT4 fake quantization on (group {args.qat_group}), held-out loss "
                  f"{held_out_loss(model, val_ids, args, dev):.3f} with it", flush=True)
            model.train()
        lr = args.lr * (min(1.0, (step + 1) / warmup) if step < warmup else
                        0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batches(train_ids, args.batch, args.seq, gen).to(dev)
        with torch.autocast(device_type=dev, dtype=torch.bfloat16), parametrize.cached():
            out = model(input_ids=x[:, :-1])
            logits = out.logits.float()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
            loss = ce + (config.router_aux_loss_coef * out.aux_loss if out.aux_loss is not None else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(ce.item())
        if step % 200 == 0:
            print(f"step {step}: loss {ce.item():.3f} lr {lr:.2e} ({time.time() - start:.0f} s)", flush=True)
        step += 1
    train_loss = sum(losses[-100:]) / len(losses[-100:])

    model.eval()
    val_loss_int4 = held_out_loss(model, val_ids, args, dev) if qat_on else None
    set_fake_int4(model, 0)
    val_loss = held_out_loss(model, val_ids, args, dev)
    print(f"done: {step} steps, train loss {train_loss:.3f}, held-out loss {val_loss:.3f}"
          f" (fake INT4: {val_loss_int4})", flush=True)

    model = model.to(torch.bfloat16)
    model.config.output_router_logits = False
    model.save_pretrained(args.out, safe_serialization=True)
    im_end, im_start = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE,
                                   model_max_length=2048)
    fast.save_pretrained(args.out)
    # transformers 5 writes the template to chat_template.jinja; tokenizer_config.json carries it
    # too, where older readers (and nibble) look for it.
    cfg_path = os.path.join(args.out, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=1)
    GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=True, temperature=0.7, top_p=0.9,
                     top_k=40).save_pretrained(args.out)

    stats = {
        "corpus": "Python standard library and site-packages sources and docs (.py/.rst/.md/.txt, 200 B-400 KB "
                  f"files) of the training machine, python {sys.version.split()[0]}, torch {torch.__version__}",
        "files": len(files), "held_out_files": len(val_files), "train_tokens": len(train_ids),
        "held_out_tokens": len(val_ids), "vocab_size": tok.get_vocab_size(), "parameters": params,
        "steps": step, "batch": args.batch, "seq_len": args.seq, "tokens_seen": step * args.batch * args.seq,
        "final_train_loss": round(train_loss, 4), "held_out_loss": round(val_loss, 4), "seed": args.seed,
        "qat_from_step": qat_start, "qat_group_size": args.qat_group if qat_on else None,
        "held_out_loss_fake_int4": round(val_loss_int4, 4) if qat_on else None,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "seconds": round(time.time() - t0, 1),
    }
    with open(os.path.join(args.out, "train_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)

    # Reload as a user would, and show a greedy completion.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    m2 = AutoModelForCausalLM.from_pretrained(args.out, torch_dtype=torch.float32).to(dev)
    t2 = AutoTokenizer.from_pretrained(args.out)
    for prompt in ["def fibonacci(n):", t2.apply_chat_template(
            [{"role": "user", "content": "Write a Python function that reverses a string."}],
            tokenize=False, add_generation_prompt=True)]:
        ids = t2(prompt, return_tensors="pt").input_ids.to(dev)
        outs = m2.generate(ids, max_new_tokens=60, do_sample=False)
        print("---", repr(prompt[-60:]), "\n" + t2.decode(outs[0][ids.shape[1]:]), flush=True)
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
