#!/usr/bin/env python3
"""The tiny gpt-oss fixture (tests/fixtures/models/tiny-gpt-oss-mxfp4), in two steps.

  python3 tools/make_gpt_oss_fixture.py checkpoint OUT
      numpy only (runs anywhere). A tiny random gpt-oss checkpoint laid out as the real one
      (FORMATS.md section 5): MXFP4 experts (`*_blocks` e2m1 nibbles + `*_scales` e8m0 per 32,
      quantized here by round-to-nearest with the smallest power-of-two scale that keeps every
      value of a block within +-6), BF16 biases, attention, sinks, router, embeddings and lm_head,
      and the config's quantization_config. The shapes are odd on purpose: q heads x head_dim
      (144) != hidden (96), GQA 3:1, 5 experts top 2, alternating layer_types with a sliding
      window (5) much shorter than the test sequence (12 prompt + 32 generated tokens), YaRN
      RoPE with truncate=false, sinks of magnitude ~1, and expert weights large enough that the
      clamped SwiGLU's limit (7) is hit.

  python3 tools/make_gpt_oss_fixture.py reference DIR
      Needs torch and transformers (the device machine). Dequantizes DIR's MXFP4 experts here (an
      implementation independent of nibble's), loads everything into transformers'
      GptOssForCausalLM in float32 with eager attention, and writes DIR/expected.safetensors:
      prompt_ids, float32 logits of every prompt position and a 32-token greedy continuation
      (tools/make_fixtures.py's format). Also loads DIR through transformers' own MXFP4 reader
      (Mxfp4Config(dequantize=True)) and reports how far its logits are from ours.
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_FROM = os.path.join(HERE, "..", "tests", "fixtures", "models", "tiny-qwen3")

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)

CONFIG = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=400, hidden_size=96,
    intermediate_size=64, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
    head_dim=24, num_local_experts=5, num_experts_per_tok=2, experts_per_token=2,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=5,
    attention_bias=True, attention_dropout=0.0, rms_norm_eps=1e-5, rope_theta=150000.0,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "original_max_position_embeddings": 32, "truncate": False},
    max_position_embeddings=128, initial_context_length=32, swiglu_limit=7.0, hidden_act="silu",
    tie_word_embeddings=False, router_aux_loss_coef=0.9, output_router_logits=False,
    eos_token_id=2, pad_token_id=0, use_cache=True, torch_dtype="bfloat16",
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})


def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (no NaNs here)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_round(x):
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def e2m1_codes(x):
    """Nearest E2M1 code of each value (already divided by its block scale), ties to even codes."""
    mags = FP4_VALUES[:8]
    a = np.minimum(np.abs(x), 6.0)
    diff = np.abs(a[..., None] - mags)
    best = diff.min(axis=-1, keepdims=True)
    # Among equally near magnitudes the even code (its mantissa bit clear) wins.
    candidates = np.where(diff == best, np.arange(8), 99)
    even = np.where(candidates % 2 == 0, candidates, 99).min(axis=-1)
    code = np.where(even < 99, even, candidates.min(axis=-1))
    return (code | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


def quantize_mxfp4(w):
    """w [..., N, K] float32 -> blocks U8 [..., N, K/32, 16], scales U8 [..., N, K/32]."""
    *lead, n, k = w.shape
    b = w.reshape(*lead, n, k // 32, 32)
    amax = np.abs(b).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 6.0)), -127).astype(np.int64)
    e = np.clip(e, -127, 127)
    codes = e2m1_codes(b / np.exp2(e.astype(np.float64))[..., None].astype(np.float32))
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (e + 127).astype(np.uint8)


def dequantize_mxfp4_np(blocks, scales):
    lo, hi = blocks & 15, blocks >> 4
    vals = np.stack([FP4_VALUES[lo], FP4_VALUES[hi]], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


def write_safetensors(path, tensors, metadata=None):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        raw = np.ascontiguousarray(data).tobytes()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in blobs:
            f.write(raw)


def cmd_checkpoint(out, seed=7):
    c = CONFIG
    rng = np.random.default_rng(seed)
    H, I, E = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    nh, nkv, hd, V = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["vocab_size"]
    t = {}

    def bf16(name, shape, std, mean=0.0):
        t[name] = ("BF16", shape, bf16_bits(mean + std * rng.standard_normal(shape).astype(np.float32)))

    bf16("model.embed_tokens.weight", (V, H), 1.0)
    bf16("lm_head.weight", (V, H), 0.15)
    bf16("model.norm.weight", (H,), 0.2, 1.0)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        bf16(f"{p}.input_layernorm.weight", (H,), 0.2, 1.0)
        bf16(f"{p}.post_attention_layernorm.weight", (H,), 0.2, 1.0)
        for name, n_out in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            bf16(f"{p}.self_attn.{name}.weight", (n_out, H), 0.15)
            bf16(f"{p}.self_attn.{name}.bias", (n_out,), 0.1)
        bf16(f"{p}.self_attn.o_proj.weight", (H, nh * hd), 0.15)
        bf16(f"{p}.self_attn.o_proj.bias", (H,), 0.1)
        bf16(f"{p}.self_attn.sinks", (nh,), 1.0)
        bf16(f"{p}.mlp.router.weight", (E, H), 0.3)
        bf16(f"{p}.mlp.router.bias", (E,), 0.3)
        # Out-major [E, out, in] as the blocks store them; gate/up rows interleaved. A gate/up std
        # of 0.6 over ~unit inputs gives pre-activations of std ~6: the +-7 clamp bites often.
        gate_up = (0.6 * rng.standard_normal((E, 2 * I, H))).astype(np.float32)
        down = (0.15 * rng.standard_normal((E, H, I))).astype(np.float32)
        for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            blocks, scales = quantize_mxfp4(w)
            # Round to nearest: no value moves by more than half the widest step (4 -> 6) of its block.
            err = np.abs(dequantize_mxfp4_np(blocks, scales) - w).reshape(*scales.shape, 32).max(axis=-1)
            assert np.all(err <= np.exp2(scales.astype(np.float64) - 127)), name
            t[f"{p}.mlp.experts.{name}_blocks"] = ("U8", blocks.shape, blocks)
            t[f"{p}.mlp.experts.{name}_scales"] = ("U8", scales.shape, scales)
        bf16(f"{p}.mlp.experts.gate_up_proj_bias", (E, 2 * I), 0.5)
        bf16(f"{p}.mlp.experts.down_proj_bias", (E, H), 0.1)
    os.makedirs(out, exist_ok=True)
    write_safetensors(os.path.join(out, "model.safetensors"), t, {"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 0}, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_FROM, name), out)
    print(f"{out}: {len(t)} tensors, seed {seed}")


def cmd_reference(model_dir):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, HERE)
    import make_fixtures as mf

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    lut = torch.tensor(FP4_VALUES)
    state = {}
    for name, t in tensors.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            blocks, scales = t.long(), tensors[base + "_scales"].long()
            vals = torch.stack([lut[blocks & 15], lut[blocks >> 4]], dim=-1).reshape(*blocks.shape[:-1], 32)
            vals = vals * torch.exp2((scales - 127).float())[..., None]
            w = vals.reshape(*blocks.shape[:-2], -1)  # [E, out, in]
            state[base] = w.transpose(1, 2).contiguous()  # transformers keeps [E, in, out]
        else:
            state[name] = t.float()
    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    model.eval()

    n_tokens = 384  # the tokenizer's size (the model's vocabulary is padded to 400)
    for seed in range(1, 40):
        prompt = torch.randint(0, n_tokens, (mf.PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
        logits, greedy, margin = mf.reference(model, prompt)
        if margin >= mf.MIN_RELATIVE_MARGIN:
            break
        print(f"prompt seed {seed} has a near tie (margin {margin:.2e}), trying another")
    mf.write_expected(model_dir, prompt, logits, greedy, margin)
    print(f"{model_dir}: prompt seed {seed}, margin {margin:.2e}, greedy {greedy[:8]}...")

    # How often the SwiGLU clamp bites on the prompt (else the fixture would not test it).
    seen = []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        layer.post_attention_layernorm.register_forward_hook(
            lambda mod, args, out, e=experts: seen.append((out.reshape(-1, out.shape[-1]) @ e.gate_up_proj
                                                           + e.gate_up_proj_bias[:, None, :])[..., ::2]))
    with torch.no_grad():
        model(torch.tensor([prompt]))
    gates = torch.cat([g.flatten() for g in seen])
    print(f"gate pre-activations above the limit 7: {float((gates > 7).float().mean()):.1%} (all experts)")

    # Cross-check: transformers' own MXFP4 loader on the same files (BF16 compute, so only close).
    try:
        from transformers import Mxfp4Config

        theirs = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=Mxfp4Config(dequantize=True),
                                                      dtype=torch.bfloat16, attn_implementation="eager").eval()
        with torch.no_grad():
            other = theirs(torch.tensor([prompt])).logits[0].float()
        err = float((other - logits).abs().max() / logits.abs().max())
        print(f"transformers' MXFP4 loader (bf16) vs the float32 reference: max relative error {err:.3e}")
    except Exception as e:  # an older transformers without Mxfp4Config, or one that wants triton
        print(f"transformers' MXFP4 loader not checked: {type(e).__name__}: {str(e)[:300]}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("checkpoint").add_argument("out")
    sub.add_parser("reference").add_argument("dir")
    args = ap.parse_args()
    if args.cmd == "checkpoint":
        cmd_checkpoint(args.out)
    else:
        cmd_reference(args.dir)


if __name__ == "__main__":
    main()
