#!/usr/bin/env bash
# Installs the Debian packages the build and tests need (root or sudo), then fetches the
# tokenizer and the node packages of the server tests. Idempotent: what is present is skipped.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pkgs=(build-essential cmake ninja-build pkg-config libpcre2-dev nlohmann-json3-dev libgtest-dev openmpi-bin libopenmpi-dev
      libgmock-dev libbenchmark-dev libcpp-httplib-dev clang libclang-rt-dev tmux nodejs npm
      chromium fonts-dejavu-core)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# nodejs/npm may come from outside Debian on some images: an npm on PATH is enough.
if command -v npm >/dev/null 2>&1; then
  missing=("${missing[@]/nodejs}"); missing=("${missing[@]/npm}")
fi
todo=(); for p in "${missing[@]}"; do [ -n "$p" ] && todo+=("$p"); done
if [ ${#todo[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "setup: installing ${todo[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${todo[@]}"
fi
"$here/fetch_node_deps.sh" >/dev/null
"$here/fetch_tokenizer.sh"
