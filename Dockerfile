# dsocr-workers on a CUDA PyTorch base: the image every worker, the migrate job and the CLI run.
#   docker build -t dsocr-workers:latest .
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:<tag> -t dsocr-workers:latest .
# The base brings CUDA, cuDNN and torch; pip keeps that torch (the project needs torch>=2.8) and adds
# the rest with the PostgreSQL driver, Flower (the `flower` service) and matplotlib (`dsocr report --html`).
# No weights are baked in: mount checkpoints at /models.
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    DSOCR_ARTIFACTS_DIR=/artifacts

WORKDIR /app

# The project as a source tree (editable install): `dsocr db upgrade` finds migrations/ beside the
# package, as in a checkout. Copied in two steps so that code edits do not reinstall dependencies.
COPY pyproject.toml README.md ./
COPY dsocr_workers/__init__.py dsocr_workers/__init__.py
RUN python -m pip install -e '.[postgres,flower,report]' \
    && python -c "import torch, transformers, celery, sqlalchemy, psycopg, flower, matplotlib"
COPY . .
RUN python -m pip install --no-deps -e . && dsocr --version

# An unprivileged user; /artifacts is created here so a named volume inherits its owner.
RUN useradd --create-home --uid 1000 dsocr \
    && mkdir -p /artifacts /models \
    && chown dsocr:dsocr /artifacts
USER dsocr

# One process per container; compose/Kubernetes pick the command (worker, db upgrade, submit, …).
CMD ["dsocr", "worker", "--gpus", "all"]
