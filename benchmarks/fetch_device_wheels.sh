#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels benchmarks/device_check.sh installs on the offline GPU machine
# (Python 3.12, x86_64 Linux) into ./device_wheels (git-ignored; about 3 MB): adaptdist's dependencies on the
# paths it runs, less torch (the machine's own), numpy and sympy (torch's), OR-Tools (not needed: manual plans)
# and matplotlib (plots only).
#   bash benchmarks/fetch_device_wheels.sh [PYTHON]    # PYTHON: the pip to use (default python3)
set -eu
cd "$(dirname "$0")/.."
"${1:-python3}" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --implementation cp -d device_wheels rich pyyaml safetensors
ls -l device_wheels && du -sh device_wheels
