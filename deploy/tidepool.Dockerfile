# The Tidepool image: the release `tidepool` (node, coordinator, dev,
# certs) and `tidectl` binaries on Debian bookworm, run as a non-root user.
# Built by `make image` from binaries compiled on the host (same Debian
# release, so the same glibc); nothing is pulled from a registry: the base
# is `debian:bookworm-slim` as `kube-local base-image` makes it locally.
FROM debian:bookworm-slim
ARG VERSION=dev
LABEL org.opencontainers.image.title="tidepool" \
      org.opencontainers.image.description="Tidepool: a distributed, replicated blob store (node, coordinator, tidectl)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://example.invalid/tidepool"
RUN groupadd --system --gid 10001 tidepool \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tidepool --shell /usr/sbin/nologin tidepool \
 && mkdir -p /var/lib/tidepool \
 && chown 10001:10001 /var/lib/tidepool
COPY tidepool tidectl /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/tidepool
# gRPC (coordinator 7400, nodes 7401) and Prometheus metrics (9400).
EXPOSE 7400 7401 9400
ENTRYPOINT ["/usr/local/bin/tidepool"]
CMD ["--help"]
