# syntax=docker/dockerfile:1
# optimus-shard, one image for linux/amd64 (host fallback) and linux/arm64
# (BlueField DPUs). The binaries are built outside Docker and staged by
# deploy/docker/stage.sh into the build context:
#   CONTEXT/amd64/optimus-shard   bazel build //server:optimus-shard
#   CONTEXT/arm64/optimus-shard   deploy/aarch64/build.sh (cross build)
# Build (see deploy/docker/README.md):
#   docker buildx build -f deploy/docker/shard.Dockerfile \
#     --platform linux/amd64,linux/arm64 -t REGISTRY/optimus/optimus-shard:TAG --push out/docker
#
# Both binaries link Debian bookworm's shared libraries dynamically (no
# rpath), so the runtime stage installs the same packages, for the target
# architecture, from bookworm.
FROM debian:bookworm-slim

# Set by buildx from --platform: amd64 or arm64.
ARG TARGETARCH

# Runtime libraries of optimus-shard (what `ldd optimus-shard` resolves to):
# gRPC and protobuf (control plane), UCX (data plane; libucx0 brings
# libibverbs1, librdmacm1, libnuma1 and the verbs providers, mlx5 included),
# abseil, re2, c-ares, OpenSSL, libstdc++, and cpp-httplib for /metrics and
# /healthz (with brotli, which it links).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates \
      libgrpc++1.51 libgrpc29 libprotobuf32 \
      libucx0 ibverbs-providers libibverbs1 librdmacm1 libnuma1 \
      libabsl20220623 libre2-9 libc-ares2 libssl3 libstdc++6 zlib1g \
      libcpp-httplib0.11 libbrotli1 \
 && rm -rf /var/lib/apt/lists/*

# The non-root user the Helm chart runs the shard as (runAsUser 65532).
RUN groupadd --system --gid 65532 optimus \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin optimus

COPY --chmod=0755 ${TARGETARCH}/optimus-shard /usr/local/bin/optimus-shard

# Fails the build early if a shared library is missing for this architecture
# (under emulation for the other one; buildx uses qemu for that).
RUN /usr/local/bin/optimus-shard --version >/dev/null

USER 65532:65532
# --metrics_port serves /metrics and /healthz; the chart uses 9091.
EXPOSE 9091
ENTRYPOINT ["/usr/local/bin/optimus-shard"]
