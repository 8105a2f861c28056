"""DeepSeek-OCR (v1): SAM ViT-B with its 16x compressor, a CLIP-L trunk fed with SAM features, a linear
projector over both, newline and separator vectors in the image layout, and the DeepSeek MoE decoder."""
