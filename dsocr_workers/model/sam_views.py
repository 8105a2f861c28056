"""The fast engine's SAM block over a page's view groups at once: a gundam page's global view (64×64
patches) and its tiles (40×40 each) share the block's GEMMs instead of running them apart.

Everything in a SAM block but attention is per token (layer norms, the MLP, the residuals), and a
windowed block's attention is per 14×14 window, whatever view the window came from: the windows of all
views are one batch for the qkv projection, attention and the output projection. A global block
attends over a whole view, so its attention stays per view group; its MLP still runs over all of them.
The function is transformers' `DeepseekOcr2SamVisionLayer.forward` applied to each group (the same
operations on the same rows; only the GEMMs' row counts differ). The eager engine, the numerical
reference, keeps transformers' per-group forward.
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2SamVisionLayer


def sam_block_over_views(layer: DeepseekOcr2SamVisionLayer, groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """`layer(group)` for each (batch, height, width, channels) view group, the groups run together."""
    if layer.window_size > 0:
        windows, paddings = [], []
        for group in groups:
            group_windows, padding = layer.window_partition(layer.layer_norm1(group), layer.window_size)
            windows.append(group_windows)
            paddings.append(padding)
        attended, _ = layer.attn(torch.cat(windows))
        hidden = [
            group + layer.window_unpartition(part, layer.window_size, padding, (group.shape[1], group.shape[2]))
            for group, part, padding in zip(
                groups, attended.split([w.shape[0] for w in windows]), paddings, strict=True)
        ]
    else:
        hidden = [group + layer.attn(layer.layer_norm1(group))[0] for group in groups]
    rows = [group.reshape(-1, group.shape[-1]) for group in hidden]
    packed = torch.cat(rows)
    packed = packed + layer.mlp(layer.layer_norm2(packed))
    return [part.view(group.shape) for part, group in zip(packed.split([r.shape[0] for r in rows]), hidden, strict=True)]
