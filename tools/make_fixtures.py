#!/usr/bin/env python3
"""Model fixtures for nibble's tests, with Hugging Face transformers as the reference.

Runs where torch and transformers 5.x are installed (the device machine):

  python3 tools/make_fixtures.py models OUT
      Trains a tiny byte-level BPE tokenizer (Qwen3-style pre-tokenizer) and builds tiny random
      Qwen3MoeForCausalLM and Qwen3ForCausalLM checkpoints with odd, non-power-of-two sizes, saved
      in the layout real checkpoints on the Hub use (per-expert tensors). For each it writes
      expected.safetensors: prompt_ids [T], transformers' float32 logits [T, V] for them, and a
      32-token greedy continuation.

  python3 tools/make_fixtures.py int4-reference DIR BASE
      DIR is a GPTQ checkpoint written by `nibble quantize` from the fixture BASE. Dequantizes it here (an independent
      implementation of the GPTQ format), runs transformers on the dequantized weights, and writes
      DIR/expected.safetensors the same way.

  python3 tools/make_fixtures.py bundled BF16_DIR INT4_DIR OUT [--report JSON]
      The bundled model (models/nibble-tiny-coder) and its `nibble quantize` INT4 variant: for
      each, OUT/{bf16,int4}.safetensors with a real code prompt (its text in the metadata), the
      float32 logits and a greedy continuation by transformers (the INT4 one on the dequantized
      weights). Also measures both on the held-out part of the training corpus (the same files and
      windows as tools/train_default_model.py) and tries transformers' own GPTQ loader; the figures
      go to the report, for the model card.
"""
import argparse
import glob
import json
import math
import os
import sys

import torch
from safetensors.torch import load_file, save_file

PROMPT_LEN = 12
GREEDY_TOKENS = 32
# A greedy continuation is only a fair test if no step is a near tie: a different but equally
# correct summation order could flip it. Seeds whose continuation has a smaller top-1/top-2 gap
# (relative to the logit spread) are skipped.
MIN_RELATIVE_MARGIN = 2e-3


def train_tokenizer(out_dir):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    qwen_regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(qwen_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:60]
    tok.train(files, trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in specials}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                   "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "model_max_length": 256}, f, indent=2)
    return tok.get_vocab_size(), ids


def randomize_(model, seed, std):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones: the test must see them applied
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def hub_layout(state_dict):
    """transformers 5 keeps experts fused; checkpoints on the Hub store them per expert."""
    out = {}
    for name, t in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def reference(model, prompt):
    """float32 logits of every prompt position, and a greedy continuation (full recompute per step)."""
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        logits = model(ids).logits[0].float()
        greedy, margins = [], []
        for _ in range(GREEDY_TOKENS):
            last = model(ids).logits[0, -1].float()
            top2 = torch.topk(last, 2).values
            margins.append(float((top2[0] - top2[1]) / (last.max() - last.min())))
            nxt = int(torch.argmax(last))
            greedy.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return logits, greedy, min(margins)


def write_expected(out_dir, prompt, logits, greedy, margin):
    save_file({"prompt_ids": torch.tensor(prompt, dtype=torch.int32),
               "logits": logits.contiguous(),
               "greedy_ids": torch.tensor(greedy, dtype=torch.int32)},
              os.path.join(out_dir, "expected.safetensors"),
              metadata={"transformers": __import__("transformers").__version__,
                        "min_relative_margin": f"{margin:.6f}"})


def build_model(kind, vocab, special_ids, out_dir, seed, storage_dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=vocab, max_position_embeddings=256, rms_norm_eps=1e-6,
                  eos_token_id=special_ids["<|im_end|>"], bos_token_id=None,
                  pad_token_id=special_ids["<|endoftext|>"], attn_implementation="eager")
    if kind == "qwen3_moe":
        # head_dim * heads (160) != hidden (96), like Qwen3-30B-A3B (4096 vs 2048); layer 1 is a
        # dense MLP layer (mlp_only_layers); 7 experts, top 3, renormalised.
        config = Qwen3MoeConfig(hidden_size=96, intermediate_size=160, moe_intermediate_size=48,
                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=40, num_experts=7, num_experts_per_tok=3,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                **common)
    else:
        # Tied embeddings, one KV head (GQA 5:1) and YaRN RoPE.
        config = Qwen3Config(hidden_size=80, intermediate_size=136, num_hidden_layers=3,
                             num_attention_heads=5, num_key_value_heads=1, head_dim=24,
                             tie_word_embeddings=True,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                              "factor": 4.0, "original_max_position_embeddings": 64},
                             **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed, std=0.15)
    # Round to the storage dtype so the float32 reference computes on exactly the stored values.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(storage_dtype).float())
    state = hub_layout({k: v.to(storage_dtype) for k, v in model.state_dict().items()})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
                   "temperature": 0.7, "top_p": 0.8, "top_k": 20}, f, indent=2)
    # The reference is transformers loading the checkpoint exactly as a user would.
    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                  attn_implementation="eager")
    return model, loaded


def cmd_models(out):
    import shutil

    os.makedirs(out, exist_ok=True)
    tok_dir = os.path.join(out, "_tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    n_tokens, special_ids = train_tokenizer(tok_dir)
    vocab = 400  # > tokenizer size, as real models pad their embedding tables
    for kind, dtype in (("qwen3_moe", torch.bfloat16), ("qwen3", torch.float32)):
        out_dir = os.path.join(out, f"tiny-{kind.replace('_', '-')}")
        for seed in range(1, 40):
            original, loaded = build_model(kind, vocab, special_ids, out_dir, seed, dtype)
            prompt = torch.randint(0, n_tokens, (PROMPT_LEN,),
                                   generator=torch.Generator().manual_seed(seed)).tolist()
            logits, greedy, margin = reference(loaded, prompt)
            with torch.no_grad():
                direct = original(torch.tensor([prompt])).logits[0]
            err = float((direct - logits).abs().max() / logits.abs().max())
            assert err < 1e-5, f"{kind}: reloaded checkpoint disagrees with the model ({err})"
            if margin >= MIN_RELATIVE_MARGIN:
                break
            print(f"{kind}: seed {seed} has a near tie (margin {margin:.2e}), trying another")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tok_dir, f), out_dir)
        write_expected(out_dir, prompt, logits, greedy, margin)
        print(f"{kind}: seed {seed}, margin {margin:.2e}, greedy {greedy[:8]}...")
    shutil.rmtree(tok_dir)


def dequantize_gptq(tensors, prefix, quant):
    """W[n, k] = (q[k, n] - zero[g, n]) * scale[g, n] with g = k // group (FORMATS.md section 1)."""
    qweight = tensors[prefix + ".qweight"].to(torch.int64) & 0xFFFFFFFF
    qzeros = tensors[prefix + ".qzeros"].to(torch.int64) & 0xFFFFFFFF
    scales = tensors[prefix + ".scales"].float()
    shifts = torch.arange(8) * 4
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, qweight.shape[1])  # [K, N]
    z = ((qzeros[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(qzeros.shape[0], -1)  # [G, N]
    if quant.get("checkpoint_format", "gptq") == "gptq":
        z = (z + 1) & 0xF
    k = q.shape[0]
    group = quant["group_size"] if quant["group_size"] > 0 else k
    g = torch.arange(k) // group
    return ((q - z[g]).float() * scales[g]).t().contiguous()  # [N, K]


def load_dequantized(model_dir):
    """A GPTQ checkpoint as a float32 transformers model on its dequantized weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(model_dir, "config.json")) as f:
        quant = json.load(f)["quantization_config"]
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    state = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            state[prefix + ".weight"] = dequantize_gptq(tensors, prefix, quant)
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            state[name] = t.float()
    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    # Fuse per-expert tensors into transformers 5's in-memory layout.
    fused = {}
    for name in list(state):
        if ".mlp.experts." in name and name.endswith("gate_proj.weight"):
            prefix, rest = name.split(".mlp.experts.")
            fused.setdefault(prefix, []).append(int(rest.split(".")[0]))
    for prefix, experts in fused.items():
        p = prefix + ".mlp.experts."
        gate_up = [torch.cat([state.pop(f"{p}{e}.gate_proj.weight"), state.pop(f"{p}{e}.up_proj.weight")])
                   for e in sorted(experts)]
        state[p + "gate_up_proj"] = torch.stack(gate_up)
        state[p + "down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight") for e in sorted(experts)])
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model.eval()


def cmd_int4_reference(model_dir, base_dir):
    model = load_dequantized(model_dir)
    prompt = load_file(os.path.join(base_dir, "expected.safetensors"))["prompt_ids"].tolist()
    logits, greedy, margin = reference(model, prompt)
    write_expected(model_dir, prompt, logits, greedy, margin)
    print(f"{model_dir}: margin {margin:.2e}, greedy {greedy[:8]}...")
    if margin < MIN_RELATIVE_MARGIN:
        print(f"warning: {model_dir} has a near tie in its greedy continuation", file=sys.stderr)


BUNDLED_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef read_lines(path):",
                   "class Stack:\n    def __init__(self):", "def is_prime(n):"]


def held_out_loss(model, model_dir, dev):
    """Mean next-token loss (nats) on 40 windows of 16 x 512 held-out tokens, drawn exactly as
    tools/train_default_model.py draws them."""
    import random
    from tokenizers import Tokenizer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train_default_model as tdm

    with open(os.path.join(model_dir, "train_stats.json")) as f:
        stats = json.load(f)
    seed, seq = stats["seed"], stats["seq_len"]
    if model_dir in _HELD_OUT:
        return _loss_on(model, _HELD_OUT[model_dir], seed, seq, dev)
    files = tdm.corpus_files(int(120e6))
    rng = random.Random(seed)
    tdm.documents([f for f in files if not tdm.held_out(f[0])], rng)  # the same rng draws as training
    val_docs = tdm.documents([f for f in files if tdm.held_out(f[0])], rng)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    val_ids = tdm.encode_all(tok, val_docs, tok.token_to_id("<|endoftext|>"))
    _HELD_OUT[model_dir] = val_ids
    return _loss_on(model, val_ids, seed, seq, dev)


_HELD_OUT = {}


def _loss_on(model, val_ids, seed, seq, dev):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train_default_model as tdm

    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    with torch.no_grad():
        for _ in range(40):
            x = tdm.batches(val_ids, 16, seq, gen).to(dev)
            logits = model(input_ids=x[:, :-1]).logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                            x[:, 1:].reshape(-1)).item())
    return sum(losses) / len(losses)


def cmd_bundled(bf16_dir, int4_dir, out_dir, report_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(out_dir, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(bf16_dir)
    report = {"transformers": __import__("transformers").__version__}
    try:
        AutoModelForCausalLM.from_pretrained(int4_dir)
        report["int4_native_transformers_load"] = "ok"
    except Exception as e:  # transformers needs an extra package (gptqmodel) for GPTQ checkpoints
        report["int4_native_transformers_load"] = f"{type(e).__name__}: {str(e)[:300]}"
    variants = {"bf16": AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval(),
                "int4": load_dequantized(int4_dir)}
    for name, model in variants.items():
        report[f"held_out_loss_{name}"] = round(held_out_loss(model.to(dev), bf16_dir, dev), 4)
        model.to("cpu")
        for text in BUNDLED_PROMPTS:  # the first prompt without a near tie in its continuation
            prompt = tok(text).input_ids
            logits, greedy, margin = reference(model, prompt)
            if margin >= MIN_RELATIVE_MARGIN:
                break
        save_file({"prompt_ids": torch.tensor(prompt, dtype=torch.int32), "logits": logits.contiguous(),
                   "greedy_ids": torch.tensor(greedy, dtype=torch.int32)},
                  os.path.join(out_dir, f"{name}.safetensors"),
                  metadata={"transformers": report["transformers"], "prompt": text,
                            "min_relative_margin": f"{margin:.6f}"})
        report[f"greedy_{name}"] = {"prompt": text, "margin": round(margin, 5),
                                   "text": tok.decode(greedy)}
        print(f"{name}: held-out loss {report[f'held_out_loss_{name}']}, {text!r} -> {tok.decode(greedy)!r}")
    print(json.dumps(report, indent=1))
    if report_path:
        with open(report_path, "w") as f:
            json.dump(report, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("models").add_argument("out")
    p = sub.add_parser("int4-reference")
    p.add_argument("dir")
    p.add_argument("base")
    p = sub.add_parser("bundled")
    p.add_argument("bf16")
    p.add_argument("int4")
    p.add_argument("out")
    p.add_argument("--report")
    args = ap.parse_args()
    if args.cmd == "models":
        cmd_models(args.out)
    elif args.cmd == "bundled":
        cmd_bundled(args.bf16, args.int4, args.out, args.report)
    else:
        cmd_int4_reference(args.dir, args.base)


if __name__ == "__main__":
    main()
