#!/usr/bin/env bash
# The wheels the GPU machine must carry, downloaded here into .whl/ (git-ignored): that machine has
# no package registry. It has Python 3.12 with torch (CUDA), NCCL, pytest and the rest of the list
# in scripts/gpu_wheels_check.py (GPU_MACHINE); what it lacks is the Jupyter side elastic_nb and
# the `cuda` tests' kernels need (ipykernel, jupyter_client, ipywidgets, anywidget and what they
# require). scripts/gpu_check.sh installs them there with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# so the list below is the whole closure, one pinned version of each, checked against every
# wheel's Requires-Dist by scripts/gpu_wheels_check.py (run at the end; tests/test_gpu_check.py
# runs it too). A few the GPU machine has at a version we cannot see are carried anyway, where a
# wheel here needs more than an older one gives: anyio (elastic_nb needs >= 4.14), cloudpickle
# (>= 3.0), psutil (ipython needs >= 7), typing_extensions (anyio needs >= 4.16).
#
#   bash scripts/gpu_wheels.sh            # make gpu-wheels
#
# The device tool carries .whl/ to the GPU machine: `carry: [".whl"]` (about 18 MB of its 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=${GPU_WHEELS_DIR:-.whl}

WHEELS=(
  # wheels:begin (scripts/gpu_wheels_check.py reads the pins between these two lines)
  # the kernel the tests and benchmarks drive, and its client
  ipykernel==7.4.0
  jupyter_client==8.10.0
  jupyter_core==5.9.1
  comm==0.2.3
  debugpy==1.8.22
  matplotlib-inline==0.2.2
  nest-asyncio2==1.7.4
  platformdirs==4.14.8
  pyzmq==27.3.0
  tornado==6.6.1
  traitlets==5.16.1
  # IPython (elastic_nb's magics) and what it needs
  ipython==9.18.1
  ipython_pygments_lexers==1.1.1
  decorator==5.3.1
  jedi==0.20.1
  parso==0.8.7
  prompt_toolkit==3.0.53
  wcwidth==0.9.4
  pexpect==4.9.0
  ptyprocess==0.7.0
  stack_data==0.6.3
  executing==2.3.0
  asttokens==3.0.2
  pure_eval==0.2.4
  # the dashboard's widgets
  ipywidgets==8.1.9
  widgetsnbextension==4.0.16
  jupyterlab_widgets==3.0.17
  anywidget==0.11.0
  psygnal==0.16.1
  # on the GPU machine at a version we cannot see: carried at one that meets every floor
  anyio==4.16.0
  cloudpickle==3.1.3
  psutil==7.2.2
  typing_extensions==4.16.0
  # wheels:end
)

tmp=$(mktemp -d "${DEST%/}.download.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp" "${WHEELS[@]}"
rm -rf "$DEST"
mv "$tmp" "$DEST"
trap - EXIT
"$PYTHON" scripts/gpu_wheels_check.py "$DEST"
