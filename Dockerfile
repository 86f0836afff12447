# attention_server as a container: two stages on Debian 12. The build stage
# compiles only the binaries (Release, no tests or benchmarks); the runtime
# stage holds the runtime libraries, the binaries and the model repository, and
# runs as a non-root user.
#
#   podman build -t attention-service .        # or docker build
#   podman run --rm -p 50051:50051 -p 9464:9464 attention-service [SERVER FLAGS...]
#
# BASE_IMAGE is both stages' base: any Debian 12 image with apt, e.g. one made
# locally with debootstrap (deploy/container-test.sh does that).
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS build
# What a host build needs, without the tests' tools: deploy/install-deps.sh.
COPY deploy/install-deps.sh /tmp/install-deps.sh
RUN bash /tmp/install-deps.sh --build-only && rm -rf /var/lib/apt/lists/* /tmp/install-deps.sh
WORKDIR /src
# Only what the binaries are built from, so edits elsewhere keep this layer cached.
COPY CMakeLists.txt ./
# cmake/ and deploy/debian/: the install rules' templates, which configuring reads.
COPY cmake/ cmake/
COPY deploy/debian/ deploy/debian/
COPY proto/ proto/
COPY common/ common/
COPY engine/ engine/
COPY server/ server/
COPY client/ client/
ARG BUILD_JOBS=2
# attention_loadtest is built when the tree has that target.
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DATTENTION_BUILD_TESTS=OFF -DATTENTION_BUILD_BENCHMARKS=OFF \
      -DATTENTION_DEFAULT_MODEL_REPOSITORY=/opt/attention/models \
    && targets="attention_server attention_cli" \
    && if ninja -C /build -t query attention_loadtest >/dev/null 2>&1; then \
         targets="$targets attention_loadtest"; fi \
    && cmake --build /build -j"${BUILD_JOBS}" --target $targets \
    && mkdir /out && for t in $targets; do cp "/build/$t" /out/; done \
    && strip /out/*

FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
         libgrpc++1.51 libprotobuf32 libabsl20220623 libdnnl2 libgomp1 libspdlog1.10 \
         libcpp-httplib0.11 libssl3 libnghttp2-14 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
         --shell /usr/sbin/nologin attention
COPY --from=build /out/ /usr/local/bin/
COPY models/ /opt/attention/models/
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
# gRPC (AttentionService, grpc.health.v1.Health, reflection) and Prometheus metrics.
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["attention_cli", "--target", "127.0.0.1:50051", "--timeout", "2s", "health"]
# Arguments given to the container are appended: a repeated flag overrides
# these (the last one wins), e.g. --drain_seconds=20 or --max_batch_size=64.
ENTRYPOINT ["attention_server", "--listen=0.0.0.0:50051", "--metrics_host=0.0.0.0", \
            "--metrics_port=9464", "--model_repository=/opt/attention/models"]
