# Weir: one image for every CPU role, the one-shot services and the trainer. The default command serves the
# preprocess role; compose (or `docker run`) picks another by overriding the command, e.g.
# `weir serve encoder --host 0.0.0.0 --port 8102`.
#
#   docker build -t weir:dev .                                  # PyTorch's default wheel (CUDA on x86-64)
#   docker build -t weir:dev --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   # CPU only
FROM python:3.11-slim

# An extra package index for PyTorch's wheels: its CPU index gives torch 2.14.1+cpu (the pin accepts it) without
# the CUDA libraries, a much smaller image. Empty: PyPI's wheel.
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# No system FFmpeg: the PyAV wheels bundle their own. curl is only for the container health checks.
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# 1. The dependencies, read from pyproject.toml alone: this layer is rebuilt only when pyproject.toml changes,
#    never for a source change (it is the 5-7 minutes and several GB of the build). setuptools is the build
#    backend the second step uses without a network.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        'setuptools>=77' -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# An unprivileged user. /cache, /models, /experience, /secrets, /spool and /train are made and owned by it before
# volumes are mounted there, so a fresh named volume takes that ownership and the roles can write to it.
RUN useradd --create-home --uid 10001 weir \
    && mkdir -p /cache /models /experience /secrets /spool /train \
    && chown weir:weir /cache /models /experience /secrets /spool /train

# 2. Weir itself, without its dependencies (seconds): the packages pyproject.toml lists, nothing else
#    (.dockerignore keeps the rest of the folder out of the build context).
COPY README.md ./
COPY launcher/ launcher/
COPY services/ services/
COPY preprocess/ preprocess/
COPY encoders/ encoders/
COPY trainer/ trainer/
COPY experience/ experience/
COPY engines/ engines/
COPY rollout/ rollout/
COPY twin/ twin/
COPY wire/ wire/
COPY profiles/ profiles/
RUN pip install --no-cache-dir --no-deps --no-build-isolation . && rm -rf build *.egg-info

USER weir

ENV WEIR_CACHE_DIR=/cache
VOLUME /cache

EXPOSE 8101
CMD ["weir", "serve", "preprocess", "--host", "0.0.0.0", "--port", "8101"]
