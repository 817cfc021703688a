"""Score rollouts with the BF16 policy as a trainer does: HF transformers forward in BF16,
logits / temperature, log-softmax in fp32, the logprob of each response token. On the GPU when
there is one (as a trainer scores), else on the CPU."""

from __future__ import annotations

from pathlib import Path

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [..., vocab] (any dtype), targets [...] -> log p(target) in fp32."""
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def score_rollouts(model_dir: Path, prompts: list[list[int]], responses: list[list[int]],
                   temperature: float = 1.0, batch_size: int = 8) -> list[list[float]]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device)
    model.eval()
    out: list[list[float]] = []
    for start in range(0, len(prompts), batch_size):
        batch = list(zip(prompts[start:start + batch_size], responses[start:start + batch_size]))
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, r) in enumerate(batch):  # right padding
            seq = torch.tensor(p + r)
            ids[i, :len(seq)], mask[i, :len(seq)] = seq, 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.cpu()
        for i, (p, r) in enumerate(batch):
            if not r:
                out.append([])
                continue
            pos = torch.arange(len(p) - 1, len(p) + len(r) - 1)  # position t predicts token t + 1
            out.append(token_logprobs(logits[i, pos], torch.tensor(r), temperature).tolist())
    return out
