# OOM Planner images, one Dockerfile, two targets (docker-compose.yml builds both):
#   api             planner + HTTP service + PostgreSQL driver + Ray (job submission, the Ray head,
#                   and the driver of verification jobs); runs `planner serve`, `planner db upgrade`
#                   and `ray start --head`
#   ray-gpu-worker  the same plus the workers extra (torch, transformers, peft, bitsandbytes,
#                   deepspeed): the node where verification runs train on a GPU
# No secret is baked in: the database URL and the API token come from the environment at run time.

FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PLANNER_HOME=/home/planner/.local/share/oom-planner \
    HF_HUB_OFFLINE=1
RUN useradd --create-home --uid 1000 planner
WORKDIR /opt/planner
COPY pyproject.toml README.md alembic.ini ./
COPY planner ./planner
COPY workers ./workers
COPY migrations ./migrations

FROM base AS api
RUN pip install ".[postgres,service,ray]"
USER planner
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
CMD ["planner", "serve", "--host", "0.0.0.0", "--port", "8000"]

FROM api AS ray-gpu-worker
USER root
# torch==2.13.0 from PyPI is the CUDA build on Linux x86_64 (its CUDA runtime comes as pip
# wheels); the host provides only the NVIDIA driver, through the NVIDIA container toolkit.
RUN pip install ".[workers]"
USER planner
HEALTHCHECK NONE
CMD ["ray", "start", "--address=ray-head:6379", "--num-gpus=1", "--block"]
