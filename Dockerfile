# syntax=docker/dockerfile:1
# Siesta: `siesta serve` on a CUDA GPU. Build from the repository root:
#   docker build -t siesta-serve:0.1.0 .
# Run (see deploy/README.md): the model directory is mounted under /models.
#   docker run --gpus all -p 127.0.0.1:30000:30000 -v /data/models:/models:ro siesta-serve:0.1.0 \
#     --model /models/Qwen3-8B --host 0.0.0.0 --port 30000
#
# The base image brings CUDA 12.8, cuDNN 9, Python and a CUDA build of torch (with its Triton);
# pip keeps that torch (the install below pins it) and adds the rest of the dependencies.
FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/siesta
COPY pyproject.toml README.md ./
COPY engine ./engine/
COPY server ./server/

# Install the project; never replace the base image's CUDA torch with another build.
RUN pip install --no-cache-dir . "torch==$(python -c 'import torch; print(torch.__version__)')"

# Run as an unprivileged user; its home holds the Triton kernel cache and the demo model.
RUN groupadd --gid 10001 siesta \
    && useradd --create-home --uid 10001 --gid 10001 siesta \
    && mkdir -p /models \
    && chown siesta:siesta /models
# Numeric, so that Kubernetes can check runAsNonRoot against the image.
USER 10001:10001
ENV HOME=/home/siesta
WORKDIR /home/siesta

# Mount model directories here (read-only is fine: the server only reads checkpoints).
VOLUME ["/models"]
EXPOSE 30000

# 200 only when the engine process answers; loading weights and capturing CUDA graphs can take
# minutes, hence the long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=4)"]

ENTRYPOINT ["siesta", "serve"]
# Listens on all interfaces of the container only; publish the port on the host deliberately.
CMD ["--host", "0.0.0.0", "--port", "30000"]
