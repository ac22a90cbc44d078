# Weir: one image for every CPU role. The default command serves the preprocess role; compose (or `docker run`)
# picks another role by overriding the command, e.g. `weir serve encoder --host 0.0.0.0 --port 8102`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# No system FFmpeg: the PyAV wheels bundle their own. curl is only for the container healthcheck.
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

COPY pyproject.toml README.md ./
COPY launcher/ launcher/
COPY services/ services/
COPY preprocess/ preprocess/
COPY encoders/ encoders/
COPY trainer/ trainer/
COPY experience/ experience/
COPY engines/ engines/
COPY rollout/ rollout/
COPY profiles/ profiles/

# This pulls the default torch wheel, which on Linux x86-64 carries the CUDA libraries (several GB). For a much
# smaller CPU-only image, add PyTorch's CPU wheel index to this pip call with --extra-index-url.
RUN pip install --no-cache-dir .

# Run as an unprivileged user. /cache, /models, /experience and /secrets are created and owned by that user
# before volumes are mounted there, so a fresh named volume inherits the ownership and is writable.
RUN useradd --create-home --uid 10001 weir \
    && mkdir -p /cache /models /experience /secrets \
    && chown weir:weir /cache /models /experience /secrets
USER weir

ENV WEIR_CACHE_DIR=/cache
VOLUME /cache

EXPOSE 8101
CMD ["weir", "serve", "preprocess", "--host", "0.0.0.0", "--port", "8101"]
