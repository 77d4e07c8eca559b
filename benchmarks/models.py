"""Plain-torch models for the benchmark data built by ``benchmarks/data.py``.

* :class:`BertEncoder` — a minimal BERT encoder whose ``state_dict`` names, shapes and
  dtypes match the shipped all-MiniLM-L6-v2 ``model.safetensors`` exactly, so the real
  weights load with ``strict=True`` and fine-tunes save back in the same layout.
* :class:`MeanPoolClassifier` — the throw-away task head used for fine-tuning (never saved).
* :class:`TinyGPT` — a small pre-LayerNorm decoder trained from scratch.

No transformers dependency: the benchmark only needs realistic weight *updates*, not
a faithful tokenizer or inference stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# -- BERT (all-MiniLM-L6-v2 layout) -----------------------------------------------------------


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    @classmethod
    def from_hf(cls, cfg: dict) -> BertConfig:
        """Build from a Hugging Face ``config.json`` dict, ignoring keys we do not model."""
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are modelled")
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in cfg.items() if k in names})


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        # The shipped checkpoint stores this int64 buffer; keeping it persistent makes every
        # fine-tune carry the same tensor names, dtypes and shapes as the base file.
        self.register_buffer(
            "position_ids", torch.arange(cfg.max_position_embeddings).unsqueeze(0), persistent=True
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        positions = self.position_ids[:, :seq_len]
        # Single-segment inputs: token type 0 everywhere, as sentence-transformers does.
        token_types = torch.zeros_like(input_ids)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_types)
        )
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        return x.view(batch, seq, self.num_heads, hidden // self.num_heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        # key_mask is (batch, seq) True for real tokens; broadcast over heads and queries.
        attn_mask = None if key_mask is None else key_mask[:, None, None, :]
        dropout = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout)
        batch, _, seq, _ = out.shape
        return out.transpose(1, 2).reshape(batch, seq, -1)


class BertSelfOutput(nn.Module):
    """Projection + residual + LayerNorm (post-LN, as in BERT)."""

    def __init__(self, cfg: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, key_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # exact (erf) GELU, as BERT's "gelu"


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, key_mask)
        return self.output(self.intermediate(x), x)


class BertEncoderStack(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, key_mask)
        return x


class BertPooler(nn.Module):
    """Present only so the shipped ``pooler.dense`` tensors load and round-trip; the
    mean-pooling head does not use it, so fine-tunes leave it bit-identical to the base."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertEncoder(nn.Module):
    """BertModel with the exact parameter names of the Hugging Face checkpoint."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoderStack(cfg)
        self.pooler = BertPooler(cfg)

    def forward(
        self, input_ids: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token states ``(batch, seq, hidden)``; ``key_mask`` marks real (non-pad) tokens."""
        return self.encoder(self.embeddings(input_ids), key_mask)


class MeanPoolClassifier(nn.Module):
    """Sentence-transformers style mean pooling + a linear layer. Only ``encoder`` is saved."""

    def __init__(self, encoder: BertEncoder, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.classifier = nn.Linear(encoder.config.hidden_size, num_classes)

    def forward(self, input_ids: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids, key_mask)
        weights = key_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.classifier(pooled)


# -- GPT ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    d_model: int = 512
    n_layers: int = 6
    n_heads: int = 8
    context: int = 128
    mlp_ratio: int = 4


class GPTBlock(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn_qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp_fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.mlp_proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        qkv = self.attn_qkv(x).view(batch, seq, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, seq, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(out.transpose(1, 2).reshape(batch, seq, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x)), approximate="tanh"))


class TinyGPT(nn.Module):
    """Untied input/output embeddings (lm_head is its own matrix), learned positions."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2 style: shrink residual projections so deep residual sums start near unit scale.
        for block in self.blocks:
            for proj in (block.attn_proj, block.mlp_proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
