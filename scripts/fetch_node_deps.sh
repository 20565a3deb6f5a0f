#!/usr/bin/env bash
# Installs the node packages of the server tests (tests/js/package.json: the official `openai`
# client and `playwright-core`, versions pinned, each checked against the sha512 integrity in
# tests/js/package-lock.json by `npm ci`) into the cache folder
# ${DSV3_CACHE:-$HOME/.cache/dsv3}/node/<sha256 of the lock file>/ and prints its node_modules
# folder. Already installed: prints it and does nothing else.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
lock="$root/tests/js/package-lock.json"
key="$(sha256sum "$lock" | cut -c1-16)"
dest="${DSV3_CACHE:-$HOME/.cache/dsv3}/node/$key"
if [ -f "$dest/node_modules/.dsv3-complete" ]; then
  echo "$dest/node_modules"; exit 0
fi
stage="$dest.partial.$$"
rm -rf "$stage"; mkdir -p "$stage"
trap 'rm -rf "$stage"' EXIT
cp "$root/tests/js/package.json" "$lock" "$stage/"
(cd "$stage" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
touch "$stage/node_modules/.dsv3-complete"
rm -rf "$dest"; mv "$stage" "$dest"
echo "$dest/node_modules"
