# dsocr-workers: the image every worker, the migrate job and the CLI run.
#   docker build -t dsocr-workers:latest .
#   docker build --build-arg TORCH_VERSION=2.11.0 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# torch is pinned to the build every GPU figure in docs/benchmarks.md was measured with (2.11.0, CUDA 13.0
# wheels, which carry their own CUDA runtime: the host needs only an NVIDIA driver for CUDA 13 and the
# container toolkit); the bare-metal instructions in deploy/README.md pin the same. The project itself
# needs torch>=2.8; CI runs the CPU build of 2.13.0 (scripts/setup.sh). The image adds the PostgreSQL
# driver, Flower (the `flower` service) and matplotlib (`dsocr report --html`). No weights are baked in:
# mount checkpoints at /models.
FROM python:3.12-slim

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

WORKDIR /app

# The project as a source tree (editable install, the migrations in /app/migrations/). The dependencies
# first, read from pyproject.toml alone, so that code edits do not reinstall them.
RUN python -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = p['optional-dependencies']; \
print('\n'.join(p['dependencies'] + extras['postgres'] + extras['flower'] + extras['report']))" \
        > /tmp/requirements.txt \
    && python -m pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt \
    && python -c "import torch, transformers, celery, sqlalchemy, psycopg, flower, matplotlib"
COPY . .
RUN python -m pip install --no-deps -e . && dsocr --version
# The bytecode of every installed module and of the project, written once here: the image sets
# PYTHONDONTWRITEBYTECODE, and without bytecode each worker start compiled torch's and transformers'
# sources again (~5 s of its imports on an H100 host, docs/benchmarks.md).
RUN python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        /app/dsocr_workers /app/migrations

# An unprivileged user; results go to the database. The one thing a container writes is the fast engine's
# compile cache (DSOCR_COMPILE_CACHE_DIR), on a volume.
# /var/cache/dsocr/compile: DSOCR_COMPILE_CACHE_DIR's mount point, owned by the worker's user so that a
# fresh named volume mounted there (docker-compose.yml) is writable.
RUN useradd --create-home --uid 1000 dsocr \
    && mkdir -p /models /var/cache/dsocr/compile && chown dsocr /var/cache/dsocr/compile
USER dsocr

# The compiled graphs are built per GPU type, on a GPU, into DSOCR_COMPILE_CACHE_DIR: `dsocr precompile`
# (a compose one-shot service and a Kubernetes init container run it before the workers). An image for one
# GPU type may carry them instead, built where `docker build` has a GPU (e.g. BuildKit with a GPU
# builder), then used read-only by every worker of that type:
#   ENV DSOCR_COMPILE_CACHE_DIR=/var/cache/dsocr/compile
#   RUN dsocr precompile --model full --modes gundam --max-new-tokens 2048 --gpus 0
# A worker refuses artifacts built for another GPU, torch or code version, and compiles (it says why).

# One process per container; compose/Kubernetes pick the command (worker, db upgrade, precompile, …).
CMD ["dsocr", "worker", "--gpus", "all"]
