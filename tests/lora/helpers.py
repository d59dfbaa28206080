"""Random PEFT adapters over the tiny checkpoints, and PEFT's own greedy output as the
oracle."""

from __future__ import annotations

from pathlib import Path

import torch

from replaylm import SamplingParams

N = 6
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 200, 17, 4, 80, 33], [3 + (11 * j) % 250 for j in range(21)], [7, 7, 1],
           [100, 101, 102, 103, 104]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, path: Path, r: int, seed: int, targets=ALL, alpha: int = 16,
                 rslora: bool = False):
    """Save a PEFT LoRA adapter of rank ``r`` with random A and B (B non-zero) over the
    checkpoint at ``base``; returns the PEFT model (eval, fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=rslora, init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.15)
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of a transformers (or PEFT) model, full forward each step."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]
