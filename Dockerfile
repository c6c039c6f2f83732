# The elastictrain image for Kubernetes (KubeRay head, workers and job submitter; the MLflow server).
#
#   GPU layout (PyPI's torch build, which bundles CUDA; the node needs the NVIDIA driver + device plugin):
#     docker build -t REGISTRY/elastictrain:0.1.0-gpu .
#   CPU demo (a CPU-only torch build, a few GB smaller):
#     docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#       -t REGISTRY/elastictrain:0.1.0-cpu .
#
#   Where no registry is reachable: `make image` builds it on a Debian base made with debootstrap
#   (docker/build-image.sh passes --build-arg PYTHON_IMAGE=elastictrain-base:bookworm).
#
# Runs as the non-root user elastictrain (uid/gid 1000), as the manifests in k8s/ expect.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# Where torch comes from: empty means PyPI (CUDA build on Linux x86_64).
ARG TORCH_INDEX_URL=""

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# build-essential: DeepSpeed compiles its CPU Adam, async I/O and shared-memory ops on first use, on
# the node that runs them (they are built with -march=native, so not baked into the image).
# libaio-dev: DeepSpeed's async_io op, needed for NVMe offload (deepspeed.offload_*: nvme).
# wget: KubeRay's readiness and liveness probes of Ray pods call it.
# A bare Debian base (make image) also needs python3-venv, and python3-dev for the headers the
# JIT-built ops compile against; the python image has both for its own Python.
RUN apt-get update \
    && headers=$(python3 -c 'import os, sysconfig; print(os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))') \
    && apt-get install -y --no-install-recommends build-essential libaio-dev wget python3-venv \
        $([ "$headers" = True ] || echo python3-dev) \
    && rm -rf /var/lib/apt/lists/*

# What `make image` adds from the building machine (docker/extra/): its CA bundle, for a network whose
# TLS proxy has its own CA, and a torch CPU wheel folder pip also looks in. Elsewhere: only a README.
COPY docker/extra/ /opt/build-extra/
RUN if [ -s /opt/build-extra/ca-certificates.crt ]; then \
        printf '[global]\ncert = /opt/build-extra/ca-certificates.crt\n' > /etc/pip.conf; fi
ENV PIP_FIND_LINKS=/opt/build-extra/wheels

RUN groupadd --gid 1000 elastictrain \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash elastictrain

RUN python3 -m venv /opt/venv && pip install --upgrade pip

# torch pinned first and on its own: a plain `torch` requirement would pull whatever build is newest.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0

WORKDIR /opt/elastictrain
COPY pyproject.toml README.md ./
COPY src ./src
# Ray is pinned to the rayVersion the manifests declare (k8s/base/job/rayjob.yaml); mlflow[auth] brings
# the basic-auth app the MLflow Deployment runs; torch==2.13.0 again so nothing replaces it.
RUN pip install "torch==2.13.0" "ray[train]==2.60.0" "deepspeed==0.19.8" "mlflow[auth]==3.17.2" . \
    && elastictrain --help >/dev/null

USER 1000:1000
WORKDIR /home/elastictrain
CMD ["elastictrain", "--help"]
