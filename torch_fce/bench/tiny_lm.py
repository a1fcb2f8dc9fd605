"""A compact GPT-style causal LM whose loss is written the unfused way, as HF writes it.

Used by the lowering tests and benchmarks and by the main job: torch.compile with
torch_fce.lowering turns its loss into fce::linear_ce without any change to this code.
"""

import torch
import torch.nn.functional as F
from torch import nn


def causal_lm_loss(logits, labels, num_items_in_batch=None, ignore_index=-100):
    """transformers' ForCausalLMLoss: upcast, pad + shift the labels, mean (or sum / n)."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1),
                           ignore_index=ignore_index, reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token embedding, pre-norm blocks, lm head (optionally tied to the embedding)."""

    def __init__(self, vocab, dim=64, layers=2, heads=4, max_len=1024, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids, labels=None, num_items_in_batch=None):
        """ids (B, T) -> logits (B, T, V), or the loss when labels (B, T) are given."""
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return causal_lm_loss(logits, labels, num_items_in_batch)
