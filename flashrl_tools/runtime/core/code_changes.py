"""FLASHRL_CODE_CHANGES (issue 75): per weight sync, the share of the 4-bit codes the sync changed. A small
trainer update can move no INT4 code at all (a step smaller than half a quantization step), and the rollout policy
then lags the trainer's; 8-bit codes move 16x more readily. Engine-neutral: the sync session shows every converted
tensor to `CodeChanges.observe`, which keeps each 4-bit weight's last codes (its packed words: 0.5 byte a weight, on
their device) and counts the codes that differ; `summary` is the line the session logs once a sync is complete."""

from __future__ import annotations

import torch

from flashrl_tools.quant.packing import CODES_PER_WORD, changed_codes


class CodeChanges:
    """The codes of every 4-bit weight as last synced, and this sync's counts."""

    def __init__(self):
        self.last: dict[str, torch.Tensor] = {}
        self.shares: list[float] = []  # per weight, this sync
        self.changed = self.total = 0

    def observe(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, words in tensors:
            if not name.endswith("_packed") or words.dtype != torch.int32:
                continue
            before = self.last.get(name)
            if before is None or before.shape != words.shape or before.device != words.device:
                self.last[name] = words.clone()  # a first sync: the codes recorded, nothing to compare with
                continue
            changed, total = changed_codes(before, words), words.numel() * CODES_PER_WORD
            self.changed, self.total = self.changed + changed, self.total + total
            self.shares.append(changed / total)
            before.copy_(words)

    def summary(self) -> str:
        """This sync's line (then the counts start over)."""
        if not self.total:
            line = f"4-bit codes recorded ({len(self.last)} weights; the next sync reports the share it changes)"
        else:
            shares = sorted(self.shares)
            line = (f"4-bit codes changed: {100 * self.changed / self.total:.4f} % of {self.total:,} ({len(shares)} "
                    f"weights: least {100 * shares[0]:.4f} %, median {100 * shares[len(shares) // 2]:.4f} %, most "
                    f"{100 * shares[-1]:.4f} %)")
        self.shares, self.changed, self.total = [], 0, 0
        return line
