# cancel-sidecar: runs next to an inference engine in the same pod.
# Build: docker build -t cancel-sidecar .   (not buildable on the project's CI machines: no Docker engine)
# Run:   docker run -v $PWD/config/sidecar.yaml:/etc/cancel-sidecar/sidecar.yaml:ro -p 8080:8080 cancel-sidecar

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
COPY engine ./engine
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin sidecar
COPY config/sidecar.yaml /etc/cancel-sidecar/sidecar.yaml
USER 10001
# Proxy (clients) and admin (/healthz, /readyz, /metrics). Inside a pod, set listen.host and
# admin.host to 0.0.0.0 in the mounted config so the kubelet and the Service can reach them.
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=2s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:9090/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["cancel-sidecar"]
CMD ["--config", "/etc/cancel-sidecar/sidecar.yaml"]
