# syntax=docker/dockerfile:1
# optimus-coord (the control plane) with optimusctl, for linux/amd64 (and
# linux/arm64 where a cross-built coordinator is staged; see README.md).
# The binaries come from the Bazel build, staged by deploy/docker/stage.sh:
#   CONTEXT/amd64/optimus-coord   bazel build //coordinator:optimus-coord
#   CONTEXT/amd64/optimusctl      bazel build //cli:optimusctl
# Build:
#   docker buildx build -f deploy/docker/coord.Dockerfile \
#     --platform linux/amd64 -t REGISTRY/optimus/optimus-coord:TAG --push out/docker
FROM debian:bookworm-slim

ARG TARGETARCH

# Runtime libraries of optimus-coord and optimusctl: gRPC, protobuf, abseil,
# re2, c-ares, OpenSSL, libstdc++, cpp-httplib and brotli for /metrics and
# /healthz (optimus-coord itself has no data plane and needs no UCX);
# UCX and yaml-cpp for optimusctl (`job create -f` reads job specs with the
# client library, which links UCX), and libtorch for `optimusctl checkpoint export` (it writes torch.load-able
# files; apt brings libtorch's own dependencies).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates \
      libgrpc++1.51 libgrpc29 libprotobuf32 \
      libabsl20220623 libre2-9 libc-ares2 libssl3 libstdc++6 zlib1g \
      libcpp-httplib0.11 libbrotli1 \
      libtorch1.13 \
      libucx0 libyaml-cpp0.7 \
 && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 65532 optimus \
 && useradd --system --uid 65532 --gid 65532 --home-dir /var/lib/optimus --no-create-home \
      --shell /usr/sbin/nologin optimus \
 && install -d -o 65532 -g 65532 -m 0750 /var/lib/optimus

COPY --chmod=0755 ${TARGETARCH}/optimus-coord ${TARGETARCH}/optimusctl /usr/local/bin/

# Fails the build early if a shared library is missing for this architecture.
RUN /usr/local/bin/optimus-coord --version >/dev/null \
 && ! ldd /usr/local/bin/optimusctl | grep "not found"

USER 65532:65532
# State and checkpoint manifests (the chart mounts its PersistentVolumeClaim here).
WORKDIR /var/lib/optimus
VOLUME ["/var/lib/optimus"]
# gRPC (--listen) and /metrics + /healthz (--metrics_port), as the chart sets them.
EXPOSE 7070 9090
ENTRYPOINT ["/usr/local/bin/optimus-coord"]
CMD ["--listen=0.0.0.0:7070", "--metrics_port=9090"]
