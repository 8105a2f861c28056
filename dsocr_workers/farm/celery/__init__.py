"""The farm on Celery: the app (`app.py`), the broker transport (`broker.py`), the thin task
(`tasks.py`), the messages it carries (`messages.py`) and the worker's start (`worker.py`)."""
