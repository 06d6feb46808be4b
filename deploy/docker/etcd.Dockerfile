# syntax=docker/dockerfile:1
# etcd for the coordinators' state (the Helm chart's etcd mode with its own
# etcd: coordinator.stateStore=etcd, no etcd.endpoints): Debian bookworm's
# etcd-server (3.4), nothing compiled, run as the chart's user 65532.
# Build (no build context needed):
#   docker buildx build -f deploy/docker/etcd.Dockerfile \
#     --platform linux/amd64 -t REGISTRY/optimus/etcd:TAG --push deploy/docker
FROM debian:bookworm-slim

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      etcd-server \
 && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 65532 etcd-optimus \
 && useradd --system --uid 65532 --gid 65532 --home-dir /var/lib/etcd --no-create-home \
      --shell /usr/sbin/nologin etcd-optimus \
 && install -d -o 65532 -g 65532 -m 0700 /var/lib/etcd

# Fails the build early if the binary cannot run here.
RUN /usr/bin/etcd --version >/dev/null

USER 65532:65532
# Member data (the chart mounts a PersistentVolumeClaim per member here).
WORKDIR /var/lib/etcd
VOLUME ["/var/lib/etcd"]
# Clients, peers, /health + /metrics (--listen-metrics-urls), as the chart sets them.
EXPOSE 2379 2380 2381
ENTRYPOINT ["/usr/bin/etcd"]
