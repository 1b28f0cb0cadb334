# etcd for Tidepool's cluster map, from Debian's `etcd-server` package, with
# `etcdctl` from `etcd-client` for its operators (health, snapshots, defrag,
# alarms: helm/README.md) — the binaries `make deps` installs on the host,
# copied in by `make image` — run as a non-root user. For clusters that do
# not bring their own etcd.
FROM debian:bookworm-slim
ARG VERSION=dev
LABEL org.opencontainers.image.title="tidepool-etcd" \
      org.opencontainers.image.description="etcd from Debian bookworm's etcd-server, for Tidepool" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10002 etcd \
 && useradd --system --uid 10002 --gid 10002 --home-dir /var/lib/etcd --shell /usr/sbin/nologin etcd \
 && mkdir -p /var/lib/etcd \
 && chown 10002:10002 /var/lib/etcd
COPY etcd etcdctl /usr/local/bin/
USER 10002:10002
WORKDIR /var/lib/etcd
EXPOSE 2379 2380
ENTRYPOINT ["/usr/local/bin/etcd"]
