"""The Alembic scripts (env.py, versions/): shipped as dsocr_workers.migrations (pyproject.toml)."""
