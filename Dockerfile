# Two stages on Debian 12: build with the -dev packages, run on the slim image
# with the runtime libraries only. BASE_IMAGE lets the image be built from a
# local Debian 12 base (see README).
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      cmake ninja-build g++ pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev \
      protobuf-compiler libabsl-dev nlohmann-json3-dev libdnnl-dev libspdlog-dev \
      libcpp-httplib-dev libssl-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTENTION_BUILD_TESTS=OFF \
      -DATTENTION_DEFAULT_MODEL_REPOSITORY=/opt/attention/models \
    && cmake --build /build -j2 --target attention_server attention_cli

FROM ${BASE_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libabsl20220623 libdnnl2 libgomp1 libspdlog1.10 \
      libcpp-httplib0.11 libssl3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home attention
COPY --from=build /build/attention_server /build/attention_cli /usr/local/bin/
COPY --from=build /src/models /opt/attention/models
USER 10001
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=3s CMD ["attention_cli", "--target", "127.0.0.1:50051", "health"]
ENTRYPOINT ["attention_server", "--listen", "0.0.0.0:50051", "--metrics_host", "0.0.0.0", "--metrics_port", "9090"]
