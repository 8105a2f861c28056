"""The fast engine's decoder projections, fused: one GEMM for q, k and v, one for gate and up, and the
MoE router as one kernel (model/router.py).

At batch 1 every projection is a small GEMV bound by launch and tail, not by its size (docs/benchmarks.md
"What limits decode"): reading the three attention inputs, or the MLP's gate and up, as one matrix saves
two launches per attention and one per MLP.
The modules replace transformers' in place after loading (their weights concatenated, the originals
dropped), so checkpoints keep the vendor's layout; the eager engine, the numerical reference, keeps
the unfused modules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import StaticLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import (
    DeepseekOcr2TextAttention,
    DeepseekOcr2TextMLP,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from dsocr_workers.model.router import FusedRouter


class AttendingCache(ABC):
    """A KV cache that attends for the layer: it writes the step's keys and values and returns the
    attention output, [batch, heads, queries, head_dim]. The batched engine's slots are one when each row
    reads only its own filled positions (engine/batched/slots.py `FilledSlotsCache`), which a mask over
    the slot's whole capacity cannot skip."""

    @abstractmethod
    def update_and_attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scaling: float
    ) -> torch.Tensor: ...


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([p.weight.detach() for p in parts])
    fused = nn.Linear(
        weight.shape[1],
        weight.shape[0],
        bias=parts[0].bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(weight)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in parts if p.bias is not None]))
    return fused


class FusedQKVAttention(nn.Module):
    """transformers' DeepseekOcr2TextAttention with q, k and v read as one [3·heads·head_dim, hidden]
    matrix."""

    def __init__(self, attention: DeepseekOcr2TextAttention) -> None:
        super().__init__()
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.num_key_value_groups = attention.num_key_value_groups  # read by the attention interfaces
        self.scaling = attention.scaling
        self.attention_dropout = attention.attention_dropout
        self.is_causal = attention.is_causal
        self.split = (
            attention.q_proj.out_features,
            attention.k_proj.out_features,
            attention.v_proj.out_features,
        )
        self.qkv_proj = _fused_linear([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj = attention.o_proj

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The decoder layer hands the KV cache over as `cache` from transformers 5.24 and as
        # `past_key_values` before (the device images carry 5.17).
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query, key, value = (
            part.view(hidden_shape).transpose(1, 2)
            for part in self.qkv_proj(hidden_states).split(self.split, dim=-1)
        )
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        if isinstance(cache, AttendingCache):
            output = cache.update_and_attend(query, key, value, self.layer_idx, self.scaling).transpose(1, 2)
            return self.o_proj(output.reshape(*input_shape, -1).contiguous()), None
        if isinstance(cache, StaticLayer):
            # This layer's own cache (the layer-by-layer prefill, engine/regions.py), its index unread: a
            # compiled layer would take it as a constant. That prefill fills the cache from slot 0, so
            # causal attention over the prompt's own keys replaces a masked pass over the whole bucket.
            cache.update(key, value)
        elif cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, weights = attention(
            self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


class FusedGateUpMLP(nn.Module):
    """transformers' DeepseekOcr2TextMLP (dense layer, shared experts) with gate and up as one matrix."""

    def __init__(self, mlp: DeepseekOcr2TextMLP) -> None:
        super().__init__()
        self.gate_up_proj = _fused_linear([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse_projections(language_model: nn.Module, router: bool = True) -> None:
    """Swap every decoder layer's attention, (dense or shared-expert) MLP and, with `router`, greedy router
    for the fused modules."""
    layers: nn.ModuleList = language_model.layers  # type: ignore[assignment]
    for layer in layers:
        layer.self_attn = FusedQKVAttention(layer.self_attn)  # type: ignore[arg-type]
        if isinstance(layer.mlp, DeepseekOcr2TextMLP):
            layer.mlp = FusedGateUpMLP(layer.mlp)
        else:
            layer.mlp.shared_experts = FusedGateUpMLP(layer.mlp.shared_experts)  # type: ignore[union-attr, arg-type]
            if router and layer.mlp.gate.topk_method == "greedy":  # type: ignore[union-attr]
                layer.mlp.gate = FusedRouter(layer.mlp.gate)  # type: ignore[union-attr, arg-type]
