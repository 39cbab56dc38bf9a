# syntax=docker/dockerfile:1
#
# moegemm, the ROCm image (AMD Instinct MI300 / MI350, FlyDSL backend).
#
#   docker build -t moegemm:rocm .
#   docker run --rm -p 8000:8000 --device /dev/kfd --device /dev/dri --group-add video \
#       --shm-size=1g -v /srv/weights:/weights:ro -e MOEGEMM_TOKEN=... moegemm:rocm
#
# MOEGEMM_DEVICE defaults to "cuda" (torch's name for the ROCm GPU too): a container
# started without its GPU exits at once with a message, instead of serving from the
# CPU. MOEGEMM_BACKEND=flydsl, for the same reason: a FlyDSL that cannot load stops the
# server, naming why, where "auto" would serve from the slow reference with a warning.
# Where the host's /dev/dri/renderD* belong to a "render" group, also pass
# --group-add "$(getent group render | cut -d: -f3)".
#
# Why this base: rocm/pytorch:rocm7.14.1_ubuntu24.04_py3.12_pytorch_release_2.12.0
#   - its torch 2.12 ROCm build satisfies the server extra (torch>=2.11) and is
#     kept as shipped: the constraints file below stops pip from ever replacing
#     it with a PyPI wheel;
#   - ROCm 7.x, because flydsl 0.5.0's JIT runtime links libamdhip64.so.7
#     (the ROCm 10 images ship a newer soname);
#   - Python 3.12, for which flydsl 0.5.0 publishes a wheel.
# Pin it harder with "@sha256:<digest>" once the digest has been checked with
# `docker buildx imagetools inspect` on a machine that reaches the registry.
FROM rocm/pytorch:rocm7.14.1_ubuntu24.04_py3.12_pytorch_release_2.12.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Only what the wheel needs; .dockerignore keeps the rest of the tree out.
COPY pyproject.toml README.md /opt/moegemm/src/
COPY moegemm/ /opt/moegemm/src/moegemm/
COPY kernels/ /opt/moegemm/src/kernels/
COPY server/ /opt/moegemm/src/server/
COPY client/ /opt/moegemm/src/client/

# The base's python3 must be the interpreter that holds its ROCm torch (a
# wrong PATH would install into a torch-less Python): fail the build if not.
# Then freeze the image's own torch (and Triton) as constraints, so that
# resolving our extras can never swap them for other builds ("pip list" and
# not "pip freeze": a torch installed from a local wheel freezes as "@ file:").
RUN python3 -c "import torch, sys; sys.exit(0 if torch.version.hip else 'python3 has no ROCm torch')" \
    && python3 -m pip list --format=freeze | grep -iE '^(torch|triton|pytorch-triton-rocm)==' > /tmp/keep.txt \
    && python3 -m pip install --no-cache-dir -c /tmp/keep.txt '/opt/moegemm/src[server,rocm]' \
    && moegemm serve --help > /dev/null \
    && rm -rf /opt/moegemm/src /tmp/keep.txt

# A non-root user; "video" gives it the GPU device nodes that the runtime
# (docker --device, the Kubernetes device plugin) hands the container.
RUN groupadd --gid 10001 moegemm \
    && useradd --uid 10001 --gid 10001 --groups video --create-home --shell /usr/sbin/nologin moegemm \
    && mkdir -p /weights \
    && chown moegemm:moegemm /weights
USER 10001
WORKDIR /home/moegemm

# Settings come only from the environment (moegemm.server.config.Settings,
# prefix MOEGEMM_). These are the image's defaults; override them with -e,
# an env file, or a Kubernetes ConfigMap/Secret. The tokens have no default.
ENV MOEGEMM_HOST=0.0.0.0 \
    MOEGEMM_PORT=8000 \
    MOEGEMM_DEVICE=cuda \
    MOEGEMM_BACKEND=flydsl \
    MOEGEMM_WEIGHTS_DIR=/weights \
    MOEGEMM_LOG_LEVEL=info \
    PYTHONUNBUFFERED=1

EXPOSE 8000

# Liveness only: "ready" stays 503 while weights load and graphs are captured,
# which can take minutes and must not mark the container unhealthy. The image
# has no curl; the Python it runs on is enough.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('MOEGEMM_PORT', '8000') + '/v1/health/live', timeout=4)"]

# Exec form: moegemm is PID 1 and gets SIGTERM itself, so its transport stops
# accepting and lets the requests in flight finish (the drain, MOEGEMM_SHUTDOWN_GRACE_S).
ENTRYPOINT ["moegemm", "serve"]
