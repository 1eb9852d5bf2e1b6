"""A small, modern decoder-only Transformer and the Free Transformer (Fleuret 2025).

Transformer:      embedding -> L x DecoderBlock (pre-norm RMSNorm, RoPE attention through SDPA,
                  SwiGLU MLP) -> final RMSNorm -> LM head.
FreeTransformer:  the same decoder, split in two halves. Between them a non-causal encoder
                  block (learned constant queries, keys/values from the middle stream) reads
                  out H bit-logits per token; a Binary Mapper samples a one-hot code over 2^H
                  values with a straight-through gradient; a post-sampler weight (2^H x D)
                  turns the code into a vector R that is added to the key/value input of the
                  first block of the second half only.

DecoderBlock is the unit that FSDP wraps and activation checkpointing recomputes.
"""

import functools
import math
import typing
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.attention.flex_attention as flex
import torch.nn.functional as F

# Known shapes, so that runs compare with published ones: 1b is Llama-3.2-1B's, 8b Llama-3-8B's,
# 1.5b and 8b are the paper's sizes; tiny is for tests and CPU runs.
SIZE_PRESETS = {
    "tiny": dict(n_layer=4, d_model=128, n_head=4, n_kv_head=0),
    "small": dict(n_layer=6, d_model=384, n_head=6, n_kv_head=0),
    "125m": dict(n_layer=12, d_model=768, n_head=12, n_kv_head=0),
    "350m": dict(n_layer=24, d_model=1024, n_head=16, n_kv_head=0),
    "1b": dict(n_layer=16, d_model=2048, n_head=32, n_kv_head=8, ffn_hidden=8192),
    "1.5b": dict(n_layer=24, d_model=2048, n_head=16, n_kv_head=8, ffn_hidden=8192),
    "8b": dict(n_layer=32, d_model=4096, n_head=32, n_kv_head=8, ffn_hidden=14336,
               rope_theta=500000.0),
}


# The projections --lora-targets may name: attention's query, key, value, output; the MLP's three.
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def opt(default, help, choices=None):
    """A config field whose help text (and allowed values) become the command-line flag's."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ModelConfig:
    arch: str = opt("free", "free (Free Transformer) or baseline (plain decoder)",
                    ["free", "baseline"])
    size: str = opt("", "named size preset: " + ", ".join(SIZE_PRESETS) + "; empty = use the "
                    "fields below")
    n_layer: int = opt(4, "decoder blocks (even for the Free Transformer)")
    d_model: int = opt(128, "model width D")
    n_head: int = opt(4, "attention heads")
    n_kv_head: int = opt(0, "key/value heads for grouped-query attention; 0 = n_head")
    ffn_hidden: int = opt(0, "SwiGLU hidden size; 0 = 8/3 * d_model rounded up to 64")
    vocab_size: int = opt(0, "vocabulary size; 0 = taken from the data")
    rope_theta: float = opt(10000.0, "RoPE base frequency")
    norm_eps: float = opt(1e-5, "RMSNorm epsilon")
    dropout: float = opt(0.0, "attention and residual dropout")
    tie_embeddings: bool = opt(False, "share the token embedding with the LM head")
    init_std: float = opt(0.02, "std of the normal init; residual outputs get std/sqrt(2L)")
    latent_bits: int = opt(16, "H: bits of the Free Transformer's latent (2^H codes)")
    kappa: float = opt(math.log(2) / 2, "free bits per token, in nats (log(2)/2 = half a bit)")
    mapper_chunk: int = opt(4096, "tokens per chunk in the Binary Mapper's backward")
    latent_init: str = opt("bits", "post-sampler table init: bits (each row a linear map of its "
                           "code's +-1 bits) or random (iid rows)", ["bits", "random"])
    latent_inject: str = opt("post_norm", "where R joins the key/value input of the first upper "
                             "block: pre_norm (x + R, then the block's RMSNorm; the paper) or "
                             "post_norm (after the norm, so R's share does not shrink with width)",
                             ["pre_norm", "post_norm"])
    latent_std: float = opt(1.0, "rms of the post-sampler rows (of R) at init; under post_norm, "
                            "R's size against the normalised stream")
    # What the families researchers download differ in (--init-from a Hugging Face directory sets
    # them from its config.json); off by default.
    head_dim: int = opt(0, "size of an attention head; 0 = d_model / n_head")
    qkv_bias: bool = opt(False, "biases on the query, key and value projections (Qwen2)")
    qk_norm: bool = opt(False, "RMSNorm on each head's queries and keys before RoPE (Qwen3)")
    rope_scaling: str = opt("", "RoPE frequency scaling: '' (none) or llama3 (Llama 3.1, 3.2)",
                            ["", "llama3"])
    rope_factor: float = opt(8.0, "--rope-scaling llama3: how much longer the context is")
    rope_low_freq_factor: float = opt(1.0, "--rope-scaling llama3: low_freq_factor")
    rope_high_freq_factor: float = opt(4.0, "--rope-scaling llama3: high_freq_factor")
    rope_original_context: int = opt(8192, "--rope-scaling llama3: the context it was trained "
                                     "at (original_max_position_embeddings)")
    sliding_window: int = opt(0, "a loaded model's attention window (0 = none), kept for its "
                              "export; a window below --seq-len is refused")
    hf_architecture: str = opt("", "the Hugging Face architecture the weights came from; "
                               "convert_to_hf.py writes it back")
    # LoRA (Hu et al. 2021): every weight frozen, a trainable low-rank update B·A·alpha/rank beside
    # each target projection; the base comes from --init-from, the checkpoints hold the adapters.
    lora_rank: int = opt(0, "LoRA: rank of the adapters (0 = off: every weight trains)")
    lora_alpha: float = opt(16.0, "LoRA: the adapters' update is scaled by alpha / rank")
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapters' input")
    lora_targets: str = opt("wq,wk,wv,wo", "LoRA: the projections that get adapters, "
                            "comma-separated: " + ", ".join(LORA_TARGETS) + " (the MLP's gate, "
                            "down, up)")

    # What train_fsdp.py reads besides the fields (its "Seams" comment). A resumed run may change
    # the size preset's name (its fields are compared one by one) and the chunking of the Binary
    # Mapper's backward: neither changes what it computes.
    RESUME_FREE: typing.ClassVar = frozenset({"size", "mapper_chunk"})
    PRESETS: typing.ClassVar = {"size": {name: {"model": shape}
                                         for name, shape in SIZE_PRESETS.items()}}

    def check(self):
        check_model_config(self)

    def resolve(self, data):
        resolve_model_config(self, data.vocab_size)

    @staticmethod
    def saved_fields(table):
        return saved_fields(table)


LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
HF_FIELDS = ("head_dim", "qkv_bias", "qk_norm", "rope_scaling", "rope_factor",
             "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context",
             "sliding_window", "hf_architecture")

# The valid values of the numeric fields: (field, test, what is valid), each reported by its flag.
RANGES = [
    ("n_layer", lambda v: v >= 1, ">= 1"), ("d_model", lambda v: v >= 1, ">= 1"),
    ("n_head", lambda v: v >= 1, ">= 1"), ("n_kv_head", lambda v: v >= 0, ">= 0"),
    ("ffn_hidden", lambda v: v >= 0, ">= 0"), ("vocab_size", lambda v: v >= 0, ">= 0"),
    ("dropout", lambda v: 0 <= v < 1, "in [0, 1)"), ("init_std", lambda v: v > 0, "> 0"),
    ("kappa", lambda v: v >= 0, ">= 0"), ("mapper_chunk", lambda v: v >= 1, ">= 1"),
    ("rope_theta", lambda v: v > 0, "> 0"), ("norm_eps", lambda v: v > 0, "> 0"),
    ("latent_std", lambda v: v > 0, "> 0"), ("head_dim", lambda v: v >= 0 and v % 2 == 0,
                                               ">= 0 and even"),
    ("rope_factor", lambda v: v >= 1, ">= 1"), ("rope_original_context", lambda v: v >= 1, ">= 1"),
    ("rope_low_freq_factor", lambda v: v > 0, "> 0"), ("sliding_window", lambda v: v >= 0, ">= 0"),
    ("rope_high_freq_factor", lambda v: v > 0, "> 0"), ("lora_rank", lambda v: v >= 0, ">= 0"),
    ("lora_alpha", lambda v: v > 0, "> 0"), ("lora_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
]


def saved_fields(table):
    """A saved run's model table with the fields it predates filled in with the values it was
    trained with: runs saved before the latent settings existed added R before the norm, with
    iid rows of std init_std. Read every saved config through this, never with today's defaults."""
    before = {"latent_init": "random", "latent_inject": "pre_norm",
              "latent_std": table.get("init_std", 0.02)}
    # The fields of the downloaded families and LoRA came later, off: every earlier run's value.
    later = {f.name: f.default for f in fields(ModelConfig) if f.name in HF_FIELDS + LORA_FIELDS}
    return {**later, **before, **table}


def check_model_config(cfg):
    """Every rule on the fields, before anything is built; raises ValueError with one line that
    names the flag."""
    valid = {name: text for name, _, text in RANGES}
    for f in fields(cfg):  # inf passes a test like "> 0" and nan none: every float must be finite
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag(f.name)} {value}: must be a finite number" +
                             (f" {valid[f.name]}" if f.name in valid else ""))
    for name, ok, text in RANGES:
        if not ok(getattr(cfg, name)):
            raise ValueError(f"{flag(name)} {getattr(cfg, name)}: must be {text}")
    if cfg.arch not in ("free", "baseline"):
        raise ValueError(f"--arch {cfg.arch!r}: valid values are free, baseline")
    if not cfg.head_dim and (cfg.d_model % cfg.n_head or (cfg.d_model // cfg.n_head) % 2):
        raise ValueError(f"--d-model {cfg.d_model} must be a multiple of --n-head {cfg.n_head} "
                         "with an even head size (or give --head-dim)")
    if cfg.rope_scaling and cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor:
        raise ValueError(f"--rope-high-freq-factor {cfg.rope_high_freq_factor} must be above "
                         f"--rope-low-freq-factor {cfg.rope_low_freq_factor}")
    if cfg.n_head % (cfg.n_kv_head or cfg.n_head):
        raise ValueError(f"--n-kv-head {cfg.n_kv_head} must divide --n-head {cfg.n_head}")
    if cfg.arch == "free" and (cfg.n_layer < 2 or cfg.n_layer % 2):
        raise ValueError(f"--n-layer {cfg.n_layer}: the Free Transformer needs an even number of "
                         "blocks >= 2")
    unknown = [name for name in cfg.lora_targets.split(",") if name not in LORA_TARGETS]
    if cfg.lora_rank and unknown:
        raise ValueError(f"--lora-targets {cfg.lora_targets!r}: {unknown[0]!r} is not a "
                         f"projection; valid: {','.join(LORA_TARGETS)}, comma-separated")
    if cfg.arch == "free" and not 1 <= cfg.latent_bits <= 20:
        raise ValueError(f"--latent-bits {cfg.latent_bits}: valid range is 1..20 (2^H codes)")


def resolve_model_config(cfg, data_vocab_size=0):
    """Check the fields and fill the derived ones: n_kv_head, ffn_hidden and, given the data's
    vocabulary size, vocab_size (0 = the data's; a smaller one is refused). Raises ValueError
    with one line."""
    check_model_config(cfg)
    if data_vocab_size and cfg.vocab_size == 0:
        cfg.vocab_size = data_vocab_size
    elif cfg.vocab_size < data_vocab_size:
        raise ValueError(f"--vocab-size {cfg.vocab_size} is smaller than the data's "
                         f"{data_vocab_size}")
    if cfg.n_kv_head == 0:
        cfg.n_kv_head = cfg.n_head
    if cfg.ffn_hidden == 0:
        cfg.ffn_hidden = 64 * math.ceil(8 * cfg.d_model / 3 / 64)
    return cfg


def flag(name):
    return "--" + name.replace("_", "-")


# ---------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32 whatever the compute dtype: bf16 sums of squares lose precision.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


def head_size(cfg):
    return cfg.head_dim or cfg.d_model // cfg.n_head


def rope_cos_sin(seq_len, cfg, device, offset=0):
    """Rotary tables in fp32, computed on the fly.

    They are not registered buffers on purpose: FSDP's MixedPrecision(buffer_dtype=bf16) would
    cast a buffer to bf16, and bf16 positions lose precision past a few hundred tokens.
    """
    head_dim = head_size(cfg)
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    if cfg.rope_scaling == "llama3":
        inv_freq = llama3_scaled(inv_freq, cfg)
    pos = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    return freqs.cos(), freqs.sin()


def llama3_scaled(inv_freq, cfg):
    """Llama 3.1's RoPE scaling: wavelengths longer than original_context / low_freq_factor are
    stretched by rope_factor, shorter than original_context / high_freq_factor kept, and those
    between blended smoothly (transformers' _compute_llama3_parameters)."""
    wavelen = 2 * math.pi / inv_freq
    low, high = (cfg.rope_original_context / f
                 for f in (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor))
    scaled = torch.where(wavelen > low, inv_freq / cfg.rope_factor, inv_freq)
    smooth = ((cfg.rope_original_context / wavelen - cfg.rope_low_freq_factor)
              / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelen >= high) & (wavelen <= low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x, cos, sin):
    """x: (B, n_head, T, head_dim); rotate pairs (first half, second half) in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


class LoRALinear(nn.Linear):
    """A Linear whose weight stays frozen beside a trainable low-rank update: y = x W^T + b +
    (x A^T B^T) alpha / rank. B starts at zero, so the first forward is the base model's."""

    def __init__(self, d_in, d_out, bias, cfg):
        super().__init__(d_in, d_out, bias=bias)
        self.lora_a = nn.Parameter(torch.empty(cfg.lora_rank, d_in))
        self.lora_b = nn.Parameter(torch.empty(d_out, cfg.lora_rank))
        self.scale = cfg.lora_alpha / cfg.lora_rank
        self.lora_drop = nn.Dropout(cfg.lora_dropout)

    def forward(self, x):
        update = F.linear(F.linear(self.lora_drop(x), self.lora_a), self.lora_b)
        return super().forward(x) + update * self.scale


def projection(cfg, name, d_in, d_out, bias=False):
    """The Linear layer `name` of a block: with adapters when LoRA targets it."""
    if cfg.lora_rank and name in cfg.lora_targets.split(","):
        return LoRALinear(d_in, d_out, bias, cfg)
    return nn.Linear(d_in, d_out, bias=bias)


def merge_lora(state, cfg):
    """A LoRA model's state dict as the plain model's: each adapted weight becomes W + B·A·alpha /
    rank, in fp32 (in a bf16 W the small update would round away), and the adapters go."""
    merged = {n: t for n, t in state.items() if ".lora_" not in n}
    for name in state:
        if name.endswith(".lora_a"):
            layer = name.removesuffix(".lora_a")
            update = state[layer + ".lora_b"].float() @ state[name].float()
            merged[layer + ".weight"] = state[layer + ".weight"].float() + update * (
                cfg.lora_alpha / cfg.lora_rank)
    return merged


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = head_size(cfg)
        q, kv = cfg.n_head * self.head_dim, cfg.n_kv_head * self.head_dim
        self.wq = projection(cfg, "wq", cfg.d_model, q, bias=cfg.qkv_bias)
        self.wk = projection(cfg, "wk", cfg.d_model, kv, bias=cfg.qkv_bias)
        self.wv = projection(cfg, "wv", cfg.d_model, kv, bias=cfg.qkv_bias)
        self.wo = projection(cfg, "wo", q, cfg.d_model)
        self.wo.residual_out = True
        self.dropout = cfg.dropout
        if cfg.qk_norm:  # over each head's head_dim values, one weight shared by the heads
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)

    def forward(self, q_in, kv_in, cos, sin, mask, cache=None):
        """mask: True (causal), False (every position), or the pairs that may attend (documents
        packed in a row): a boolean (B, 1, T, T) tensor, or a FlexAttention BlockMask. cache
        (generation only): a dict holding this layer's keys and values so far; a prompt fills it,
        then each call adds one position."""
        B, T, _ = kv_in.shape
        # q_in is (B, T, D), or one (1, 1, D) row shared by every position (the encoder's
        # constant ζ): then it is projected once and broadcast, not T times.
        q = self.wq(q_in).expand(B, T, -1).view(B, T, self.n_head, self.head_dim)
        k = self.wk(kv_in).view(B, T, self.n_kv_head, self.head_dim)
        v = self.wv(kv_in).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            if "k" in cache:
                if T != 1:
                    raise ValueError("a filled KV cache takes one new position at a time")
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
                mask = False  # the one new query may see every cached key
            cache["k"], cache["v"] = k, v
        # SDPA picks the flash / memory-efficient kernel on GPU; enable_gqa shares each key/value
        # head among n_head / n_kv_head query heads without copying them.
        gqa = self.n_kv_head != self.n_head
        if isinstance(mask, flex.BlockMask):
            y = _flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if isinstance(mask, bool)
                                               else mask, is_causal=mask is True, enable_gqa=gqa,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = projection(cfg, "w1", cfg.d_model, cfg.ffn_hidden)
        self.w3 = projection(cfg, "w3", cfg.d_model, cfg.ffn_hidden)
        self.w2 = projection(cfg, "w2", cfg.ffn_hidden, cfg.d_model)
        self.w2.residual_out = True

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    """Pre-norm causal block. `kv_extra` (the Free Transformer's R) is added only to the
    stream that produces keys and values; queries and the residual keep x."""

    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.inject = cfg.latent_inject

    def forward(self, x, cos, sin, kv_extra=None, cache=None, mask=True):
        """Returns x, or (x, rms(R) / rms(what R is added to)) when kv_extra is given. mask: the
        attention's (causal unless documents are packed)."""
        h = self.attn_norm(x)
        if kv_extra is None:
            kv = h
        else:
            base = h if self.inject == "post_norm" else x
            ratio = (kv_extra.float().pow(2).mean().sqrt()
                     / base.float().pow(2).mean().sqrt()).detach()
            kv = base + kv_extra if self.inject == "post_norm" else self.attn_norm(x + kv_extra)
        x = x + self.drop(self.attn(h, kv, cos, sin, mask, cache=cache))
        x = x + self.drop(self.mlp(self.mlp_norm(x)))
        return x if kv_extra is None else (x, ratio)


class EncoderBlock(nn.Module):
    """The Free Transformer's encoder: one non-causal block whose queries are a learned constant ζ
    and whose keys/values are the middle stream, read out to H bit-logits per token. RoPE on
    queries and keys gives each position its own attention pattern, hence its own logits."""

    def __init__(self, cfg):
        super().__init__()
        self.zeta = nn.Parameter(torch.zeros(cfg.d_model))
        self.q_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.kv_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.out_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.readout = nn.Linear(cfg.d_model, cfg.latent_bits, bias=False)

    def forward(self, x, cos, sin, mask=False):
        """mask: False (the whole row), or the pairs within one document (B, 1, T, T)."""
        zeta = self.zeta.to(x.dtype).view(1, 1, -1)  # the same query input at every position
        h = zeta + self.attn(self.q_norm(zeta), self.kv_norm(x), cos, sin, mask)
        h = h + self.mlp(self.mlp_norm(h))
        return self.readout(self.out_norm(h))


# ---------------------------------------------------------------------------------------------
# Binary Mapper


def code_bits(n_bits, device):
    """(2^H, H) float matrix: row d holds the bits of code d (bit h = (d >> h) & 1)."""
    codes = torch.arange(2 ** n_bits, device=device)
    return ((codes[:, None] >> torch.arange(n_bits, device=device)) & 1).float()


def code_probs(z_logits, bits):
    """G[n, d] = prod_h P(B_h = bit_h(d)) for every code d, in fp32 through log-sigmoids:
    the entries are about 2^-H and underflow in fp16."""
    lf = z_logits.float()
    log_p1, log_p0 = F.logsigmoid(lf), F.logsigmoid(-lf)
    return torch.exp(log_p0.sum(-1, keepdim=True) + (log_p1 - log_p0) @ bits.T)


class _BinaryMapperST(torch.autograd.Function):
    """Forward: R = W[d], a row lookup (the mapper's value is one-hot). Backward: the
    straight-through gradient of Y + G - sg(G), for bit h sum_d M[d] G[d] (bit_h(d) - p_h) with M =
    dR @ W^T, without ever forming the (tokens, 2^H) G."""

    @staticmethod
    def forward(ctx, z_logits, codes, weight, chunk):
        ctx.save_for_backward(z_logits, codes, weight)
        ctx.chunk = chunk
        return F.embedding(codes, weight)

    @staticmethod
    def backward(ctx, grad_r):
        z_logits, codes, weight = ctx.saved_tensors
        n_bits = z_logits.shape[-1]
        lo = n_bits // 2
        flat_logits = z_logits.reshape(-1, n_bits).float()
        flat_grad = grad_r.reshape(-1, grad_r.shape[-1])
        grad_logits = torch.empty(flat_logits.shape, dtype=torch.float32, device=z_logits.device)
        # G factorises over the bits: with d = a + 2^lo * b, G[d] = G_lo[a] G_hi[b], and M viewed as
        # (2^hi, 2^lo) gives every sum in two batched mat-vecs. Token chunks bound M's memory.
        bits_lo, bits_hi = code_bits(lo, z_logits.device), code_bits(n_bits - lo, z_logits.device)
        for s in range(0, flat_logits.shape[0], ctx.chunk):
            lg = flat_logits[s:s + ctx.chunk]
            n = lg.shape[0]
            # M = dR @ W^T in the weight's dtype (a GEMM the size of a 2^H-wide LM head), then fp32.
            chunk = flat_grad[s:s + ctx.chunk].to(weight.dtype)
            m = (chunk @ weight.T).float().view(n, 2 ** (n_bits - lo), 2 ** lo)
            # g_lo, g_hi: fp32, ~2^-H/2
            g_lo, g_hi = code_probs(lg[:, :lo], bits_lo), code_probs(lg[:, lo:], bits_hi)
            q_lo = g_lo * torch.bmm(g_hi[:, None, :], m)[:, 0]  # sum of M*G over the high bits
            q_hi = g_hi * torch.bmm(m, g_lo[:, :, None])[:, :, 0]  # ... over the low bits
            total = q_lo.sum(-1, keepdim=True)  # sum_d M[d] G[d]
            p = torch.sigmoid(lg)
            grad_logits[s:s + n, :lo] = q_lo @ bits_lo - p[:, :lo] * total
            grad_logits[s:s + n, lo:] = q_hi @ bits_hi - p[:, lo:] * total
        # The weight's gradient is that of an embedding lookup: the value of the mapper is one-hot.
        grad_w = torch.zeros_like(weight)
        grad_w.index_add_(0, codes.reshape(-1), flat_grad.to(weight.dtype))
        return grad_logits.reshape(z_logits.shape).to(z_logits.dtype), None, grad_w, None


def sample_codes(z_logits, generator=None):
    """Sample each bit from Bernoulli(sigmoid(logit)) and pack the H bits into a code index."""
    p = torch.sigmoid(z_logits.float())
    # rand_like, not rand(p.shape): under torch.compile with a dynamic batch (a ragged last
    # validation batch) p.shape is symbolic and torch.rand refuses it.
    u = (torch.rand_like(p) if generator is None
         else torch.rand(p.shape, device=p.device, generator=generator))
    b = (u < p).long()
    return (b << torch.arange(b.shape[-1], device=b.device)).sum(-1)


def latent_kl(z_logits):
    """KL(Q(Z_t|S) || uniform over 2^H) per token, closed form since Q factorises over bits:
    sum_h [log 2 - H_b(p_h)], with H_b(p) = p*softplus(-l) + (1-p)*softplus(l) in nats."""
    lf = z_logits.float()
    p = torch.sigmoid(lf)
    entropy = p * F.softplus(-lf) + (1 - p) * F.softplus(lf)
    return (math.log(2) - entropy).sum(-1)


# ---------------------------------------------------------------------------------------------
# Models


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self.init_module)

    def init_module(self, m):
        """Initialise one module's own parameters (not its children's), so the same function
        serves plain construction and FSDP's meta-device param_init_fn."""
        std = self.cfg.init_std
        if isinstance(m, nn.Linear):
            s = std / math.sqrt(2 * self.cfg.n_layer) if getattr(m, "residual_out", False) else std
            nn.init.normal_(m.weight, 0.0, s)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        if isinstance(m, LoRALinear):  # as PEFT and torchtune: A as nn.Linear's default, B zero
            nn.init.kaiming_uniform_(m.lora_a, a=math.sqrt(5))
            nn.init.zeros_(m.lora_b)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
        elif isinstance(m, EncoderBlock):
            nn.init.normal_(m.zeta, 0.0, std)
        elif isinstance(m, LatentSampler):
            init_post_sampler(m.post_sampler, self.cfg)

    @staticmethod
    def muon_filter(name, p):
        """--optimizer muon's hidden matrices: the 2-D weights of the blocks and of the Free
        Transformer's encoder. The embedding, the head and the post-sampler table (rows looked up by
        token or code) take AdamW."""
        return p.dim() == 2 and name.startswith(("blocks.", "latent.encoder."))

    # Eager even inside a compiled model: compiled, inductor fuses the tables' sin and cos into
    # every block's rotary kernel and recomputes them for each batch row and head. Computed here
    # once per forward, they are an input.
    @torch.compiler.disable
    def rope(self, seq_len, device, offset=0):
        return rope_cos_sin(seq_len, self.cfg, device, offset)

    def forward(self, idx, mode="training", z=None, cache=None, positions=None):
        """Returns (logits, latent); latent is always None for the baseline. `cache` is a list of
        per-block dicts for generation (see generate). `positions` (B, T): each token's position in
        its document, 0 where one starts, for rows that pack several (see document_layout)."""
        cos, sin, masks = self.layout(idx, cache, positions)
        x = self.drop(self.tok_emb(idx))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache=None if cache is None else cache[i], mask=masks[0])
        return self.lm_head(self.norm(x)), None

    def layout(self, idx, cache=None, positions=None):
        """RoPE tables and the (decoder, encoder) attention masks of a forward."""
        cos, sin = self.rope(idx.shape[1], idx.device, offset=cached_length(cache))
        if positions is None:
            return cos, sin, (True, False)
        return document_layout(cos, sin, positions, self.cfg.dropout if self.training else 0.0)

    def latent_codes(self, prompt_ids, total, z, prompt_z, generator):
        return None  # the baseline has no latent

    def flops_per_token(self, seq_len):
        """Training flops per token, for the trainer's MFU (see the module-level function)."""
        return flops_per_token(self.cfg, seq_len)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, z=None,
                 prompt_z="prior", generator=None, stop=()):
        """Sample max_new_tokens after prompt_ids (B, T0) with a KV cache; call model.eval() first.
        Returns (tokens, codes or None); a seeded `generator` makes the samples reproducible.
        For the Free Transformer's Z, see latent_codes. Ends early once every row has generated
        one of the `stop` ids (a chat's end of turn)."""
        T0 = prompt_ids.shape[1]
        codes = self.latent_codes(prompt_ids, T0 + max_new_tokens, z, prompt_z, generator)
        cache = [dict() for _ in self.blocks]
        logits, _ = self(prompt_ids, z=None if codes is None else codes[:, :T0], cache=cache)
        out = prompt_ids
        stop_ids = torch.tensor(list(stop), dtype=torch.long, device=prompt_ids.device)
        for i in range(max_new_tokens):
            nxt = sample_next(logits[:, -1], temperature, top_k, generator)
            out = torch.cat([out, nxt], dim=1)
            if stop and torch.isin(out[:, T0:], stop_ids).any(dim=1).all():
                break
            if i + 1 < max_new_tokens:
                pos = slice(T0 + i, T0 + i + 1)
                logits, _ = self(nxt, z=None if codes is None else codes[:, pos], cache=cache)
        return out, codes


def document_layout(cos, sin, positions, dropout=0.0):
    """Rows that pack documents: each token's RoPE angles are those of its position in its own
    document, and a token attends only within its document (causally in the decoder). In training
    on a GPU the masks are FlexAttention block masks, which skip the blocks between documents
    (without dropout, which it lacks; evaluation runs eager, where FlexAttention is unfused);
    elsewhere dense booleans, (B, 1, T, T), for SDPA."""
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    docs = torch.cumsum(positions == 0, dim=1)
    if positions.is_cuda and dropout == 0 and torch.is_grad_enabled():
        return cos, sin, document_block_masks(docs)
    same = (docs[:, :, None] == docs[:, None, :]).unsqueeze(1)
    causal = torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
    return cos, sin, (same & causal, same)


_flex_attention = None  # compiled (eager, it is a slow reference) with the first block masks


@torch.compiler.disable  # made once a forward and shared by the blocks, compiled on its own
def document_block_masks(docs):
    """(decoder, encoder) FlexAttention block masks of the documents `docs` (B, T) numbers."""
    global _flex_attention
    _flex_attention = _flex_attention or torch.compile(flex.flex_attention)
    B, T = docs.shape

    def decoder(b, h, q, k):
        return (q >= k) & (docs[b, q] == docs[b, k])

    def encoder(b, h, q, k):
        return docs[b, q] == docs[b, k]
    return tuple(flex.create_block_mask(m, B, None, T, T, device=docs.device, _compile=True)
                 for m in (decoder, encoder))


def cached_length(cache):
    return 0 if not cache or "k" not in cache[0] else cache[0]["k"].shape[2]


def sample_next(logits, temperature, top_k, generator):
    """(B, V) logits -> (B, 1) token ids: greedy at temperature 0, else top-k sampling."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


class LatentSampler(nn.Module):
    """Encoder block + Binary Mapper + post-sampler weight (2^H x D). One module, so FSDP can
    shard the large post-sampler weight as its own unit."""

    def __init__(self, cfg):
        super().__init__()
        self.encoder = EncoderBlock(cfg)
        self.post_sampler = nn.Parameter(torch.empty(2 ** cfg.latent_bits, cfg.d_model))
        self.n_bits, self.chunk = cfg.latent_bits, cfg.mapper_chunk

    def forward(self, x, cos, sin, mode="training", z=None, mask=False):
        """Returns (R, z_logits). mode="training": Z from the encoder (posterior); "inference":
        Z drawn uniformly from the 2^H codes (prior), z_logits None. An explicit z (code
        indices, shape (B, T)) overrides both."""
        if z is not None:
            return F.embedding(z, self.post_sampler).to(x.dtype), None
        if mode == "inference":
            # Uniform over the 2^H codes, drawn as H fair bits: the posterior's sampler with all
            # bit-logits 0 draws the same codes from the same RNG state.
            codes = sample_codes(x.new_zeros(*x.shape[:2], self.n_bits))
            return F.embedding(codes, self.post_sampler).to(x.dtype), None
        if mode != "training":
            raise ValueError(f"mode {mode!r}: valid values are training, inference")
        z_logits = self.encoder(x, cos, sin, mask)
        codes = sample_codes(z_logits)
        r = _BinaryMapperST.apply(z_logits, codes, self.post_sampler, self.chunk)
        return r.to(x.dtype), z_logits


class FreeTransformer(Transformer):
    evaluation_note = ("validation: loss = nll_bound = CE + KL, a bound on the NLL comparable with "
                       "a baseline's CE; ce reads Z from the encoder, which has seen the row (not "
                       "comparable); prior_ce: Z from the prior, as in generation")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.latent = LatentSampler(cfg)
        self.latent.apply(self.init_module)

    def forward(self, idx, mode="training", z=None, cache=None, positions=None):
        cos, sin, (mask, encoder_mask) = self.layout(idx, cache, positions)
        x = self.drop(self.tok_emb(idx))
        half = self.cfg.n_layer // 2
        caches = [None] * len(self.blocks) if cache is None else cache
        for block, c in zip(self.blocks[:half], caches):
            x = block(x, cos, sin, cache=c, mask=mask)
        r, z_logits = self.latent(x, cos, sin, mode=mode, z=z, mask=encoder_mask)
        x, r_ratio = self.blocks[half](x, cos, sin, kv_extra=r, cache=caches[half], mask=mask)
        for block, c in zip(self.blocks[half + 1:], caches[half + 1:]):
            x = block(x, cos, sin, cache=c, mask=mask)
        latent = None if z_logits is None else {"z_logits": z_logits, "r_rms_ratio": r_ratio}
        return self.lm_head(self.norm(x)), latent

    def encoder_logits(self, idx):
        """The encoder's H bit-logits per position of idx (posterior Q(Z | idx))."""
        cos, sin = self.rope(idx.shape[1], idx.device)
        x = self.tok_emb(idx)
        for block in self.blocks[:self.cfg.n_layer // 2]:
            x = block(x, cos, sin)
        return self.latent.encoder(x, cos, sin)

    def latent_codes(self, prompt_ids, total, z, prompt_z, generator):
        """Z for every position of a generation: `z` (B, T0 + new) if given; else each position's Z
        is drawn once from the uniform prior. prompt_z="prior" (default) is the generative model
        training fits; "encoder" reads the prompt alone, which the encoder never saw (only rows)."""
        B, T0 = prompt_ids.shape
        if z is not None:
            if tuple(z.shape) != (B, total):
                raise ValueError(f"z has shape {tuple(z.shape)}; expected (batch, prompt + new) = "
                                 f"{(B, total)}")
            return z
        codes = torch.randint(0, 2 ** self.cfg.latent_bits, (B, total), device=prompt_ids.device,
                              generator=generator)
        if prompt_z == "encoder":
            codes[:, :T0] = sample_codes(self.encoder_logits(prompt_ids), generator)
        elif prompt_z != "prior":
            raise ValueError(f"prompt_z {prompt_z!r}: valid values are encoder, prior")
        return codes


def init_post_sampler(weight, cfg):
    """Rows of rms latent_std. "bits": row d = S[d] @ V / sqrt(H), S[d] the +-1 bits of code d and
    V an (H, D) normal matrix: each bit moves R along its own direction, so the encoder hears the
    decoder from the first step (with iid rows, "random", each bit gets about 2^(-H/2) of a row)."""
    std = cfg.latent_std
    with torch.no_grad():
        if cfg.latent_init == "bits":
            signs = 2 * code_bits(cfg.latent_bits, weight.device) - 1
            v = torch.randn(cfg.latent_bits, weight.shape[1], device=weight.device) * std
            weight.copy_((signs @ v / math.sqrt(cfg.latent_bits)).to(weight.dtype))
        else:
            nn.init.normal_(weight, 0.0, std)


def build_model(cfg):
    model = (FreeTransformer if cfg.arch == "free" else Transformer)(cfg)
    for name, p in model.named_parameters():  # LoRA: only the adapters train
        p.requires_grad = not cfg.lora_rank or ".lora_" in name
    return model


def lm_loss(logits, targets, latent=None, kappa=0.0):
    """Cross-entropy, plus for the Free Transformer (`latent`, the forward's second output) the
    free-bits KL term mean_t max(0, KL_t - kappa), hinged per token. Returns (total, {"ce", "kl",
    "r_rms_ratio"}), the parts detached for logging: KL or r_rms_ratio falling towards 0 is
    posterior collapse."""
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if latent is None:
        return ce, {"ce": ce.detach()}
    kl = latent_kl(latent["z_logits"])
    total = ce + torch.clamp(kl - kappa, min=0.0).mean()
    return total, {"ce": ce.detach(), "kl": kl.mean().detach(),
                   "r_rms_ratio": latent["r_rms_ratio"]}


@functools.cache
def compiled_lm_loss():
    """lm_loss compiled (the trainer's --compile): the cross-entropy over the vocabulary runs fused,
    without fp32 copies of the logits. Made on first use, since torch.compile loads dynamo."""
    return torch.compile(lm_loss)


def comparable_losses(model, x, y, parts, positions=None):
    """The Free Transformer's figures that compare with a baseline's CE, which its own CE does not:
    Z from the encoder has seen the row. nll_bound = CE + KL bounds -log p(x) per token (Z_t uniform
    under the prior); prior_ce: the CE with Z from the prior, as in generation (one more pass)."""
    prior_logits, _ = model(x, mode="inference", positions=positions)
    prior_ce, _ = lm_loss(prior_logits, y)  # no latent: the CE alone
    bound = parts["ce"] + parts["kl"]
    return bound, {"nll_bound": bound, "prior_ce": prior_ce}


def count_params(model):
    return sum(p.numel() for p in model.parameters())


def matmul_params(cfg):
    """Parameters in a matmul per token (for FLOP counts): the blocks and the LM head, not the two
    lookups (embedding, post-sampler). The encoder block is a block less its query projection
    (ζ is projected once)."""
    d, q, kv = cfg.d_model, cfg.n_head * head_size(cfg), cfg.n_kv_head * head_size(cfg)
    per_block = d * q * 2 + d * kv * 2 + 3 * d * cfg.ffn_hidden
    encoder = per_block - d * q + d * cfg.latent_bits if cfg.arch == "free" else 0
    return cfg.n_layer * per_block + encoder + d * cfg.vocab_size


def flops_per_token(cfg, seq_len):
    """6 * N_matmul (forward and backward; under LoRA 4 * N: the frozen weights get no gradient, the
    adapters' flops are negligible) plus causal attention, 6 * L * D * T: half the
    12 * L * D * T of torchtitan and nanoGPT, so the MFU is the conservative one. The Free
    Transformer adds its non-causal encoder attention (12 * D * T) and the Binary Mapper's backward
    GEMM (2 * 2^H * D)."""
    per_param = 4 if cfg.lora_rank else 6
    flops = per_param * matmul_params(cfg) + 6 * cfg.n_layer * cfg.d_model * seq_len
    if cfg.arch == "free":
        flops += 12 * cfg.d_model * seq_len + 2 * 2 ** cfg.latent_bits * cfg.d_model
    return flops


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints: the families whose weights --init-from reads (hf_checkpoint.py) and
# convert_to_hf.py writes. Their layout is this decoder's: the same rotary pairs (HF's
# rotate_half), heads as contiguous rows of the projections, SwiGLU as gate/up/down; so a weight
# is copied under another name, never permuted.

HF_FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
HF_TOP_NAMES = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                "lm_head.weight": "lm_head.weight"}
HF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.weight": "self_attn.k_proj.weight", "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.wo.weight": "self_attn.o_proj.weight", "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight", "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight", "mlp.w2.weight": "mlp.down_proj.weight"}


HF_SIZES = {"n_layer": "num_hidden_layers", "d_model": "hidden_size",
            "n_head": "num_attention_heads", "ffn_hidden": "intermediate_size",
            "vocab_size": "vocab_size", "norm_eps": "rms_norm_eps"}
HF_LLAMA3 = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
             "rope_high_freq_factor": "high_freq_factor",
             "rope_original_context": "original_max_position_embeddings"}


def hf_name(name):
    """The Hugging Face name of one of the baseline's parameters, or None (the Free Transformer's
    latent path has none)."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"model.layers.{i}.{HF_BLOCK_NAMES[rest]}" if rest in HF_BLOCK_NAMES else None
    return HF_TOP_NAMES.get(name)


def hf_fields(config, seq_len):
    """ModelConfig's fields for a Hugging Face config.json (a dict), as {field: (value, the
    config.json key it comes from)}; ValueError, in one line, for a model this decoder is not."""
    arch = (config.get("architectures") or [None])[0]
    if arch not in HF_FAMILIES:
        raise ValueError(f"architecture {arch or '(none: no architectures)'} is not one this "
                         f"decoder loads; supported: {', '.join(HF_FAMILIES)} (dense, no mixture "
                         "of experts)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    window = config.get("sliding_window") if arch == "MistralForCausalLM" else None
    act = config.get("hidden_act", "silu")
    refusals = [(act != "silu", f"hidden_act {act}"),
                (kind not in ("default", "llama3"), f"RoPE scaling {kind}"),
                (bool(config.get("mlp_bias")), "mlp_bias"),
                (arch != "Qwen2ForCausalLM" and bool(config.get("attention_bias")),
                 "attention_bias"),
                (bool(config.get("use_sliding_window")), "use_sliding_window"),
                (bool(window) and window < seq_len,
                 f"a sliding window of {window} tokens, shorter than --seq-len {seq_len}")]
    refused = [what for bad, what in refusals if bad]
    if refused:
        raise ValueError(f"{arch} with {', '.join(refused)}: this decoder computes another model")
    out = hf_copied(HF_SIZES, config, "", arch)
    heads, width = out["n_head"][0], out["d_model"][0]
    head_dim = config.get("head_dim") or width // heads
    theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
    out.update(
        arch=("baseline", "architectures"), hf_architecture=(arch, "architectures"),
        n_kv_head=(config.get("num_key_value_heads") or heads, "num_key_value_heads"),
        head_dim=(0 if head_dim * heads == width else head_dim, "head_dim"),
        rope_theta=(float(theta), "rope_theta"),
        tie_embeddings=(bool(config.get("tie_word_embeddings", False)), "tie_word_embeddings"),
        qkv_bias=(arch == "Qwen2ForCausalLM", "architectures"),
        qk_norm=(arch == "Qwen3ForCausalLM", "architectures"),
        sliding_window=(window or 0, "sliding_window"),
        rope_scaling=("llama3" if kind == "llama3" else "", "rope_scaling"))
    if kind == "llama3":
        where = "rope_parameters." if config.get("rope_parameters") else "rope_scaling."
        out.update(hf_copied(HF_LLAMA3, rope, where, arch))
    return out


def hf_copied(table, source, where, arch):
    """{field: (source's value as the field's type, its config.json key)} for `table`'s
    {field: key}; a key that `source` (config.json, or its `where` part) lacks is ValueError."""
    missing = [key for key in table.values() if key not in source]
    if missing:
        raise ValueError(f"config.json of a {arch} has no {where}{missing[0]}")
    return {name: (type(getattr(ModelConfig, name))(source[key]), where + key)
            for name, key in table.items()}


def hf_config(cfg, max_positions, special_ids):
    """config.json of the family the model came from (cfg.hf_architecture; a model trained here
    is Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms). The rotary settings are written under
    both transformers 4's (rope_theta, rope_scaling) and 5's (rope_parameters) names."""
    arch = cfg.hf_architecture or ("Qwen3ForCausalLM" if cfg.qk_norm else
                                   "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM")
    scaling = ({"rope_type": "llama3", "factor": cfg.rope_factor,
                "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_context}
               if cfg.rope_scaling == "llama3" else None)
    config = {"architectures": [arch], "model_type": HF_FAMILIES[arch],
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
              "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layer,
              "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
              "head_dim": head_size(cfg), "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
              "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
              "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                  **(scaling or {})},
              "max_position_embeddings": max_positions, "attention_dropout": 0.0,
              "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
              "use_cache": True, **special_ids}
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        config.update(attention_bias=False, mlp_bias=False)
    if arch == "MistralForCausalLM":
        config["sliding_window"] = cfg.sliding_window or None
    if arch.startswith("Qwen"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layer)
    return config
