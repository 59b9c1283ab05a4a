# cancel-sidecar: runs next to an inference engine in the same pod.
# Build: docker build -t cancel-sidecar .
# Run:   docker run --network host -v cancel-sidecar-state:/var/lib/cancel-sidecar \
#          -v $PWD/config/sidecar.yaml:/etc/cancel-sidecar/sidecar.yaml:ro cancel-sidecar
#        The built-in config (config/sidecar.yaml) listens on 127.0.0.1:8080 and finds vLLM on
#        127.0.0.1:8000: the host's loopback here. With `-p 8080:8080` instead, both would be
#        the container's own loopback: nothing reaches the listener and no engine is there.
#        Elsewhere, mount a config whose listen.host is 0.0.0.0 and whose engine url is vLLM's.
# BASE: any image with Python 3.11+ and pip on PATH as `python`/`pip`. CI builds this file with
# podman against a stand-in base made from Debian's packages (tests/test_image.py: registry
# images cannot be pulled there).
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
COPY engine ./engine
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${BASE}
# CANCEL_SIDECAR_HEALTHCHECK_URL: what HEALTHCHECK asks; set it when the mounted config's admin
# listener is not on port 9090.
# XDG_STATE_HOME: lifecycle.record_dir's default is $XDG_STATE_HOME/cancel-sidecar, so the record
# of in-flight engine work goes to /var/lib/cancel-sidecar (the user's own, mode 0700). A killed
# sidecar's next start aborts what that record names, if it is still there: mount a volume at
# /var/lib/cancel-sidecar (a named volume; an emptyDir in Kubernetes) for it to outlive the
# container. A new named volume takes the directory's owner and mode from the image.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    XDG_STATE_HOME=/var/lib \
    CANCEL_SIDECAR_HEALTHCHECK_URL=http://127.0.0.1:9090/healthz
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin sidecar \
    && install -d -o sidecar -g sidecar -m 0700 /var/lib/cancel-sidecar
COPY config/sidecar.yaml /etc/cancel-sidecar/sidecar.yaml
USER 10001
# Proxy (clients) and admin (/healthz, /readyz, /metrics). Inside a pod, set listen.host and
# admin.host to 0.0.0.0 in the mounted config so the kubelet and the Service can reach them.
EXPOSE 8080 9090
HEALTHCHECK --interval=10s --timeout=2s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os,sys,urllib.request; sys.exit(urllib.request.urlopen(os.environ['CANCEL_SIDECAR_HEALTHCHECK_URL'], timeout=2).status != 200)"]
ENTRYPOINT ["cancel-sidecar"]
CMD ["--config", "/etc/cancel-sidecar/sidecar.yaml"]
