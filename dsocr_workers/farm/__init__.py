"""The farm: submit (`submit.py`, `filelist.py`, `run_options.py`), Celery (`celery/`), the job process
(`job/`), liveness (`liveness.py`, `owners.py`) and `dsocr run`'s in-process line (`local_run.py`)."""
