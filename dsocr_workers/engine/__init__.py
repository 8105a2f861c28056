"""Split prefill/decode inference with stage timings. Knows nothing of Celery or SQL."""
