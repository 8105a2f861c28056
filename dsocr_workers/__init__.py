"""dsocr-workers: a distributed, queue-driven profiling farm for DeepSeek-OCR."""

__version__ = "0.1.0"
