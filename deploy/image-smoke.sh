#!/usr/bin/env bash
# Smoke test of the image `make image` builds: it runs as a non-root user on
# a read-only root filesystem (data on a volume), `tidepool dev` starts in
# it with TLS and tokens, and `tidectl` in it stores and reads back a blob.
# Usage: deploy/image-smoke.sh IMAGE
set -euo pipefail
image=${1:?usage: image-smoke.sh IMAGE}
name=tidepool-smoke-$$
volume=tidepool-smoke-$$
cleanup() {
  docker rm -f "$name" >/dev/null 2>&1 || true
  docker volume rm "$volume" >/dev/null 2>&1 || true
}
trap cleanup EXIT

docker run --rm "$image" --version
docker volume create "$volume" >/dev/null
docker run -d --name "$name" --read-only -v "$volume:/var/lib/tidepool" \
  "$image" dev --port 7400 --data-dir /var/lib/tidepool/dev >/dev/null
for _ in $(seq 60); do
  docker logs "$name" 2>/dev/null | grep -q "ready" && break
  sleep 1
done
docker logs "$name" | grep -q "ready" || { docker logs "$name"; echo "dev mode never got ready" >&2; exit 1; }
uid=$(docker exec "$name" id -u)
[ "$uid" = 10001 ] || { echo "runs as uid $uid, not 10001" >&2; exit 1; }
docker exec -w /var/lib/tidepool "$name" sh -c '
  tidectl --dev-dir dev put default smoke /usr/local/bin/tidectl &&
  tidectl --dev-dir dev get default smoke | cmp - /usr/local/bin/tidectl &&
  tidectl --dev-dir dev cluster status | head -3'
echo "image smoke test passed: $image"
