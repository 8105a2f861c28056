"""DeepSeek-OCR-2: SAM ViT-B (896-channel compressor), a Qwen2 encoder whose learned queries read the
visual tokens, a linear projector, and v1's DeepSeek MoE decoder."""
