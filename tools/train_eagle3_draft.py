#!/usr/bin/env python3
"""Trains an EAGLE3 draft head for the bundled model (models/nibble-tiny-coder) and measures its
acceptance length on held-out code. Writes the draft in the layout EAGLE3 checkpoints use
(SafeAILab EAGLE / SpecForge / ModelOpt export, ../shared/reference FORMATS.md section 7a):

  fc.weight [H, 3*H_t]             the three target hidden states (concatenated in layer order)
  midlayer.input_layernorm.weight  on the token embedding (the target's embed_tokens: not stored)
  midlayer.hidden_norm.weight      on the fc output, or on the previous draft step's hidden
  midlayer.self_attn.{q,k,v}_proj  input cat(norm(embed), norm(hidden)) [2H]; o_proj [H, heads*hd]
  midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj   a Llama MLP
  norm.weight, lm_head.weight [draft_vocab, H]
  d2t I64 [draft_vocab] (target id = draft id + d2t[draft id]), t2d BOOL [vocab]

config.json: LlamaForCausalLMEagle3 with draft_vocab_size and eagle_config.
eagle_aux_hidden_state_layer_ids. Aux ids follow SpecForge/SGLang: id i is the output of decoder
layer i (the residual stream entering layer i+1, before any norm); vLLM reads the same ids as the
stream entering layer i, one layer earlier (FORMATS.md 7b).

Training is EAGLE3's: the target is frozen; the draft sees, at position t, the embedding of token
t+1 and fc(target hidden states at t) and learns the target's next-token distribution (restricted
to the draft vocabulary) at t+1; then it runs on its own output for --ttt more steps
("training-time test"), step s at position t attending to step 0's keys up to t and to its own
earlier steps at t, exactly what a chain of drafts sees at inference; step s's loss is weighted
0.8^s.

Runs on the device machine (torch, transformers, tokenizers) in ~7 minutes:
    python3 tools/train_eagle3_draft.py --target models/nibble-tiny-coder --out OUT [--minutes 5]
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_default_model as tdm  # noqa: E402  (the corpus and its held-out split)

AUX_LAYERS = [0, 1, 2]  # outputs of decoder layers 0, 1, 2 of the 4 (SpecForge convention)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (self.weight * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x, pos, theta):
    """Rotary embedding, half-split pairs (Llama / Qwen): x [B, heads, T, hd], pos [T]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.nh, self.nkv, self.hd = nh, nkv, hd


class Mlp(nn.Module):
    def __init__(self, h, inter):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Midlayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = Mlp(h, c["intermediate_size"])


class Eagle3Draft(nn.Module):
    def __init__(self, c):
        super().__init__()
        h = c["hidden_size"]
        self.c = c
        self.fc = nn.Linear(3 * c["target_hidden_size"], h, bias=False)
        self.midlayer = Midlayer(c)
        self.norm = RMSNorm(h, c["rms_norm_eps"])
        self.lm_head = nn.Linear(h, c["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(c["draft_vocab_size"], dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c["vocab_size"], dtype=torch.bool))

    def qkv(self, emb, hid, pos):
        a = self.midlayer.self_attn
        b, t, _ = emb.shape
        x = torch.cat([self.midlayer.input_layernorm(emb), self.midlayer.hidden_norm(hid)], -1)
        q = a.q_proj(x).view(b, t, a.nh, a.hd).transpose(1, 2)
        k = a.k_proj(x).view(b, t, a.nkv, a.hd).transpose(1, 2)
        v = a.v_proj(x).view(b, t, a.nkv, a.hd).transpose(1, 2)
        theta = self.c["rope_theta"]
        rep = a.nh // a.nkv
        return (rope(q, pos, theta), rope(k, pos, theta).repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))

    def finish(self, hid, attn):
        """Residual = the un-normalized hidden input; returns the pre-norm output (the next step's
        hidden) and the draft-vocabulary logits."""
        b, nh, t, hd = attn.shape
        h = hid + self.midlayer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, nh * hd))
        out = h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))
        return out, self.lm_head(self.norm(out))

    def steps(self, emb_steps, hid0, n_steps):
        """Training-time test. emb_steps(s) -> [B, T, H] embeddings of the tokens step s reads;
        hid0 = fc(aux) [B, T, H]. Yields the logits of each step."""
        t = hid0.shape[1]
        pos = torch.arange(t, device=hid0.device)
        scale = 1.0 / math.sqrt(self.midlayer.self_attn.hd)
        causal = torch.ones(t, t, dtype=torch.bool, device=hid0.device).tril()
        hid, k0, v0, diag_k, diag_v = hid0, None, None, [], []
        for s in range(n_steps):
            q, k, v = self.qkv(emb_steps(s), hid, pos + s)
            if s == 0:
                k0, v0 = k, v
            else:
                diag_k.append(k)
                diag_v.append(v)
            scores = [torch.matmul(q, k0.transpose(-1, -2)).float().masked_fill(~causal, float("-inf")) * scale]
            scores += [(q * dk).sum(-1, keepdim=True).float() * scale for dk in diag_k]
            p = torch.softmax(torch.cat(scores, -1), -1).to(v0.dtype)
            attn = torch.matmul(p[..., :t], v0)
            for i, dv in enumerate(diag_v):
                attn = attn + p[..., t + i: t + i + 1] * dv
            hid, logits = self.finish(hid, attn)
            yield logits

    def run(self, emb, hid):
        """One causal pass over a sequence (inference: step 0 and the chain appended to it)."""
        _, t, _ = emb.shape
        q, k, v = self.qkv(emb, hid, torch.arange(t, device=emb.device))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.finish(hid, attn)


def aux_hidden(target, ids):
    out = target(input_ids=ids, output_hidden_states=True)
    # hidden_states[0] is the embedding output; [i + 1] the output of layer i (before the final norm
    # for every layer but the last).
    return torch.cat([out.hidden_states[i + 1] for i in AUX_LAYERS], -1), out.logits


def draft_chain(draft, embed, seq_with_bonus, aux, k):
    """k greedy drafts after seq_with_bonus, given the target's aux states for all but its last
    token (inference: recomputed from scratch, which is what a draft KV cache would hold)."""
    toks = torch.tensor([seq_with_bonus[1:]], device=aux.device)
    hid = draft.fc(aux)
    drafts = []
    for _ in range(k):
        out, logits = draft.run(embed(toks), hid)
        d = int(torch.argmax(logits[0, -1]))
        d += int(draft.d2t[d])
        drafts.append(d)
        toks = torch.cat([toks, torch.tensor([[d]], device=toks.device)], 1)
        hid = torch.cat([hid, out[:, -1:]], 1)
    return drafts


@torch.no_grad()
def acceptance(target, draft, prompts, n_new, k):
    """Greedy speculative decoding with chains of k drafts, recomputing everything per round.
    Returns (mean tokens per target forward, per-depth acceptance rates, a trace of the first
    prompt, whose output is compared with the target's own greedy output)."""
    embed = target.get_input_embeddings()
    dev = next(target.parameters()).device
    rounds = tokens = 0
    depth_hits = [0] * k
    trace = None
    for pi, prompt in enumerate(prompts):
        aux, logits = aux_hidden(target, torch.tensor([prompt], device=dev))
        seq, bonus = list(prompt), int(torch.argmax(logits[0, -1]))
        made, rec = 0, []
        while made < n_new:
            drafts = draft_chain(draft, embed, seq + [bonus], aux[:, : len(seq)], k)
            cand = seq + [bonus] + drafts
            aux_c, logits = aux_hidden(target, torch.tensor([cand], device=dev))
            preds = torch.argmax(logits[0, len(seq):], -1).tolist()  # after bonus, d1, ..., dk
            a = 0
            while a < k and drafts[a] == preds[a]:
                depth_hits[a] += 1
                a += 1
            rec.append((drafts, a))
            seq = seq + [bonus] + drafts[:a]
            bonus = preds[a]
            aux = aux_c
            made += 1 + a
            rounds += 1
            tokens += 1 + a
        if pi == 0:
            # The target's own greedy continuation, one full forward per token: speculative
            # decoding must not change it (a mismatch would be a bug here, or a float32 near tie).
            out, ref = seq + [bonus], list(prompt)
            while len(ref) < len(out):
                ref.append(int(torch.argmax(target(input_ids=torch.tensor([ref], device=dev)).logits[0, -1])))
            same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(out)) - len(prompt)
            trace = {"prompt": prompt, "output": out[len(prompt):], "rounds": rec,
                     "tokens_equal_to_plain_greedy": same, "tokens": len(out) - len(prompt)}
    return tokens / rounds, [h / rounds for h in depth_hits], trace


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--ttt", type=int, default=5, help="training-time-test steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--corpus-mb", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(dev).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tc = target.config
    with open(os.path.join(args.target, "train_stats.json")) as f:
        target_stats = json.load(f)

    files = tdm.corpus_files(int(args.corpus_mb * 1e6))
    rng = random.Random(target_stats["seed"])
    train_files = [f for f in files if not tdm.held_out(f[0])]
    val_files = [f for f in files if tdm.held_out(f[0])]
    train_docs = tdm.documents(train_files, rng)
    tok = Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    train_ids = tdm.encode_all(tok, train_docs, eot)
    print(f"tokens: train {len(train_ids) / 1e6:.1f} M ({time.time() - t0:.0f} s)", flush=True)

    # The draft vocabulary: the most frequent target tokens of the training text, in id order.
    counts = torch.bincount(train_ids.long(), minlength=tc.vocab_size)
    used = torch.sort(torch.topk(counts, args.draft_vocab).indices).values
    coverage = float(counts[used].sum() / counts.sum())
    c = {"hidden_size": tc.hidden_size, "target_hidden_size": tc.hidden_size,
         "num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads,
         "head_dim": tc.head_dim, "intermediate_size": args.intermediate, "rms_norm_eps": tc.rms_norm_eps,
         "rope_theta": tc.rope_parameters["rope_theta"], "vocab_size": tc.vocab_size,
         "draft_vocab_size": args.draft_vocab}
    draft = Eagle3Draft(c).to(dev)
    with torch.no_grad():
        draft.d2t.copy_(used - torch.arange(args.draft_vocab))
        draft.t2d[used.to(dev)] = True
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[used.to(dev)])
    params = sum(p.numel() for p in draft.parameters())
    print(f"draft: {params / 1e6:.2f} M parameters, draft vocab {args.draft_vocab} covers "
          f"{100 * coverage:.2f} % of the training tokens", flush=True)

    embed = target.get_input_embeddings()
    used_dev = used.to(dev)
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    budget, start, step = args.minutes * 60, time.time(), 0
    weights = [0.8 ** s for s in range(args.ttt)]
    while True:
        progress = (time.time() - start) / budget
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = tdm.batches(train_ids, args.batch, args.seq, gen).to(dev)[:, :-1]  # [B, T]
        with torch.no_grad(), torch.autocast(device_type=dev, dtype=torch.bfloat16):
            aux, tlogits = aux_hidden(target, x)
            tlogits = tlogits.float()
        t = x.shape[1]
        padded = torch.cat([x, torch.full((x.shape[0], args.ttt + 1), eot, device=dev)], 1)
        with torch.autocast(device_type=dev, dtype=torch.bfloat16):
            hid0 = draft.fc(aux)
            loss, accs = 0.0, []
            for s, logits in enumerate(draft.steps(lambda s: embed(padded[:, 1 + s: 1 + s + t]), hid0, args.ttt)):
                # Step s at position t predicts token t+2+s: the target's distribution at t+1+s.
                n = t - 1 - s
                want = torch.softmax(tlogits[:, 1 + s: 1 + s + n][..., used_dev], -1)
                got = torch.log_softmax(logits[:, :n].float(), -1)
                loss = loss + weights[s] * -(want * got).sum(-1).mean()
                accs.append(float((used_dev[got.argmax(-1)] == tlogits[:, 1 + s: 1 + s + n].argmax(-1))
                                  .float().mean()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.3f}, top-1 agreement by step "
                  f"{' '.join(f'{a:.3f}' for a in accs)} lr {lr:.2e} ({time.time() - start:.0f} s)", flush=True)
        step += 1
    final_accs = accs

    # Measure what ships: the BF16-rounded weights.
    draft = draft.to(torch.bfloat16).float().eval()
    val_docs = [d for d in tdm.documents(val_files, random.Random(0)) if not d.startswith("<|im_start|>")]
    prompts = []
    for d in val_docs:
        ids = tok.encode(d).ids
        if len(ids) >= 160:
            prompts.append(ids[:96])
        if len(prompts) == args.eval_prompts:
            break
    results = {}
    for k in (3, 5):
        acc_len, per_depth, trace = acceptance(target, draft, prompts, 96, k)
        results[f"chain_{k}"] = {"acceptance_length": round(acc_len, 3),
                                 "accept_rate_by_depth": [round(r, 3) for r in per_depth]}
        results[f"chain_{k}"]["first_prompt_equal_to_plain_greedy"] = (
            f"{trace['tokens_equal_to_plain_greedy']} of {trace['tokens']} tokens")
        print(f"chain of {k} drafts: {acc_len:.3f} tokens per target forward, by depth "
              f"{[round(r, 3) for r in per_depth]}; first prompt equal to plain greedy for "
              f"{trace['tokens_equal_to_plain_greedy']} of {trace['tokens']} tokens", flush=True)
        if k == 3:
            r = trace["rounds"]
            save_file({"prompt_ids": torch.tensor(trace["prompt"], dtype=torch.int32),
                       "output_ids": torch.tensor(trace["output"], dtype=torch.int32),
                       "draft_ids": torch.tensor([d for d, _ in r], dtype=torch.int32),
                       "accepted": torch.tensor([a for _, a in r], dtype=torch.int32)},
                      os.path.join(args.out, "eagle3_trace.safetensors"), metadata={"chain": str(k)})

    state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in draft.state_dict().items()
             if name not in ("d2t", "t2d")}
    state["d2t"] = draft.d2t.cpu()
    state["t2d"] = draft.t2d.cpu()
    save_file({k: v.cpu() for k, v in state.items()}, os.path.join(args.out, "model.safetensors"),
              metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": c["hidden_size"], "target_hidden_size": c["target_hidden_size"],
        "intermediate_size": c["intermediate_size"], "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"], "head_dim": c["head_dim"], "num_hidden_layers": 1,
        "hidden_act": "silu", "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"],
        "rope_scaling": None, "max_position_embeddings": tc.max_position_embeddings,
        "vocab_size": c["vocab_size"], "draft_vocab_size": c["draft_vocab_size"], "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": None, "eos_token_id": tc.eos_token_id, "pad_token_id": tc.pad_token_id,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS, "use_aux_hidden_state": True,
                         "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                         "use_mtp_layernorm": False},
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    stats = {"target": os.path.basename(os.path.normpath(args.target)), "parameters": params,
             "draft_vocab_coverage": round(coverage, 4), "steps": step, "batch": args.batch, "seq_len": args.seq,
             "ttt_steps": args.ttt, "final_top1_agreement_by_step": [round(a, 4) for a in final_accs],
             "eval": {"prompts": len(prompts), "prompt_tokens": 96, "new_tokens": 96,
                      "source": "the first .py/.rst/.md/.txt held-out files of >= 160 tokens", **results},
             "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
             "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(args.out, "train_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
