# One image for every fluxjoin role: generator, join instance (Spark in local mode inside the pod, or the
# driver of executor pods), Spark executor (`fluxjoin executor`) and the operator. `make image` (scripts/build-image.sh) builds it as fluxjoin:dev; the Helm chart runs it
# with different arguments. Plain `docker build .` works too where PyPI's certificates verify as they are.
#
# Two stages: the builder has pip and builds the wheels (PySpark ships as a source archive only); the
# final stage holds the JRE, Python and the virtualenv (pip removed), runs as a non-root user and has no
# build tools.

FROM debian:bookworm-slim AS build
# Extra CA certificates (PEM) for networks that inspect TLS on the way to PyPI; the build stage only.
ARG EXTRA_CA_CERTS=""
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-pip ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && if [ -n "$EXTRA_CA_CERTS" ]; then \
        printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/extra.crt && update-ca-certificates; \
    fi
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DEFAULT_TIMEOUT=180
RUN python3 -m venv /opt/fluxjoin
# Dependencies first, from the hashed lock, so a code change does not rebuild the PySpark wheel.
COPY requirements.lock /src/requirements.lock
RUN /opt/fluxjoin/bin/pip install --no-cache-dir --require-hashes -r /src/requirements.lock
COPY pyproject.toml /src/pyproject.toml
COPY README.md /src/README.md
COPY pipeline /src/pipeline
COPY generator /src/generator
COPY controller /src/controller
COPY bench /src/bench
COPY local /src/local
COPY fluxjoin /src/fluxjoin
RUN /opt/fluxjoin/bin/pip install --no-cache-dir --no-deps /src \
    && /opt/fluxjoin/bin/python -m pip uninstall -y pip

FROM debian:bookworm-slim
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 openjdk-17-jre-headless procps tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/fluxjoin --create-home fluxjoin
COPY --from=build /opt/fluxjoin /opt/fluxjoin
ENV PATH=/opt/fluxjoin/bin:$PATH \
    PYSPARK_PYTHON=/opt/fluxjoin/bin/python \
    PYSPARK_DRIVER_PYTHON=/opt/fluxjoin/bin/python \
    # The JVM sizes its heap from the container's memory limit, not the node's.
    JAVA_TOOL_OPTIONS="-XX:+UseContainerSupport -XX:MaxRAMPercentage=60 -XX:+ExitOnOutOfMemoryError" \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /var/lib/fluxjoin
ENTRYPOINT ["/usr/bin/tini", "--", "fluxjoin"]
CMD ["--help"]
