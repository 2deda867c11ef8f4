#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels benchmarks/device_check.sh installs on the offline GPU machine
# (Python 3.12, x86_64 Linux) into ./device_wheels (git-ignored; about 20 MB): adaptdist's dependencies on the
# paths it runs, less torch (the machine's own), sympy (torch's), OR-Tools (not needed: manual plans) and
# matplotlib (plots only). numpy is carried: torch's wheel does not depend on it, and safetensors' save_file
# (0.8: `_to_ndarray`) imports it for every checkpoint and program state adaptdist writes.
#   bash benchmarks/fetch_device_wheels.sh [PYTHON]    # PYTHON: the pip to use (default python3)
set -eu
cd "$(dirname "$0")/.."
"${1:-python3}" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --implementation cp -d device_wheels rich pyyaml safetensors numpy
ls -l device_wheels && du -sh device_wheels
