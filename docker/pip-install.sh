#!/bin/sh
# pip-install.sh PIP_INSTALL_ARGS...  (used inside the image build only)
#
# Installs into the build's virtual environment /opt/venv. When /wheels (docker/wheelhouse/ of
# the build context) holds wheels, installs from there only (`--no-index`: the build needs no
# network, and a missing wheel is an error, not a download); otherwise from the package index.
set -eu
PIP="/opt/venv/bin/python -m pip install --no-cache-dir --disable-pip-version-check"
if ls /wheels/*.whl >/dev/null 2>&1; then
    echo "pip-install (offline, from /wheels): $*"
    exec $PIP --no-index --find-links /wheels "$@"
fi
echo "pip-install (from the package index): $*"
exec $PIP "$@"
