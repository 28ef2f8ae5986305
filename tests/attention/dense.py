"""An independent dense fp64 attention with an explicit bottom-right causal mask, for checks."""

import math

import torch


def dense_attention_fp64(q, k, v, causal: bool = True):
    """q [B, H, Sq, Dh], k/v [B, G, Sk, Dh]; query row i sees keys j <= i + Sk - Sq (bottom-right)."""
    q, k, v = q.double(), k.double(), v.double()
    H, G = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
