"""A tiny Llama-style byte-level decoder: RMSNorm, rotary embeddings, SwiGLU MLP, causal SDPA attention."""
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256  # bytes


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 4
    dim: int = 128
    heads: int = 4
    seq_len: int = 128
    mlp_mult: float = 8 / 3  # SwiGLU hidden = mlp_mult * dim, rounded up to a multiple of 32
    rope_base: float = 10000.0

    @property
    def hidden(self) -> int:
        return -(-int(self.mlp_mult * self.dim) // 32) * 32

    def to_dict(self) -> dict:
        return asdict(self)


# Named sizes for ``--model-size``. "small" is the CPU default: the demo's three arms fit well inside ten
# minutes on two cores with four processes. The larger ones are for GPUs; "30m" and "125m" (context 256, like
# "medium") extend the simulated cluster's model family towards GPT-2 small.
SIZES = {
    "tiny": ModelConfig(layers=2, dim=64, heads=2, seq_len=64),
    "small": ModelConfig(layers=4, dim=128, heads=4, seq_len=128),
    "medium": ModelConfig(layers=6, dim=384, heads=6, seq_len=256),
    "large": ModelConfig(layers=12, dim=768, heads=12, seq_len=512),
    "30m": ModelConfig(layers=8, dim=576, heads=9, seq_len=256),  # 32.2M parameters
    "125m": ModelConfig(layers=12, dim=896, heads=14, seq_len=256),  # 116.4M: GPT-2 small's size, byte vocabulary
}


class RMSNorm(nn.Module):

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.type_as(x) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float):
    inv_freq = 1.0 / (base**(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return torch.cos(angles), torch.sin(angles)


def apply_rotary(x, cos, sin):
    """x: (B, H, T, hd); rotates pairs (even, odd) of the head dimension."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.dim % cfg.heads == 0, "dim must be a multiple of heads"
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class ByteLlama(nn.Module):
    """``forward(idx, targets=None)``: logits ``(B, T, 256)``, or the mean next-byte cross-entropy if ``targets``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, VOCAB, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.dim // cfg.heads, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2 style: scale the residual projections down with depth
            for proj in (block.attn.proj, block.mlp.down):
                nn.init.normal_(proj.weight, std=0.02 / (2 * cfg.layers)**0.5)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} bytes is longer than the model's seq_len {self.cfg.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def mean_loss(model: nn.Module, batches, autocast_dtype=None) -> float:
    """Mean next-byte cross-entropy of ``model`` over ``batches`` of ``(x, y)`` byte tensors on the model's device,
    weighted by batch size; the forward passes run under ``torch.autocast`` to ``autocast_dtype`` (None: none)."""
    total = count = 0
    for x, y in batches:
        with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            total += float(model(x, y)) * x.shape[0]
        count += x.shape[0]
    return total / count
