"""A sampled token's logprob computed by hand from an engine's own distributions (GPU checks of the
SGLang backend, tests/gpu/test_sglang.py): the distribution a token was sampled from, at
temperature T and after top-k / top-p truncation, from log-probabilities the engine returned."""

from __future__ import annotations

import math


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs)) if m != float("-inf") else m


def tempered(logprobs_t1: list[float], token: int, temperature: float) -> float:
    """log softmax(logits / T)[token] from log softmax(logits) (shift-invariant: the T = 1
    log-probabilities stand in for the logits)."""
    scaled = [x / temperature for x in logprobs_t1]
    return scaled[token] - _logsumexp(scaled)


def truncated(logprobs: list[float], token: int, top_k: int, top_p: float) -> tuple[float, bool]:
    """(log p(token) renormalised over the top-k / top-p support, token inside the support) from the
    step's log softmax(logits / T), with SGLang's rule: descending order, a token is kept while its
    rank < top_k and the mass before it <= top_p; a sampled token outside joins the support."""
    order = sorted(range(len(logprobs)), key=lambda i: -logprobs[i])
    kept, before = [], 0.0
    for rank, i in enumerate(order):
        p = math.exp(logprobs[i])
        if (top_k > 0 and rank >= top_k) or before > top_p:
            break
        kept.append(i)
        before += p
    inside = token in kept
    support = kept if inside else kept + [token]
    return logprobs[token] - _logsumexp([logprobs[i] for i in support]), inside
